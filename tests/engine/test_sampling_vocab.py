"""``process`` at Qwen3's vocabulary (V = 151,936): the candidate cut (``topk``, stable sort only for
the rows it leaves open) keeps exactly the tokens the full-sort implementation and transformers'
warpers keep, with the same probabilities, for peaked and flat rows, every top-k / top-p regime,
and ties; without a host read, and traceable as one graph.

The full-sort implementation is kept below as it was (``old_process``). Its ``sort`` is not stable,
so tokens with equal logits that straddle the top-p boundary are kept in an unspecified order;
``process`` keeps them in token-id order, which is the old code with ``stable=True`` — the reference
for tie-heavy rows. The tests place each top_p halfway between two tokens' cumulative probabilities,
so that rounding cannot move the cut. In float64 every kept set must be identical. In float32 (the
engine's dtype) ``process`` must keep exactly what transformers' warpers and the full sort computed in
float64 keep; the old float32 code itself is off by up to ~2e-5 in cumulative probability at this
vocabulary size (``torch.softmax``'s float32 error), so against it only the probabilities are compared
(to 3e-5).
"""
from __future__ import annotations

import pytest
import torch

from jobs.bench.vocab import full_sort_filter, full_sort_process
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from orthrus import sampling
from orthrus.testing.host_syncs import count_host_reads
from orthrus.sampling import SamplingTensors, process

QWEN3_VOCAB = 151_936


# The full-sort implementation as it was (the benchmark's baseline too).
old_filter, old_process = full_sort_filter, full_sort_process


def hf_process(logits: torch.Tensor, temps: list[float], ks: list[int], ps: list[float]) -> torch.Tensor:
    """transformers' warpers per row ``[T, V]``: temperature, top-k (if set), top-p (if < 1), softmax."""
    out = []
    for row, t, k, p in zip(logits, temps, ks, ps):
        scores = TemperatureLogitsWarper(t)(None, row.clone())
        if k:
            scores = TopKLogitsWarper(k)(None, scores)
        if p < 1:
            scores = TopPLogitsWarper(p)(None, scores)
        out.append(scores.softmax(-1))
    return torch.stack(out)


def _st(temps: list[float], ks: list[int], ps: list[float], greedy: list[bool] | None = None) -> SamplingTensors:
    greedy = greedy or [False] * len(temps)
    return SamplingTensors(torch.tensor(temps, dtype=torch.float64), torch.tensor(ks),
                           torch.tensor(ps, dtype=torch.float64), torch.tensor(greedy), filtered=True)


def _p_keeping(logits: torch.Tensor, temp: float, k: int, n: int) -> tuple[float, int]:
    """A top_p under which the first ``n`` tokens of ``logits [V]`` (after temperature and top-k)
    survive, halfway between two tokens' cumulative probabilities and below 0.999: far from rounding
    in float32 too. ``n`` comes down until the gap is wide enough; returns (top_p, n)."""
    x = (logits / temp).double().sort(descending=True).values          # tempered in the row's dtype
    if k:
        x = x.masked_fill(x < x[k - 1], float("-inf"))
    sp = x.softmax(-1)
    before = sp.cumsum(-1) - sp
    room = (sp[:n] >= 5e-6) & (before[:n] + sp[:n] / 2 <= 0.999)
    n = int(room.nonzero().max()) + 1
    return float(before[n - 1] + sp[n - 1] / 2), n


def _logits(kind: str, t: int, v: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, V]`` logits: 'peaked' like a trained LM head (a few tokens hold most of the mass, a long
    tail), 'flat' like a random one (the nucleus holds most of the vocabulary)."""
    if kind == "flat":
        return torch.randn(t, v, generator=gen, dtype=torch.float64) * 0.3
    x = torch.randn(t, v, generator=gen, dtype=torch.float64) * 2.5
    head = torch.randint(0, v, (t, 8), generator=gen)
    return x.scatter(-1, head, 12 + 4 * torch.rand(t, 8, generator=gen, dtype=torch.float64))


def _assert_same(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert torch.equal(got > 0, want > 0), f"{where}: kept sets differ {(got > 0).sum(-1)} vs {(want > 0).sum(-1)}"
    torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-4, atol=1e-7, msg=where)


# (kind, temperature, top_k, kept by top_p or None for top_p = 1, or "tiny" for top_p = 1e-30)
CASES = [("peaked", 0.8, 0, 3), ("peaked", 1.0, 20, 5), ("peaked", 0.7, 0, 150),
         ("peaked", 1.3, 1000, 600),          # top_k above CANDIDATES, nucleus past them: sorted
         ("peaked", 0.6, 40, None), ("peaked", 0.9, 0, None), ("peaked", 0.9, 0, "tiny"),
         ("flat", 0.8, 0, 30_000),            # a random model's nucleus: sorted
         ("flat", 1.0, 5000, None), ("flat", 1.1, 3, 2), ("flat", 0.5, 0, 200)]


def _batch(v: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, list, list, list]:
    gen = torch.Generator().manual_seed(seed)
    rows, temps, ks, ps = [], [], [], []
    for kind, temp, k, kept in CASES:
        k = min(k, v // 2)
        x = _logits(kind, 1, v, gen)
        # position 1: the same logits over shuffled token ids (top_p stays between two tokens there too)
        x = torch.cat([x, x[:, torch.randperm(v, generator=gen)]]).to(dtype)
        if isinstance(kept, int):
            p, _ = _p_keeping(x[0], temp, k, min(kept, (k or v) - 1))
        else:
            p = 1e-30 if kept == "tiny" else 1.0
        rows.append(x)
        temps.append(temp), ks.append(k), ps.append(p)
    return torch.stack(rows), temps, ks, ps


@pytest.mark.slow
@pytest.mark.parametrize("v", [QWEN3_VOCAB, 1000, 50])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_matches_full_sort_and_transformers(v, dtype):
    logits, temps, ks, ps = _batch(v, dtype, seed=v)
    st = _st(temps, ks, ps)
    got = process(logits, st)
    old = old_process(logits, st)
    hf = hf_process(logits, temps, ks, ps)
    tempered = (logits / torch.tensor(temps, dtype=dtype)[:, None, None]).double()     # as process tempers
    exact = old_process(tempered, _st([1.0] * len(temps), ks, ps))
    for r, (case, p) in enumerate(zip(CASES, ps)):
        _assert_same(got[r], hf[r], f"{case} vs transformers")
        # at top_p = 1 the old code's cumulative probability reaches 1.0 before the tail ends (float32
        # softmax error; ~1e-5 of the mass at this V) and drops those tokens: transformers keeps them
        if p < 1:
            _assert_same(got[r], exact[r], f"{case} vs the full sort in float64")
        if p < 1 and dtype == torch.float64:
            _assert_same(got[r], old[r], f"{case} vs the full sort")
        torch.testing.assert_close(got[r], old[r], rtol=1e-4, atol=3e-5, msg=f"{case} vs the full sort")


def test_processing_is_exact_whatever_the_candidates_decide(monkeypatch):
    """Few candidates: most rows are sorted, some decided by the candidates, some by their edge."""
    gen = torch.Generator().manual_seed(5)
    b, t, v = 24, 3, 300
    logits = torch.randn(b, t, v, generator=gen, dtype=torch.float64) * torch.rand(b, 1, 1, generator=gen) * 6
    logits[::3] = (logits[::3] * 2).round()                       # ties everywhere in a third of the rows
    temps = (0.3 + torch.rand(b, generator=gen, dtype=torch.float64)).tolist()
    ks = torch.randint(0, 40, (b,), generator=gen).mul(torch.rand(b, generator=gen) < 0.6).tolist()
    ps = torch.rand(b, generator=gen, dtype=torch.float64).clamp(min=0.05).tolist()
    ps[:4] = [1.0, 1.0, 1e-30, 0.999]
    want = old_process(logits, _st(temps, ks, ps), stable=True)
    for c in (1, 2, 4, 16, 64):
        monkeypatch.setattr(sampling, "CANDIDATES", c)
        got = process(logits, _st(temps, ks, ps))
        assert torch.equal(got > 0, want > 0), c
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)


def test_ties_are_kept_by_top_k_and_cut_by_token_id_at_top_p():
    """Quantised logits (as bf16 logits are): ties at the top-k boundary are kept, ties straddling
    the top-p boundary are kept lowest token id first (the stable full sort), and top_p = 1e-30
    keeps exactly the greedy token when the maximum is tied."""
    gen = torch.Generator().manual_seed(7)
    v = QWEN3_VOCAB
    logits = (torch.randn(4, 2, v, generator=gen, dtype=torch.float64) * 8).round() / 2
    logits[2, :, 1000:1100] = logits[2].max() + 1                 # 100 tokens tied at the top
    temps, ks, ps = [1.0, 0.9, 1.0, 1.0], [0, 7, 0, 300], [0.6, 1.0, 1e-30, 0.97]
    got = process(logits, _st(temps, ks, ps))
    _assert_same(got, old_process(logits, _st(temps, ks, ps), stable=True), "quantised logits")
    x = logits / torch.tensor(temps, dtype=torch.float64)[:, None, None]
    kth = x[1].topk(7, -1).values[:, -1:]
    assert torch.equal(got[1] > 0, x[1] >= kth) and ((got[1] > 0).sum(-1) > 7).all()      # top-k: ties stay
    assert torch.equal((got[2] > 0).nonzero()[:, 1], torch.tensor([1000, 1000]))          # the argmax only
    lowest = x[0].where(got[0] > 0, torch.inf).amin(-1, keepdim=True)                      # the cut's logit
    assert ((x[0] == lowest) & (got[0] == 0)).any(), "no tie group straddles the top-p cut: not exercised"


def test_greedy_rows_are_one_hot_on_the_first_maximum_beside_sampled_rows():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 2, QWEN3_VOCAB, generator=gen)
    logits[0, :, 11] = logits[0, :, 99] = 50.0                    # a tied maximum: the first index wins
    got = process(logits, _st([1.0, 0.8, 0.0], [5, 0, 0], [0.9, 0.95, 1.0], greedy=[True, False, True]))
    assert torch.equal(got[0].argmax(-1), torch.tensor([11, 11])) and torch.equal(got[0].sum(-1), torch.ones(2))
    assert torch.equal((got[0] > 0).sum(-1), torch.ones(2, dtype=torch.long))
    assert torch.equal(got[2], torch.zeros_like(got[2]).scatter(-1, logits[2].argmax(-1, keepdim=True), 1.0))
    torch.testing.assert_close(got[1].sum(-1), torch.ones(2))


def test_no_host_read_and_one_graph_on_the_sorted_path():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 1000, generator=gen) * 0.2           # flat: every row needs the sort
    st = _st([0.9, 1.1], [0, 500], [0.95, 0.9])
    with count_host_reads() as reads:
        eager = process(logits, st)
    assert dict(reads) == {}
    torch._dynamo.reset()
    traced = torch.compile(lambda lg, t, k, p, g: process(lg, SamplingTensors(t, k, p, g, True)),
                           backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(traced(logits, st.temperature, st.top_k, st.top_p, st.greedy), eager)
