"""Per-token log-probabilities: the AR model's raw log-softmax at every generated position.

Checked against transformers' own logits of the plain model over prompt + generated tokens
(float64), in speculative, AR and auto mode, greedy and seeded sampling, ragged batches, requests
added mid-flight and shared prefills; alignment with stop tokens, stop strings and aborts; and the
cost: still one device→host read per iteration.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from orthrus.engine.packed import TRAILER
from orthrus.engine.step import Iteration, SamplingPaths
from orthrus.testing.host_syncs import count_host_reads
from support.tiny_models import hf_twin, tiny_model
from support.paths import TOKENIZER_DIR

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17], [3, 1, 4, 1, 5, 9, 2, 6],
           [20, 21]]
BUNDLED = TOKENIZER_DIR
ATOL = 1e-9


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, diff_noise=0.3, scale=3.0)     # perturbed twins: drafts get rejected


@pytest.fixture(scope="module")
def hf(model):
    return hf_twin(model)


def sampled(i: int, logprobs: int | None = 5, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.8, "top_k": 20, "top_p": 0.9, "max_new_tokens": 20,
                             "seed": 100 + i, "logprobs": logprobs, **kw})


def greedy(logprobs: int | None = 5, **kw) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 20, "logprobs": logprobs, **kw})


def reference(hf, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax ``[len(tokens), V]`` at each generated position (float64)."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf(ids).logits[0].double()
    return logits.log_softmax(-1)[len(prompt) - 1: len(prompt) - 1 + len(tokens)]


def check(hf, prompt: list[int], out, k: int) -> None:
    """``out``'s logprobs are transformers' at its tokens; top ``k`` as torch.topk orders them."""
    n = len(out.token_ids)
    assert n > 0 and len(out.token_logprobs) == n
    lp = reference(hf, prompt, out.token_ids)
    want = lp.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    np.testing.assert_allclose(out.token_logprobs, want.numpy(), atol=ATOL, rtol=0)
    assert isinstance(out.cumulative_logprob, float)
    assert out.cumulative_logprob == pytest.approx(sum(out.token_logprobs), abs=1e-12)
    if k == 0:
        assert out.top_logprobs is None
        return
    top = lp.topk(k, -1)
    assert len(out.top_logprobs) == n and all(len(pos) == k for pos in out.top_logprobs)
    assert [[i for i, _ in pos] for pos in out.top_logprobs] == top.indices.tolist()
    got = np.array([[v for _, v in pos] for pos in out.top_logprobs])
    np.testing.assert_allclose(got, top.values.numpy(), atol=ATOL, rtol=0)
    assert all(isinstance(i, int) and isinstance(v, float) for pos in out.top_logprobs for i, v in pos)


def same_logprobs(a, b, atol: float = 1e-12) -> None:
    assert a.token_ids == b.token_ids
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=atol, rtol=0)
    if a.top_logprobs is None:
        assert b.top_logprobs is None
    else:
        assert [[i for i, _ in p] for p in a.top_logprobs] == [[i for i, _ in p] for p in b.top_logprobs]
        np.testing.assert_allclose([[v for _, v in p] for p in a.top_logprobs],
                                   [[v for _, v in p] for p in b.top_logprobs], atol=atol, rtol=0)


@pytest.mark.parametrize("speculative", [True, False, "auto"])
@pytest.mark.parametrize("kind", ["greedy", "sampled"])
def test_logprobs_equal_transformers(model, hf, speculative, kind):
    ks = [5, 0, 3, 20, 1, 0, 2]
    params = [greedy(k) if kind == "greedy" else sampled(i, k) for i, k in enumerate(ks)]
    engine = OrthrusEngine(model, max_batch_size=3, speculative=speculative)   # 7 prompts, 3 slots: refills
    outs = engine.generate(PROMPTS, params)
    for prompt, out, k in zip(PROMPTS, outs, ks):
        check(hf, prompt, out, k)
    if speculative is True:
        assert sum(o.stats.num_accepted_draft_tokens for o in outs) > 0      # drafts were accepted
        assert sum(sum(o.stats.accept_length_histogram[:-1]) for o in outs) > 0   # and some rejected


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_batch_and_mid_flight_equal_alone(model, static):
    params = [sampled(i, 4) if i % 2 else greedy(4) for i in range(len(PROMPTS))]
    alone = [OrthrusEngine(model, max_batch_size=1, static_shapes=static).generate([p], [sp])[0]
             for p, sp in zip(PROMPTS, params)]
    together = OrthrusEngine(model, max_batch_size=8, static_shapes=static).generate(PROMPTS, params)
    engine = OrthrusEngine(model, max_batch_size=3, static_shapes=static)
    rnd, todo, streamed = random.Random(3), list(range(len(PROMPTS))), {}
    for i in todo[:2]:
        engine.add_request(PROMPTS[i], params[i], request_id=str(i))
    todo = todo[2:]
    while todo or engine.has_unfinished_requests():
        if todo and rnd.random() < 0.4:
            i = todo.pop(0)
            engine.add_request(PROMPTS[i], params[i], request_id=str(i))
        streamed.update((int(o.request_id), o) for o in engine.step())
    for i, a in enumerate(alone):
        same_logprobs(a, together[i])
        same_logprobs(a, streamed[i])


def test_shared_prefill_samples(model, hf):
    prompt = [5, 6, 7, 8, 9, 10, 11]
    engine = OrthrusEngine(model, max_batch_size=4)
    params = [sampled(s, 3) for s in range(3)]
    for s, sp in enumerate(params):                          # admitted together: one prefill
        engine.add_request(prompt, sp, request_id=str(s))
    done = {o.request_id: o for o in engine.step()}
    engine.add_request(prompt, sampled(9, 3), request_id="late")   # copies a running slot's prompt
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step())
    assert engine.stats.prefill_tokens == len(prompt)
    for out in done.values():
        check(hf, prompt, out, 3)


def test_rows_without_logprobs_get_none_and_tokens_do_not_change(model):
    params = [sampled(i, None if i % 3 == 0 else i % 3) for i in range(len(PROMPTS))]
    plain = OrthrusEngine(model, max_batch_size=4).generate(PROMPTS, [sampled(i, None) for i in range(len(PROMPTS))])
    mixed = OrthrusEngine(model, max_batch_size=4).generate(PROMPTS, params)
    for i, (p, m) in enumerate(zip(plain, mixed)):
        assert p.token_ids == m.token_ids
        assert p.token_logprobs is None and p.top_logprobs is None and p.cumulative_logprob is None
        if i % 3 == 0:
            assert m.token_logprobs is None and m.top_logprobs is None and m.cumulative_logprob is None
        else:
            assert len(m.token_logprobs) == len(m.token_ids) and all(len(t) == i % 3 for t in m.top_logprobs)


@pytest.mark.parametrize("speculative", [True, False])
def test_stop_token_and_length_keep_alignment(model, hf, speculative):
    engine = OrthrusEngine(model, max_batch_size=2, speculative=speculative, max_seq_len=24)
    free = engine.generate([[1, 2, 3]], greedy(2, max_new_tokens=40))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 24 - 3   # the context limit
    check(hf, [1, 2, 3], free, 2)
    stop = free.token_ids[6]
    cut = engine.generate([[1, 2, 3], [1, 2, 3]], [greedy(2, stop_token_ids=(stop,)), greedy(0, max_new_tokens=5)])
    first = free.token_ids.index(stop)
    assert cut[0].finish_reason == "stop" and cut[0].token_ids == free.token_ids[: first + 1]
    assert len(cut[0].token_logprobs) == first + 1 == len(cut[0].top_logprobs)      # the stop token included
    np.testing.assert_allclose(cut[0].token_logprobs, free.token_logprobs[: first + 1], atol=1e-12, rtol=0)
    assert len(cut[1].token_ids) == 5 == len(cut[1].token_logprobs)
    one = engine.generate([[4, 5]], greedy(1, max_new_tokens=1))[0]               # ends at its prefill
    check(hf, [4, 5], one, 1)


@pytest.mark.parametrize("speculative", [True, False])
def test_stop_strings_keep_alignment(speculative):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(BUNDLED))
    model = OrthrusForCausalLM.from_pretrained(str(BUNDLED), dtype=torch.float32)
    ids = tok('def finalize_unix(self):\n    """Finalizes options for posix platforms."""\n')["input_ids"]
    engine = OrthrusEngine(model, max_batch_size=2, speculative=speculative, tokenizer=tok)
    free = engine.generate([ids], SamplingParams(max_new_tokens=48, logprobs=2))[0]
    text = tok.decode(free.token_ids, skip_special_tokens=True)
    j = next(j for j in range(10, len(free.token_ids))
             if (piece := tok.decode(free.token_ids[j:j + 1]).strip()) and len(piece) >= 2
             and text.find(piece) >= len(tok.decode(free.token_ids[:j], skip_special_tokens=True)))
    stop = tok.decode(free.token_ids[j:j + 1]).strip()
    out = engine.generate([ids, ids], [SamplingParams(max_new_tokens=48, logprobs=2, stop=(stop,)),
                                       SamplingParams(max_new_tokens=48)])
    n = len(out[0].token_ids)
    assert out[0].finish_reason == "stop" and out[0].token_ids == free.token_ids[:n] and n <= j + 1
    assert len(out[0].token_logprobs) == n == len(out[0].top_logprobs)                 # decoded past it: dropped
    np.testing.assert_allclose(out[0].token_logprobs, free.token_logprobs[:n], atol=1e-5, rtol=0)
    assert out[0].cumulative_logprob == pytest.approx(sum(free.token_logprobs[:n]), abs=1e-4)
    assert out[1].token_logprobs is None and out[1].token_ids == free.token_ids


def test_abort_keeps_alignment(model):
    engine = OrthrusEngine(model, max_batch_size=1)
    engine.add_request([1, 2, 3], greedy(2, max_new_tokens=40), request_id="run")
    engine.add_request([4, 5], greedy(0), request_id="wait")
    engine.step()
    engine.abort_request("run")
    engine.abort_request("wait")
    out = {o.request_id: o for o in engine.step()}
    assert len(out["run"].token_logprobs) == len(out["run"].token_ids) == len(out["run"].top_logprobs) > 0
    assert out["wait"].token_logprobs == [] and out["wait"].cumulative_logprob == 0.0
    assert out["wait"].top_logprobs is None


@pytest.mark.parametrize("speculative", [True, False, "auto"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("logprobs", [0, 5])
def test_still_one_host_read_per_iteration(speculative, static, logprobs):
    engine = OrthrusEngine(tiny_model(seed=2, diff_noise=0.3), max_batch_size=3, static_shapes=static)
    params = [SamplingParams(temperature=0.8, top_k=10, max_new_tokens=16, seed=i,
                             logprobs=logprobs if i % 2 else None) for i in range(5)]
    with count_host_reads() as reads:
        outs = engine.generate(PROMPTS[:5], params, speculative=speculative)
    assert engine.stats.iterations > 5
    # One read per step that reads (every iteration, and steps that only sample completed prompts'
    # first tokens: at most one per admitting step); one host→device copy per such step (its indices
    # and prompt chunks) and one per admitting step (every admitted request's settings), none from
    # pageable memory.
    stats = engine.stats
    assert stats.iterations <= stats.read_steps <= stats.iterations + stats.admitting_steps
    assert dict(reads) == {"cpu": stats.read_steps, "h2d_async": stats.read_steps + stats.admitting_steps}
    assert all(len(o.token_logprobs) == len(o.token_ids) for o in outs[1::2])


@pytest.mark.slow
@pytest.mark.parametrize("spec", [True, False], ids=["cycle", "ar-step"])
def test_iteration_with_logprobs_traces_as_one_graph(model, spec):
    engine = OrthrusEngine(model, max_batch_size=4, static_shapes=True)
    engine.generate(PROMPTS[:2], greedy(3))
    torch._dynamo.reset()
    it = Iteration(engine.block_size if spec else 0, np.arange(4), 0, SamplingPaths(True, False))
    plan = engine.runner.plan(it, 5, np.arange(0)).plan
    traced = torch.compile(lambda s: engine.runner.device_iteration(plan, s), backend="eager", fullgraph=True,
                           dynamic=False)
    with torch.inference_mode():
        out = traced(torch.arange(4))
    w = engine.block_size if spec else 1
    assert out.shape == (4, w + TRAILER + (1 + w) * (1 + 2 * 5))


@pytest.mark.parametrize("value", [-1, 21, 1.5, "3", True])
def test_invalid_logprobs(value):
    with pytest.raises(ValueError, match=r"^SamplingParams\.logprobs"):
        SamplingParams(logprobs=value)


def test_logprobs_wider_than_the_vocabulary_are_refused():
    engine = OrthrusEngine(tiny_model(seed=0, vocab=16, eos=14), max_batch_size=1)
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request([1, 2], SamplingParams(logprobs=20))
    assert SamplingParams(logprobs=0).logprobs == 0 and SamplingParams().logprobs is None
