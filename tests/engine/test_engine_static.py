"""The GPU path's departures from the eager loop, checked on the CPU (no test needs a GPU).

1. Static shapes — occupied slots padded with dead free slots to a bucket of rows, every forward over
   the whole cache — which is what ``graphs.py`` captures as CUDA graphs: not one token changes.
2. The FlashAttention KV-cache calling convention (layout views, int32 lengths, slot indices,
   bottom-right causal alignment, in-place append): ``flash_attn_with_kvcache`` cannot run here, so
   its documented semantics are written out below in plain torch and plugged in as the engine's
   backend's kernel; the engine must give exactly the SDPA path's tokens through it.
3. Capturability: the static iteration traces as ONE graph with no breaks (a ``.item()``, a
   data-dependent shape or Python branching on a tensor would break it, and would break capture).
"""
from __future__ import annotations

import traceback
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from orthrus.engine.packed import TRAILER
from orthrus import OrthrusEngine, SamplingParams
from orthrus.engine.device.graphs import bucket, key_bound, pad_slots
from orthrus.engine.step import Iteration, SamplingPaths
from orthrus.model.backends import FlashKVCache
from support.oracles import reference_flash_attn_with_kvcache
from support.tiny_models import tiny_model

NONE = np.arange(0)   # no busy slots

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [18, 19, 20, 21, 22, 23],
           [24, 25, 26], [27], [28, 29], [30, 31, 32, 33, 34]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)
SAMPLED = [SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=20, seed=i) for i in range(10)]


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3, diff_noise=0.3, scale=4.0)


def _run(model, params, speculative, static: bool, flash: bool, slots: int = 5, adaptive_verify: bool = False):
    # adaptive_verify off by default here: its budget follows wall time, and these runs compare the
    # acceptance bookkeeping too (tokens are the same either way: test_static_shapes_change_no_token)
    attention = FlashKVCache(reference_flash_attn_with_kvcache) if flash else "sdpa"
    engine = OrthrusEngine(model, max_batch_size=slots, static_shapes=static, attention=attention,
                           adaptive_verify=adaptive_verify)
    return [(r.token_ids, r.finish_reason, r.stats.accept_length_histogram, r.stats.num_ar_steps)
            for r in engine.generate(PROMPTS, params, speculative=speculative)]


def test_padding_buckets_use_free_slots_only():
    assert [bucket(n, 5) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]
    occupied = torch.tensor([4, 1, 3]).numpy()
    pad = pad_slots(occupied, 5)
    padded, where = pad.rows, pad.where
    assert len(padded) == 4 and len(set(padded)) == 4 and list(padded) == sorted(padded)
    assert list(padded[where]) == [4, 1, 3]


def test_static_sdpa_key_bounds_are_few_powers_of_two():
    assert [key_bound(n, 1056) for n in (0, 1, 200, 256, 257, 600, 1024, 1025, 1056)] == [
        256, 256, 256, 256, 512, 1024, 1024, 1056, 1056]
    assert len({key_bound(n, 40_000) for n in range(1, 40_001)}) == 9     # 256 … 32,768 and the capacity


def test_static_sdpa_iterations_use_few_key_bounds():
    """Rows growing past several bounds: every plan's bound covers its rows and is one of a few."""
    model = tiny_model(seed=1, max_pos=1200, eos=[])          # no EOS: rows run to max_new_tokens
    prompts = [[1, 2, 3], [1 + i % 60 for i in range(500)]]    # the long row crosses 512 keys
    params = SamplingParams(max_new_tokens=24)
    engine = OrthrusEngine(model, max_batch_size=2, max_seq_len=1100, static_shapes=True, attention="sdpa")
    seen = []
    plan = engine.runner.plan

    def spy(it, logprobs, busy):
        placed = plan(it, logprobs, busy)
        seen.append((it.kv_len, placed.plan.kv_len))
        return placed
    engine.runner.plan = spy
    out = engine.generate(prompts, params)
    eager = OrthrusEngine(model, max_batch_size=2, max_seq_len=1100, attention="sdpa").generate(prompts, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in eager]
    assert all(need <= bound for need, bound in seen)
    assert [len(r.token_ids) for r in out] == [24, 24]
    # 512 and 1024 as the long row grows (256 too if the short row runs on alone after it ends)
    assert {512, 1024} <= {bound for _, bound in seen} <= {256, 512, 1024}


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_static_shapes_change_no_token(model, params, speculative):
    eager = _run(model, params, speculative, static=False, flash=False)
    assert _run(model, params, speculative, static=True, flash=False) == eager
    # with a verify budget the tokens stay the same (greedy rows: it adapts; seeded sampled rows in
    # fixed speculation: it stays off, their draws depend on it)
    adaptive = _run(model, params, speculative, static=True, flash=False, adaptive_verify=True)
    assert [a[:2] for a in adaptive] == [e[:2] for e in eager]


def test_static_shapes_under_auto_stay_exact(model):
    # auto's choices follow wall time, so only greedy output is comparable run to run
    got = _run(model, GREEDY, "auto", static=True, flash=False)
    assert [g[:2] for g in got] == [e[:2] for e in _run(model, GREEDY, False, static=False, flash=False)]


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_flash_kvcache_convention_matches_sdpa(model, params, static):
    assert _run(model, params, True, static=static, flash=True) == _run(model, params, True, static=False, flash=False)


def test_flash_is_refused_where_it_cannot_run(model):
    with pytest.raises(ValueError, match="attention='flash' is unavailable"):
        OrthrusEngine(model, attention="flash")          # CPU, float64
    with pytest.raises(ValueError, match="attention must be one of"):
        OrthrusEngine(model, attention="xformers")
    assert OrthrusEngine(model).attention == "sdpa" and not OrthrusEngine(model).static_shapes


@pytest.mark.slow
@pytest.mark.parametrize("spec", [True, False, "budget"], ids=["cycle", "ar-step", "cycle-verify-budget"])
@pytest.mark.parametrize("all_greedy", [True, False], ids=["greedy", "sampled"])
def test_static_iteration_traces_as_one_graph(model, spec, all_greedy):
    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=True)
    engine.generate(PROMPTS[:2], GREEDY if all_greedy else SAMPLED[:2])   # leaves a reset, valid state
    torch._dynamo.reset()
    k = engine.block_size if spec else 0
    eighths = 2 if spec == "budget" else None      # a quarter of the drafts, chosen on the device
    it = Iteration(k, np.arange(4), 0, SamplingPaths(not all_greedy, all_greedy), verify_eighths=eighths)
    placed = engine.runner.plan(it, None, NONE)
    plan, rows = placed.plan, placed.rows
    assert (plan.verify is not None) == (spec == "budget")
    assert rows.tolist() == [0, 1, 2, 3] and plan.kv_len == key_bound(0, engine.cache.capacity) and plan.all_slots
    traced = torch.compile(lambda s: engine.runner.device_iteration(plan, s), backend="eager", fullgraph=True,
                           dynamic=False)
    with torch.inference_mode():
        out = traced(torch.arange(4))
    assert out.shape == (4, (engine.block_size if spec else 1) + TRAILER)


class HostDataSpy(TorchDispatchMode):
    """Records where host data enters device work: ``aten.lift_fresh`` is how ``torch.tensor(data)``
    and a Python number written by index (``t[idx] = -1``) become tensors. On CUDA that tensor is a
    pageable host one, and copying it inside ``torch.cuda.graph`` fails the capture (seen on the
    first H200 run: no iteration was captured)."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default):
            self.sites.append(traceback.format_stack(limit=3)[0].strip())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("spec", [True, False], ids=["cycle", "ar-step"])
@pytest.mark.parametrize("all_greedy", [True, False], ids=["greedy", "sampled"])
@pytest.mark.parametrize("logprobs", [None, 3], ids=["no-logprobs", "logprobs"])
@pytest.mark.parametrize("options", [False, True], ids=["plain", "penalties"])
def test_static_iteration_takes_no_host_data(model, spec, all_greedy, logprobs, options):
    """What a CUDA graph captures must not build tensors from host values (capture precondition);
    also with penalties, a logit bias and min_p (their paths on)."""
    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=True)
    params = GREEDY if all_greedy else SAMPLED[:2]
    if options:
        params = [replace(p, repetition_penalty=1.2, frequency_penalty=0.5, logit_bias=((3, 1.0),), min_p=0.1)
                  for p in (params if isinstance(params, list) else [params] * 2)]
    engine.generate(PROMPTS[:2], params)
    paths = SamplingPaths(not all_greedy, all_greedy, min_p=options and not all_greedy, penalties=options, bias=options)
    it = Iteration(engine.block_size if spec else 0, np.arange(4), 0, paths)
    plan = engine.runner.plan(it, logprobs, NONE).plan
    spy = HostDataSpy()
    with torch.inference_mode(), spy:
        engine.runner.device_iteration(plan, torch.arange(4))
    assert spy.sites == []


def test_dead_padding_rows_never_write_past_their_slot():
    """Rows that end at the context limit leave lengths near capacity; as padding they must not
    write past it (an IndexError here, a silent write into the next head/slot through flash)."""
    m = tiny_model(seed=0, block_size=4)
    with torch.no_grad():
        m.lm_head.weight.zero_()           # every logit ties: argmax 0 in both views, every draft accepted
    prompts = [[1, 2, 3, 4, 5, 6], [1, 2], [1, 2], [1, 2]]
    runs = [OrthrusEngine(m, max_batch_size=4, max_seq_len=16, static_shapes=static, attention="sdpa")
            .generate(prompts, SamplingParams(max_new_tokens=100)) for static in (False, True)]
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    assert [len(r.token_ids) for r in runs[1]] == [10, 14, 14, 14]      # every row to the context limit


def test_a_row_complete_at_prefill_is_never_padding():
    """A max_new_tokens=1 row admitted beside 3 running rows: its slot is the only one left to pad
    the iteration's bucket of 4, and a padding row's iteration would clear its prefill token."""
    engine = OrthrusEngine(tiny_model(seed=2), max_batch_size=4, static_shapes=True)
    for p in ([1, 2, 3], [6, 7], [8]):
        engine.add_request(p, SamplingParams(max_new_tokens=20))
    engine.step()
    rid = engine.add_request([4, 5], SamplingParams(max_new_tokens=1))
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    alone = OrthrusEngine(tiny_model(seed=2), max_batch_size=1).generate([[4, 5]], SamplingParams(max_new_tokens=1))
    assert done[rid].token_ids == alone[0].token_ids and len(alone[0].token_ids) == 1
