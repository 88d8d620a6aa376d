"""What the exactness tests compare against, written out independently of the engine: FlashAttention's
KV-cache kernel as its docstring specifies it, a chi-square test of sampled sequences against an exact
distribution (and the whole check of sampled sequences against it), the exact distribution of
processed AR sampling by enumeration, and a proposer that replays a known continuation (every draft
accepted)."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from scipy.stats import chisquare


def reference_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None,
                                      block_table=None, softmax_scale=None, causal=False):
    """flash-attn 2's ``flash_attn_with_kvcache`` with a paged cache, as its docstring specifies it, row by row.

    q ``[b, Tq, H, D]``; k_cache/v_cache ``[P, G, Hk, D]`` pages (last dim contiguous), updated in
    place with k/v ``[b, Tq, Hk, D]`` at ``cache_seqlens [b]`` (int32): position p of row r lives in
    page ``block_table[r, p // G]`` (int32 ``[b, M]``) at offset ``p % G``; each row attends keys
    ``< seqlens + Tq``; causal is bottom-right aligned.
    """
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1, "cache must have a contiguous last dim"
    assert cache_seqlens.dtype == torch.int32 and cache_seqlens.shape == (q.shape[0],)
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.shape[0] == q.shape[0]
    b, tq, h, _ = q.shape
    g, hk = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for r in range(b):
        n = int(cache_seqlens[r])
        pos = torch.arange(n + tq)
        pages, offs = block_table[r].long()[pos // g], pos % g
        k_cache[pages[n:], offs[n:]] = k[r]
        v_cache[pages[n:], offs[n:]] = v[r]
        keys = k_cache[pages, offs].transpose(0, 1).repeat_interleave(h // hk, 0)     # [H, L, D]
        vals = v_cache[pages, offs].transpose(0, 1).repeat_interleave(h // hk, 0)
        scores = q[r].transpose(0, 1) @ keys.transpose(1, 2) * softmax_scale           # [H, Tq, L]
        if causal:
            j, i = torch.arange(n + tq), torch.arange(tq)
            scores = scores.masked_fill(j[None, :] > n + i[:, None], float("-inf"))
        out[r] = (scores.softmax(-1) @ vals).transpose(0, 1)
    return out


def chi2_pvalue(counts: Counter, dist: dict[tuple[int, ...], float], n: int) -> float:
    """χ² goodness of fit; bins with expected count < 5 are pooled into one."""
    keys = sorted(dist, key=dist.get, reverse=True)
    big = [k for k in keys if dist[k] * n >= 5]
    observed = [counts[k] for k in big]
    expected = [dist[k] * n for k in big]
    rest = n - sum(observed)
    if n - sum(expected) >= 5:
        observed.append(rest)
        expected.append(n - sum(expected))
    else:
        assert rest <= 5 + 5 * (n - sum(expected)), "mass where the exact distribution has ~none"
        expected = [e * sum(observed) / sum(expected) for e in expected]
    return float(chisquare(observed, expected).pvalue)


def assert_follows(results: list, exact: dict[tuple[int, ...], float],
                   null: dict[tuple[int, ...], float] | None = None) -> None:
    """The sequences sampled in ``results`` (one seeded row each) follow ``exact``: a distribution
    with real support, no sequence outside it, χ² p > 1e-3. Given ``null`` (the distribution without
    the rule under test), the same check rejects it (p < 1e-6): it has the power to see the rule."""
    assert abs(sum(exact.values()) - 1) < 1e-9 and len(exact) > 20
    n, counts = len(results), Counter(tuple(r.token_ids) for r in results)
    assert set(counts) <= set(exact), "sampled a sequence the exact distribution gives zero mass"
    assert chi2_pvalue(counts, exact, n) > 1e-3
    if null is not None:
        assert chi2_pvalue(counts, null, n) < 1e-6


class OracleProposer:
    """Proposes the known AR continuation, so every cycle accepts all K-1 drafts (test-only)."""

    def __init__(self, sequence: list[int], vocab: int) -> None:
        self.sequence, self.vocab = sequence, vocab

    def propose(self, anchor, batch, cache, slots, backend):
        b, k = batch.positions.shape
        logits = torch.zeros(b, k - 1, self.vocab)
        for i in range(b):
            n = int(batch.positions[i, 0])
            for j in range(k - 1):
                pos = n + 1 + j
                logits[i, j, self.sequence[pos] if pos < len(self.sequence) else 0] = 10.0
        return logits


def enumerate_ar(model, prompt: list[int], params: dict, eos: int,
                 adjust: Callable[[tuple[int, ...], torch.Tensor], torch.Tensor]) -> dict[tuple[int, ...], float]:
    """P(sequence) of plain AR sampling, every path walked: the model's next-token logits ``[V]``,
    changed by ``adjust(prefix, logits)`` (a rule under test: a mask, a forced token), processed as
    the engine does with ``params`` (temperature, min_p if given, top_k, top_p; ``max_new_tokens`` the horizon);
    a path ends at ``eos`` or the horizon. For small vocabularies and horizons only."""
    from orthrus.sampling import SamplingTensors, process
    min_p = torch.tensor([params["min_p"]], dtype=torch.float64) if params.get("min_p") else None
    st = SamplingTensors(torch.tensor([params["temperature"]], dtype=torch.float64), torch.tensor([params["top_k"]]),
                         torch.tensor([params["top_p"]], dtype=torch.float64), torch.zeros(1, dtype=torch.bool), True,
                         min_p=min_p)
    dist: dict[tuple[int, ...], float] = {}

    def walk(prefix: tuple[int, ...], prob: float) -> None:
        if len(prefix) == params["max_new_tokens"] or (prefix and prefix[-1] == eos):
            dist[prefix] = dist.get(prefix, 0.0) + prob
            return
        with torch.no_grad():
            logits = adjust(prefix, model(torch.tensor([prompt + list(prefix)]))[0, -1].clone())
        probs = process(logits[None, None], st)[0, 0]
        for tok in torch.nonzero(probs > 0).flatten().tolist():
            walk(prefix + (tok,), prob * float(probs[tok]))

    walk((), 1.0)
    return dist
