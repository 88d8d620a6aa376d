"""Stop strings inside the engine, with the bundled model and its real tokenizer.

A row ends in the iteration its stop string appears; its ids end where the text ends right before
the stop string; the text is cut exactly there. Checked for a string split across two tokens and for
one inside a fully accepted block (an oracle proposer that replays the AR continuation).
"""
from __future__ import annotations


import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.engine.host.stop_strings import StopStringScanner
from support.oracles import OracleProposer
from support.paths import TOKENIZER_DIR

BUNDLED = TOKENIZER_DIR
PROMPT = 'def finalize_unix(self):\n    """Finalizes options for posix platforms."""\n'
MAX_NEW = 64


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(BUNDLED))


@pytest.fixture(scope="module")
def model():
    return OrthrusForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32)


@pytest.fixture(scope="module")
def free_run(model, tok):
    """The greedy completion without stop strings: (prompt ids, generated ids)."""
    ids = tok(PROMPT)["input_ids"]
    out = OrthrusEngine(model, max_batch_size=1).generate([ids], SamplingParams(max_new_tokens=MAX_NEW))[0]
    return ids, out.token_ids


def split_stop(tok, gen: list[int], start: int = 3, ok=lambda end: True) -> tuple[str, int]:
    """A short stop string straddling a token boundary and first seen there, completed by token
    ``end - 1`` with ``ok(end)`` → (stop, end)."""
    text = tok.decode(gen, skip_special_tokens=True)
    for i in range(start, len(gen) - 1):
        c = len(tok.decode(gen[: i + 1], skip_special_tokens=True))
        if tok.decode(gen[: i + 1]) != text[:c] or not ok(i + 2):
            continue
        for width in (2, 3, 4):
            for left in range(1, width):
                stop = text[c - left: c - left + width]
                if len(stop) == width and text.find(stop) == c - left and stop in tok.decode(gen[: i + 2]):
                    return stop, i + 2
    pytest.skip("no token boundary with a fresh short string")


def check_cut(tok, out, stop: str, gen: list[int], block: int) -> int:
    """Assert the row was cut right → the number of tokens up to the one completing the stop."""
    text = tok.decode(gen, skip_special_tokens=True)
    at = text.find(stop)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:at]                                     # cut exactly before the stop
    assert out.token_ids == gen[: len(out.token_ids)]                # lossless: a prefix of the free run
    assert len(tok.decode(out.token_ids)) <= at < len(tok.decode(gen[: len(out.token_ids) + 1]))
    # ended in the iteration the stop string appeared: what came after it is the rest of that block
    end = next(n for n in range(1, len(gen) + 1) if stop in tok.decode(gen[:n], skip_special_tokens=True))
    assert out.stats.num_tokens_after_stop < block
    return end


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False])
def test_stop_string_split_across_tokens(model, tok, free_run, speculative):
    ids, gen = free_run
    stop, _ = split_stop(tok, gen)
    engine = OrthrusEngine(model, max_batch_size=2, speculative=speculative, tokenizer=tok)
    outs = engine.generate([ids, ids], [SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,)),
                                        SamplingParams(max_new_tokens=MAX_NEW)])
    check_cut(tok, outs[0], stop, gen, engine.block_size if speculative else 1)
    assert outs[1].token_ids == gen                                   # the row without stops is untouched
    assert outs[1].text == tok.decode(gen, skip_special_tokens=True)  # and decoded whole


def test_stop_string_inside_an_accepted_block(model, tok, free_run):
    ids, gen = free_run
    k = model.block_size
    oracle = OracleProposer(ids + gen, model.config.vocab_size)
    # every draft verified (adaptive_verify=False): the blocks this test counts are whole K blocks
    engine = OrthrusEngine(model, max_batch_size=1, proposer=oracle, tokenizer=tok, adaptive_verify=False)
    full = engine.generate([ids], SamplingParams(max_new_tokens=MAX_NEW))[0]
    # every draft accepted (the last cycle's block is capped by the tokens left, so count drafts)
    assert full.token_ids == gen and full.stats.num_accepted_draft_tokens == full.stats.num_draft_tokens
    # token 0 comes from the prefill, then blocks of K: a stop ending mid-block leaves tokens after it
    stop, _ = split_stop(tok, gen, start=k + 1, ok=lambda end: (end - 1) % k != 0)   # not a block's last token
    out = OrthrusEngine(model, max_batch_size=1, proposer=oracle, tokenizer=tok, adaptive_verify=False).generate(
        [ids], SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,)))[0]
    end = check_cut(tok, out, stop, gen, k)
    assert out.stats.num_cycles < full.stats.num_cycles
    block_end = 1 + k * -(-(end - 1) // k)                           # tokens through the block holding `end`
    assert out.stats.num_tokens_after_stop == block_end - end > 0


def test_scanner_finds_a_stop_at_the_token_that_completes_it(tok):
    scanner = StopStringScanner(tok)
    ids = tok("    return x\n\ndef g():\n    pass", add_special_tokens=False)["input_ids"]
    arr = np.asarray(ids)
    first = next(n for n in range(1, len(ids) + 1) if "\ndef " in tok.decode(ids[:n]))
    hits = [n for n in range(1, len(ids) + 1) if scanner.scan(arr[:n], n - 1, ("\ndef ", "nope")) is not None]
    assert hits[0] == first
    hit = scanner.cut(arr, ("\ndef ",))
    assert hit.text == "    return x\n" and hit.stop == "\ndef " and hit.end == first
    kept = tok.decode(ids[: hit.keep])          # "\n\n" may be one token: the text keeps its first "\n"
    assert "    return x\n".startswith(kept) and not "    return x\n".startswith(tok.decode(ids[: hit.keep + 1]))
    assert scanner.cut(arr, ("absent",)) is None
