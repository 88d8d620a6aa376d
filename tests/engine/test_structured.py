"""Structured output is lossless: constrained greedy == constrained plain AR (transformers, float64),
constrained sampling matches the constrained AR distribution (χ²), in every mode and batch shape.

The reference masks come from llguidance used directly here (a fresh matcher walked token by token),
not from the engine's per-slot bookkeeping and draft-path masks; the reference logits from
transformers' own Qwen3.
"""
from __future__ import annotations

from collections import Counter

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from support.paths import TOKENIZER_DIR
from orthrus import OrthrusEngine, SamplingParams
from orthrus.testing.host_syncs import count_host_reads
from support.constraints import PERSON, PROMPTS
from support.oracles import chi2_pvalue
from support.tiny_models import hf_twin, tiny_model

EOS = (4095, 4093)          # the bundled tokenizer's <|im_end|>, <|endoftext|>
VOCAB = 4097                # its 4,096 tokens + the mask token
CONSTRAINTS = [{"json_schema": PERSON}, {"regex": r"[a-z]{1,5}( [a-z]{1,5}){0,2}\."},
               {"choice": ["yes", "no", "maybe"]}, {"grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'}, None]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def model():
    # the bundled tokenizer's vocabulary; perturbed twins so drafts are partly rejected; a scaled head
    # so the distributions are peaked enough for the tests to have power
    return tiny_model(seed=5, vocab=VOCAB, eos=list(EOS), block_size=4, diff_noise=0.5, scale=20.0)


@pytest.fixture(scope="module")
def hf(model):
    return hf_twin(model)


@pytest.fixture(scope="module")
def lltok(tok):
    return llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=list(EOS))


def matcher(lltok, structured: dict) -> llguidance.LLMatcher:
    from orthrus.engine.host.grammar import _grammar
    from orthrus.constraints import parse_constraint
    return llguidance.LLMatcher(lltok, _grammar(parse_constraint(structured)), log_level=0)


def allowed(m: llguidance.LLMatcher) -> torch.Tensor:
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:VOCAB].astype(bool))


def next_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def reference_greedy(hf, lltok, prompt: list[int], structured: dict | None, max_new: int) -> list[int]:
    """Constrained plain AR: argmax of the logits the grammar allows, token by token."""
    m = matcher(lltok, structured) if structured else None
    out: list[int] = []
    while len(out) < max_new:
        logits = next_logits(hf, prompt + out)
        if m is not None:
            logits = logits.masked_fill(~allowed(m), float("-inf"))
        t = int(logits.argmax())
        out.append(t)
        if m is not None:
            assert m.consume_token(t)
        if t in EOS:
            break
    return out


def _params(structured, max_new=24, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new, structured=structured, **kw)


@pytest.mark.parametrize("speculative", [True, False, "auto"])
def test_greedy_equals_constrained_ar_in_a_ragged_mixed_batch(model, hf, tok, lltok, speculative):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(CONSTRAINTS))]
    engine = OrthrusEngine(model, max_batch_size=3, tokenizer=tok)   # fewer slots than rows: refills
    outs = engine.generate(prompts, [_params(c) for c in CONSTRAINTS], speculative=speculative)
    for p, c, o in zip(prompts, CONSTRAINTS, outs):
        assert o.token_ids == reference_greedy(hf, lltok, p, c, 24), c
    assert any(o.finish_reason == "stop" for o in outs[:-1])


def test_greedy_static_shapes_and_mid_flight_requests(model, hf, tok, lltok):
    engine = OrthrusEngine(model, max_batch_size=4, tokenizer=tok, static_shapes=True)
    first = engine.add_request(PROMPTS[1], _params(None, max_new=30))
    done = {o.request_id: o for o in engine.step()}
    ids = {first: (PROMPTS[1], None)}
    for p, c in zip(PROMPTS, CONSTRAINTS[:4]):        # added while the first row decodes
        ids[engine.add_request(p, _params(c))] = (p, c)
        done.update((o.request_id, o) for o in engine.step())
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    for rid, (p, c) in ids.items():
        assert done[rid].token_ids == reference_greedy(hf, lltok, p, c, 30 if c is None else 24)


def test_stopped_rows_are_complete_and_unconstrained_rows_unchanged(model, tok, lltok):
    engine = OrthrusEngine(model, max_batch_size=5, tokenizer=tok)
    outs = engine.generate([PROMPTS[0]] * 5, [_params(c, max_new=40) for c in CONSTRAINTS])
    for c, o in zip(CONSTRAINTS[:-1], outs):
        if o.finish_reason == "stop":
            m = matcher(lltok, c)
            assert o.token_ids[-1] in EOS and all(m.consume_token(t) for t in o.token_ids[:-1]) and m.is_accepting()
    alone = OrthrusEngine(model, max_batch_size=1).generate([PROMPTS[0]], _params(None, max_new=40))
    assert outs[-1].token_ids == alone[0].token_ids


# -- sampling: the constrained AR distribution, enumerated --------------------------------------
PATTERN = {"regex": "[ab]{1,3}"}
TEMPERATURE, N = 0.8, 3000


def exact_distribution(hf, lltok, prompt: list[int], temperature: float) -> dict[tuple[int, ...], float]:
    """P(token sequence) under constrained AR sampling: masked logits / T, softmax; every path."""
    dist: dict[tuple[int, ...], float] = {}
    m = matcher(lltok, PATTERN)

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        logits = next_logits(hf, prompt + list(prefix)).masked_fill(~allowed(m), float("-inf"))
        probs = (logits / temperature).softmax(-1)
        for t in torch.nonzero(probs > 0).flatten().tolist():
            if t in EOS:     # the end: not consumed (a rolled-back end token confuses llguidance 1.9.1)
                dist[prefix + (t,)] = dist.get(prefix + (t,), 0.0) + prob * float(probs[t])
                continue
            assert m.consume_token(t)
            walk(prefix + (t,), prob * float(probs[t]))
            m.rollback(1)

    walk((), 1.0)
    return dist


@pytest.fixture(scope="module")
def exact(hf, lltok):
    dist = exact_distribution(hf, lltok, PROMPTS[1], TEMPERATURE)
    assert abs(sum(dist.values()) - 1) < 1e-9 and len(dist) > 10
    return dist


def _sample(model, tok, speculative, seed0: int) -> tuple[Counter, list]:
    engine = OrthrusEngine(model, max_batch_size=256, tokenizer=tok)
    params = [SamplingParams(temperature=TEMPERATURE, seed=seed0 + s, max_new_tokens=8, structured=PATTERN)
              for s in range(N)]
    outs = engine.generate([PROMPTS[1]] * N, params, speculative=speculative)
    return Counter(tuple(o.token_ids) for o in outs), outs


@pytest.fixture(scope="module")
def spec_counts(model, tok):
    counts, outs = _sample(model, tok, True, 0)
    hist = np.sum([o.stats.accept_length_histogram for o in outs], axis=0)
    assert hist[0] > 0 and hist[1:].sum() > 0                  # rejections and acceptances both occur
    return counts


@pytest.mark.slow
def test_speculative_constrained_samples_match_constrained_ar(exact, spec_counts):
    assert set(spec_counts) <= set(exact), "sampled a sequence constrained AR gives zero mass"
    assert chi2_pvalue(spec_counts, exact, N) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [False, "auto"])
def test_ar_and_auto_constrained_samples_match(model, tok, exact, speculative):
    counts, _ = _sample(model, tok, speculative, 10**6)
    assert chi2_pvalue(counts, exact, N) > 1e-3


@pytest.mark.slow
def test_constrained_chi2_has_power(hf, lltok, spec_counts):
    wrong = exact_distribution(hf, lltok, PROMPTS[1], 1.0)
    assert chi2_pvalue(spec_counts, wrong, N) < 1e-6


# -- cost and errors ---------------------------------------------------------------------------
def test_host_reads_one_extra_only_in_constrained_cycles(model, tok):
    for structured, speculative, reads_per_iteration in [(None, True, 1), (PATTERN, True, 2), (PATTERN, False, 1)]:
        engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok)
        with count_host_reads() as reads:
            engine.generate(PROMPTS[:2], _params(structured, max_new=6, temperature=0.7, seed=1),
                            speculative=speculative)
        # one read per step: one per iteration, and the step in which constrained rows only read
        # their first tokens (their masks need them); one more in each constrained cycle (its
        # drafts, for the grammar masks along them)
        assert reads["cpu"] == engine.stats.read_steps == engine.stats.iterations + (1 if structured else 0)
        assert reads["d2h"] == (engine.stats.iterations if reads_per_iteration == 2 else 0)


@pytest.mark.parametrize("structured, field", [({"regex": "a(b"}, "structured.regex"),
                                               ({"json_schema": {"type": "objekt"}}, "structured.json_schema"),
                                               ({"grammar": "start: undefined_rule"}, "structured.grammar")])
def test_a_constraint_that_does_not_compile_is_that_requests_error(model, tok, structured, field):
    engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        engine.add_request(PROMPTS[0], _params(structured))
    assert not engine.has_unfinished_requests()
    assert engine.generate([PROMPTS[0]], _params(CONSTRAINTS[2]))[0].finish_reason in ("stop", "length")


def test_structured_needs_a_tokenizer_and_excludes_stops(model):
    with pytest.raises(ValueError, match="needs a tokenizer"):
        OrthrusEngine(model, max_batch_size=1).add_request(PROMPTS[0], _params(PATTERN))
    with pytest.raises(ValueError, match="stop_token_ids cannot be combined with structured"):
        SamplingParams(structured=PATTERN, stop_token_ids=(3,))
    with pytest.raises(ValueError, match="exactly one of"):
        SamplingParams(structured={"regex": "a", "choice": ["a"]})


def test_json_properties_come_in_the_schemas_order(model, tok):
    engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok)
    reverse = dict(PERSON, properties=dict(reversed(PERSON["properties"].items())))
    outs = engine.generate([PROMPTS[0]] * 2, [_params({"json_schema": s}, max_new=8) for s in (PERSON, reverse)])
    assert tok.decode(outs[0].token_ids).startswith('{"name": ') and tok.decode(outs[1].token_ids).startswith('{"age": ')
