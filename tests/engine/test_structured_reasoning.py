"""Structured output after reasoning, exact under speculation.

A constrained row in its reasoning phase thinks freely (any token but EOS); its grammar applies from
the token after its think end, from its start state. When a drafted block straddles the think end,
the positions up to it use the free mask and the ones after it the grammar's masks along the drafts.
Greedy equals constrained plain AR with the same rule (transformers, float64) in every mode, with
the think end landing at the first, a middle and the last position of emitted blocks, in a ragged
batch beside rows without a reasoning phase; thinking budgets force the think end (only it: the
grammar decides the answer's first token).
"""
from __future__ import annotations

from collections import Counter

import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from orthrus import OrthrusEngine, SamplingParams
from orthrus.constraints import parse_constraint
from orthrus.engine.host.grammar import _grammar
from orthrus.reasoning import ReasoningTokens
from support.constraints import PERSON, PROMPTS
from support.oracles import chi2_pvalue
from support.paths import TOKENIZER_DIR
from support.tiny_models import hf_twin, tiny_model

# The bundled tokenizer's <|im_end|>, <|endoftext|>, and 3802, which the model writes early in free
# text (indices 2 and 4 after PROMPTS[2] and [3]): so thinking rows would end at once unless EOS is
# excluded while they think.
EOS = (4095, 4093, 3802)
VOCAB = 4097
# 100 opens thinking; the model writes 39 by itself at indices 5-8 of these prompts' free text.
THINK = ReasoningTokens(start=100, end=39, separator=(198,))
CONSTRAINTS = [{"json_schema": PERSON}, {"regex": r"[a-z]{1,5}( [a-z]{1,5}){0,2}\."},
               {"choice": ["yes", "no", "maybe"]}, {"grammar": 'root ::= "(" [0-9]+ ("," [0-9]+)* ")"'}]
MAX_NEW = 40


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def model():
    # a closer diffusion twin than test_structured's: blocks of several accepted drafts, so the think
    # end lands inside them
    return tiny_model(seed=5, vocab=VOCAB, eos=list(EOS), block_size=4, diff_noise=0.1, scale=20.0)


@pytest.fixture(scope="module")
def lltok(tok):
    return llguidance.hf.from_tokenizer(tok, n_vocab=VOCAB, eos_token=list(EOS))


def _allowed(m: llguidance.LLMatcher) -> torch.Tensor:
    bits = np.frombuffer(m.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:VOCAB].astype(bool))


def reference_greedy(hf, lltok, prompt: list[int], structured: dict | None, budget: int | None) -> list[int]:
    """Plain AR with the rule: while thinking, no EOS (when constrained) and the think end forced at
    the budget (then the separator, when unconstrained); after the think end, the grammar's masks."""
    m = llguidance.LLMatcher(lltok, _grammar(parse_constraint(structured)), log_level=0) if structured else None
    thinking, out = THINK.opens_reasoning(prompt), []
    while len(out) < MAX_NEW:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        forced = THINK.forced[: 1 if m is not None else None]
        offset = len(out) - budget if budget is not None and THINK.opens_reasoning(prompt) else -1
        if 0 <= offset < len(forced) and THINK.end not in out[:budget]:
            t = forced[offset]
        else:
            if thinking and m is not None:
                logits[list(EOS)] = float("-inf")
            elif m is not None:
                logits = logits.masked_fill(~_allowed(m), float("-inf"))
            t = int(logits.argmax())
        out.append(t)
        if not thinking and m is not None:
            assert m.consume_token(t)
        thinking = thinking and t != THINK.end
        if t in EOS:
            break
    return out


def _run(engine: OrthrusEngine, prompts, params, speculative) -> tuple[list, list[list[int]]]:
    """Step the engine by hand → the outputs in order, and each row's generated count after each step
    (the boundaries of its emitted blocks)."""
    ids = [engine.add_request(p, sp, request_id=str(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    engine.scheduler.speculation.policy = engine.scheduler.speculation.policy   # the mode is the engine's (built per test)
    counts: list[list[int]] = [[] for _ in ids]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o
        for i, rid in enumerate(ids):
            r = engine.scheduler.requests.get(rid)
            if r is not None and r.slot >= 0:
                counts[i].append(int(engine.scheduler.table.count[r.slot]))
    outs = [done[rid] for rid in ids]
    return outs, [n + [len(o.token_ids)] for n, o in zip(counts, outs)]     # the last block ends the row


def _where_in_block(index: int, counts: list[int]) -> str:
    """Whether token ``index`` was the first, a middle or the last token of the block that emitted it."""
    ends = sorted(set(counts))
    start = max([c for c in ends if c <= index], default=0)
    end = min(c for c in ends if c > index)
    if end - start == 1:
        return "alone"
    return "first" if index == start else "last" if index == end - 1 else "middle"


CASES = ([(PROMPTS[i % 4] + [100], CONSTRAINTS[i % 4], None) for i in range(4)]        # their own think end
         + [(PROMPTS[i % 4] + [100], CONSTRAINTS[(i + 1) % 4], b) for i, b in enumerate(range(12))]   # forced at 0..11
         + [(PROMPTS[1], CONSTRAINTS[0], None), (PROMPTS[0] + [100], None, 3), (PROMPTS[2] + [100], None, None)])


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_greedy_structured_after_thinking_equals_constrained_ar(model, tok, lltok, speculative):
    hf = hf_twin(model)
    engine = OrthrusEngine(model, max_batch_size=5, tokenizer=tok, reasoning=THINK, speculative=speculative)
    params = [SamplingParams(max_new_tokens=MAX_NEW, structured=c, max_thinking_tokens=b) for _, c, b in CASES]
    outs, counts = _run(engine, [p for p, _, _ in CASES], params, speculative)
    places = set()
    for (prompt, c, budget), o, n in zip(CASES, outs, counts):
        assert o.token_ids == reference_greedy(hf, lltok, prompt, c, budget), (c, budget)
        if THINK.opens_reasoning(prompt):
            closed = THINK.end in o.token_ids
            assert closed or budget is None        # a budget always closes it
            assert o.num_reasoning_tokens == (o.token_ids.index(THINK.end) + 1 if closed else len(o.token_ids))
            if closed:
                places.add(_where_in_block(o.num_reasoning_tokens - 1, n))
        else:
            assert o.num_reasoning_tokens is None
    assert any(o.finish_reason == "stop" for o in outs[:16])          # complete answers after thinking
    if speculative is True:
        assert {"first", "last"} <= places, places    # inside emitted blocks (every position: the oracle test)


class RowOracle:
    """Proposes each row's known constrained continuation (by request id), so a cycle accepts whole
    blocks and the think end lands at every position of one."""

    def __init__(self, sequences: dict[str, list[int]]) -> None:
        self.sequences, self.engine = sequences, None

    def propose(self, anchor, batch, cache, slots, backend):
        b, k = batch.positions.shape
        logits = torch.zeros(b, k - 1, VOCAB, dtype=torch.float64)
        for i, slot in enumerate(slots.tolist()):
            seq = self.sequences[self.engine.scheduler.table.requests[slot].request_id]
            n = int(batch.positions[i, 0])
            for j in range(k - 1):
                logits[i, j, seq[n + 1 + j] if n + 1 + j < len(seq) else 0] = 10.0
        return logits


def test_think_end_at_every_position_of_accepted_blocks(model, tok, lltok):
    hf = hf_twin(model)
    expected = [reference_greedy(hf, lltok, p, c, b) for p, c, b in CASES]
    oracle = RowOracle({str(i): p + e for i, ((p, _, _), e) in enumerate(zip(CASES, expected))})
    engine = OrthrusEngine(model, max_batch_size=5, tokenizer=tok, reasoning=THINK, proposer=oracle)
    oracle.engine = engine
    params = [SamplingParams(max_new_tokens=MAX_NEW, structured=c, max_thinking_tokens=b) for _, c, b in CASES]
    outs, counts = _run(engine, [p for p, _, _ in CASES], params, True)
    assert [o.token_ids for o in outs] == expected
    places = [_where_in_block(o.num_reasoning_tokens - 1, n) for o, n in zip(outs, counts) if THINK.end in o.token_ids]
    assert {"first", "middle", "last"} <= set(places), places
    assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0.8 * sum(o.stats.num_draft_tokens for o in outs)


def test_every_answer_after_thinking_validates(model, tok):
    """The structured suite with thinking on (sampled, budgets spent and not): every row that stops
    has an answer (the text after its think end) that validates, checked without the grammar engine."""
    from jobs.structured_suite import SUITE, valid
    engine = OrthrusEngine(model, max_batch_size=16, tokenizer=tok, reasoning=THINK)
    cases = [(case, PROMPTS[i % 4] + [100], budget, seed) for case in SUITE for i, (budget, seed)
             in enumerate([(None, 0), (2, 1), (6, 2), (12, 3)])]
    params = [SamplingParams(max_new_tokens=64, temperature=1.0, seed=seed, structured=case.structured,
                             max_thinking_tokens=budget) for case, _, budget, seed in cases]
    outs = engine.generate([p for _, p, _, _ in cases], params)
    stopped, validated = Counter(), Counter()
    for (case, _, budget, _), o in zip(cases, outs):
        assert o.num_reasoning_tokens is not None and (budget is None or o.num_reasoning_tokens <= budget + 1)
        if o.finish_reason == "stop":
            kind = next(iter(case.structured))
            answer = o.token_ids[o.num_reasoning_tokens:-1]            # after the think end, before EOS
            stopped[kind] += 1
            validated[kind] += valid(case, tok.decode(answer))
    assert set(stopped) == {"json_schema", "regex", "choice", "grammar"}, stopped
    assert validated == stopped, (validated, stopped)
    print("validity", dict(stopped), "of", len(cases))


# -- sampling: the constrained-after-thinking AR distribution, enumerated ------------------------
PATTERN = {"regex": "[ab]{1,3}"}
BUDGET, TOP_K, N = 2, 3, 3000


def _exact_after_thinking(hf, lltok, prompt: list[int], temperature: float) -> dict[tuple[int, ...], float]:
    """P(token sequence) under AR sampling with the rules (thinking: no EOS, the think end forced at
    ``BUDGET``; then the grammar's masks), processed as the engine does (temperature, top-k)."""
    from orthrus.sampling import SamplingTensors, process
    st = SamplingTensors(torch.tensor([temperature], dtype=torch.float64), torch.tensor([TOP_K]),
                         torch.ones(1, dtype=torch.float64), torch.zeros(1, dtype=torch.bool), True)
    m = llguidance.LLMatcher(lltok, _grammar(parse_constraint(PATTERN)), log_level=0)
    dist: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float, thinking: bool) -> None:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(prefix)])).logits[0, -1].clone()
        if thinking and len(prefix) == BUDGET:
            logits = torch.full_like(logits, float("-inf"))
            logits[THINK.end] = 0.0
        elif thinking:
            logits[list(EOS)] = float("-inf")
        else:
            logits = logits.masked_fill(~_allowed(m), float("-inf"))
        probs = process(logits[None, None], st)[0, 0]
        for t in torch.nonzero(probs > 0).flatten().tolist():
            p = prob * float(probs[t])
            if t in EOS:
                dist[prefix + (t,)] = dist.get(prefix + (t,), 0.0) + p
            elif thinking:
                walk(prefix + (t,), p, t != THINK.end)
            else:
                assert m.consume_token(t)
                walk(prefix + (t,), p, False)
                m.rollback(1)

    walk((), 1.0, True)
    return dist


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_sampled_structured_after_thinking_matches_the_ar_distribution(tok, lltok, speculative):
    model = tiny_model(seed=5, vocab=VOCAB, eos=list(EOS), block_size=4, diff_noise=0.5, scale=20.0)
    hf = hf_twin(model)
    prompt = PROMPTS[1] + [100]
    exact = _exact_after_thinking(hf, lltok, prompt, 0.8)
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) > 10
    engine = OrthrusEngine(model, max_batch_size=256, tokenizer=tok, reasoning=THINK)
    params = [SamplingParams(temperature=0.8, top_k=TOP_K, seed=s, max_new_tokens=12, structured=PATTERN,
                             max_thinking_tokens=BUDGET) for s in range(N)]
    outs = engine.generate([prompt] * N, params, speculative=speculative)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert set(counts) <= set(exact), "sampled a sequence the constrained AR model gives zero mass"
    assert chi2_pvalue(counts, exact, N) > 1e-3
    if speculative is True:
        hist = np.sum([o.stats.accept_length_histogram for o in outs], axis=0)
        assert hist[0] > 0 and hist[1:].sum() > 0                  # rejections and acceptances both occur
        assert chi2_pvalue(counts, _exact_after_thinking(hf, lltok, prompt, 1.0), N) < 1e-6    # it has power
