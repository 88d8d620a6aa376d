"""The streaming engine: requests added at random steps, aborts, shared prefills (tiny float64 models)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from orthrus import OrthrusEngine, SamplingParams
from support.tiny_models import hf_greedy, hf_twin, tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [3, 1, 4, 1, 5, 9, 2, 6],
           [20, 21], [30, 31, 32, 33, 34]]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=11, diff_noise=0.2, scale=3.0)


def run_streaming(engine: OrthrusEngine, prompts, params, seed: int, start: int = 2) -> dict:
    """Add ``start`` requests, then the rest one at a time at random steps while others decode."""
    rnd = random.Random(seed)
    plist = params if isinstance(params, list) else [params] * len(prompts)
    todo = list(enumerate(zip(prompts, plist)))
    out = {}
    for i, (p, sp) in todo[:start]:
        engine.add_request(p, sp, request_id=str(i))
    todo = todo[start:]
    while todo or engine.has_unfinished_requests():
        if todo and rnd.random() < 0.4:
            i, (p, sp) = todo.pop(0)
            engine.add_request(p, sp, request_id=str(i))
        for o in engine.step():
            assert o.request_id not in out, "a request was returned twice"
            out[o.request_id] = o
    return {int(k): v for k, v in out.items()}


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [True, False, "auto"])
def test_mid_flight_greedy_equals_transformers(model, speculative):
    hf = hf_twin(model)
    engine = OrthrusEngine(model, max_batch_size=3, speculative=speculative)
    params = SamplingParams(max_new_tokens=24)
    got = run_streaming(engine, PROMPTS, params, seed=1)
    assert sorted(got) == list(range(len(PROMPTS)))
    for i, prompt in enumerate(PROMPTS):
        assert got[i].token_ids == hf_greedy(hf, prompt, 24, model.eos_token_ids), i
        assert got[i].finish_reason in ("stop", "length") and got[i].engine_seconds >= 0


@pytest.mark.slow
def test_seeded_sampling_identical_alone_together_and_mid_flight(model):
    params = [SamplingParams(temperature=0.9, top_k=20 if i % 2 else 0, top_p=0.9 if i % 3 else 1.0,
                             max_new_tokens=20, seed=100 + i) for i in range(len(PROMPTS))]
    for speculative in (True, False):
        alone = [OrthrusEngine(model, max_batch_size=1).generate([p], [sp], speculative=speculative)[0].token_ids
                 for p, sp in zip(PROMPTS, params)]
        together = [r.token_ids for r in OrthrusEngine(model, max_batch_size=8).generate(PROMPTS, params,
                                                                                          speculative=speculative)]
        streamed = run_streaming(OrthrusEngine(model, max_batch_size=3, speculative=speculative), PROMPTS, params,
                                 seed=7)
        assert together == alone
        assert [streamed[i].token_ids for i in range(len(PROMPTS))] == alone


def test_abort_waiting_and_running_requests(model):
    engine = OrthrusEngine(model, max_batch_size=2)
    params = SamplingParams(max_new_tokens=40, stop_token_ids=())
    for i in range(3):
        engine.add_request(PROMPTS[i], params, request_id=f"r{i}")
    assert engine.num_waiting == 3 and engine.num_running == 0
    first = engine.step()                       # r0, r1 admitted and one cycle run; r2 waits
    assert engine.num_running + len(first) == 2 and engine.num_waiting == 1
    engine.abort_request("r2")                  # waiting
    engine.abort_request("r0")                  # running
    engine.abort_request("r0")                  # twice: still returned once
    engine.abort_request("nope")                # unknown: no-op
    out = {o.request_id: o for o in engine.step()}
    assert out["r2"].finish_reason == "abort" and out["r2"].token_ids == []
    assert out["r0"].finish_reason == "abort" and 1 <= len(out["r0"].token_ids) < 40
    engine.add_request(PROMPTS[3], params, request_id="r3")
    rest = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.request_id not in rest and o.request_id not in out
            rest[o.request_id] = o
    assert set(rest) == {"r1", "r3"}
    # the aborted slot was reused by r3, and r3 decodes as if alone
    alone = OrthrusEngine(model, max_batch_size=1).generate([PROMPTS[3]], params)[0]
    assert rest["r3"].token_ids == alone.token_ids
    # the aborted row's tokens are a prefix of what it would have generated
    full = OrthrusEngine(model, max_batch_size=1).generate([PROMPTS[0]], params)[0].token_ids
    assert full[: len(out["r0"].token_ids)] == out["r0"].token_ids


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_shared_prefill_equals_separate_prefills(model, temperature):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    params = [SamplingParams(temperature=temperature, max_new_tokens=16, seed=s) for s in range(4)]
    shared = OrthrusEngine(model, max_batch_size=6)
    got = shared.generate([prompt] * 4 + [[1, 2]], params + [SamplingParams(max_new_tokens=16)])
    assert shared.stats.prefill_tokens == len(prompt) + 2        # the prompt once, not 4 times
    for p, r in zip(params, got):
        alone = OrthrusEngine(model, max_batch_size=1)
        assert r.token_ids == alone.generate([prompt], p)[0].token_ids
        assert alone.stats.prefill_tokens == len(prompt)
    if temperature:
        assert len({tuple(r.token_ids) for r in got[:4]}) > 1   # each sample keeps its own stream


def test_request_ids_and_idle_generate(model):
    engine = OrthrusEngine(model, max_batch_size=2)
    rid = engine.add_request([1, 2], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], SamplingParams(), request_id=rid)
    with pytest.raises(RuntimeError, match="idle engine"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="tokenizer"):
        engine.add_request([1], SamplingParams(stop=("x",)))
    with pytest.raises(ValueError, match="speculative"):
        OrthrusEngine(model, speculative="sometimes")
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.step() == []
    assert len(engine.generate([[1]], SamplingParams(max_new_tokens=3))[0].token_ids) <= 3


def test_wider_stop_ids_mid_flight(model):
    """A request with more stop ids than the slot table holds widens it without disturbing others."""
    engine = OrthrusEngine(model, max_batch_size=2)
    plain = SamplingParams(max_new_tokens=30)
    engine.add_request(PROMPTS[1], plain, request_id="a")
    engine.step()
    many = SamplingParams(max_new_tokens=30, stop_token_ids=tuple(range(40, 60)))
    engine.add_request(PROMPTS[2], many, request_id="b")
    out = {}
    while engine.has_unfinished_requests():
        out.update((o.request_id, o) for o in engine.step())
    ref = OrthrusEngine(model, max_batch_size=1)
    assert out["a"].token_ids == ref.generate([PROMPTS[1]], plain)[0].token_ids
    assert out["b"].token_ids == ref.generate([PROMPTS[2]], many)[0].token_ids


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_prompt_shared_across_steps_with_a_running_slot(model, static):
    """n samples of one prompt through 2 slots: later samples copy a running sibling's prompt state."""
    prompt = [7, 8, 9, 10, 11, 12]
    lengths = [5, 40, 8, 12, 6]           # the second sample keeps running while the others come and go
    params = [SamplingParams(temperature=0.9, max_new_tokens=n, seed=10 + i, stop_token_ids=(63,))
              for i, n in enumerate(lengths)]
    engine = OrthrusEngine(model, max_batch_size=2, static_shapes=static)
    got = engine.generate([prompt] * len(lengths), params)
    assert engine.stats.prefill_tokens == len(prompt)                 # once for all five samples
    for p, r in zip(params, got):
        assert r.token_ids == OrthrusEngine(model, max_batch_size=1).generate([prompt], p)[0].token_ids


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_finished_rows_lend_their_whole_prompt_pages(model, static):
    """4 samples of a 37-token prompt (two whole 16-token pages and 5 more), 2 slots, all finishing
    together: the first two compute it once; the next two find its whole pages cached (static
    padding writes only the null page) and compute the 5-token tail once."""
    prompt = [int(t) for t in np.random.default_rng(7).integers(1, 60, 37)]
    params = [SamplingParams(temperature=0.8, max_new_tokens=7, seed=s, stop_token_ids=()) for s in range(4)]
    engine = OrthrusEngine(model, max_batch_size=2, static_shapes=static)
    got = engine.generate([prompt] * 4, params)
    assert engine.stats.prefill_tokens == len(prompt) + 5
    for p, r in zip(params, got):
        assert r.token_ids == OrthrusEngine(model, max_batch_size=1).generate([prompt], p)[0].token_ids
