"""Ragged-batch invariants: per-row seeds, and the paged ragged cache against a contiguous one."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from orthrus import OrthrusEngine, SamplingParams
from orthrus.model.backends import ragged_attention, visible_keys
from orthrus.model.cache import PagedKVCache
from support.tiny_models import tiny_model


def test_seeded_row_identical_alone_and_in_mixed_batch():
    model = tiny_model(seed=4, diff_noise=0.5, scale=2.0)
    target = ([3, 1, 4, 1, 5], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=30, seed=1234))
    others = [([9, 2, 6], SamplingParams(temperature=0.0, max_new_tokens=12)),
              ([5, 3, 5, 8, 9, 7, 9], SamplingParams(temperature=1.2, max_new_tokens=25, seed=7)),
              ([2], SamplingParams(temperature=0.5, top_k=3, max_new_tokens=5, seed=99)),
              ([6, 6, 6, 6], SamplingParams(temperature=1.0, max_new_tokens=40, seed=5))]
    for speculative in (True, False):
        alone = OrthrusEngine(model, max_batch_size=1).generate([target[0]], target[1], speculative=speculative)[0]
        engine = OrthrusEngine(model, max_batch_size=3)
        mixed = others[:2] + [target] + others[2:]            # lands in a different slot, after refills
        got = engine.generate([p for p, _ in mixed], [s for _, s in mixed], speculative=speculative)[2]
        assert got.token_ids == alone.token_ids and got.seed == 1234
    # a different seed gives a different sample (the seed is really used)
    other = OrthrusEngine(model, max_batch_size=1).generate(
        [target[0]], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_new_tokens=30, seed=1235))[0]
    assert other.token_ids != alone.token_ids


def test_ragged_cache_after_writes_and_crops_equals_contiguous_attention():
    torch.manual_seed(0)
    b, hk, h, d, k, cap = 3, 2, 4, 8, 4, 64
    cache = PagedKVCache.contiguous(1, b, hk, cap, d, torch.float64, "cpu", page_size=8)
    cache.table.copy_(cache.table.flip(0).flip(1))            # pages out of order, across slots

    def write(pos, k_new, v_new):
        cache.write(0, cache.index(slots, pos), k_new, v_new)

    def read(rows, kv_len):                                   # whole pages: kv_len is a multiple of 8
        return cache.read(0, cache.table[rows, : kv_len // 8].long())
    truth = [[] for _ in range(b)]                            # committed (k, v) per row, position order
    slots = torch.arange(b)
    prompt_lens = torch.tensor([5, 2, 9])
    kv = torch.randn(2, b, hk, int(prompt_lens.max()), d, dtype=torch.float64)
    pos = torch.arange(int(prompt_lens.max()))[None].expand(b, -1)
    write(pos, kv[0], kv[1])
    cache.lengths[:] = prompt_lens
    for i in range(b):
        truth[i] = [(kv[0, i, :, j], kv[1, i, :, j]) for j in range(int(prompt_lens[i]))]
    for accepted in ([0, 3, 1], [2, 0, 3], [3, 3, 0]):       # blocks written, then cropped per row
        block = torch.randn(2, b, hk, k, d, dtype=torch.float64)
        pos = cache.lengths[:, None] + torch.arange(k)[None]
        write(pos, block[0], block[1])
        for i, acc in enumerate(accepted):
            truth[i] += [(block[0, i, :, j], block[1, i, :, j]) for j in range(acc + 1)]
        cache.lengths += torch.tensor(accepted) + 1
    # a final causal block on top of the cropped cache, compared with a freshly built contiguous cache
    q = torch.randn(b, h, k, d, dtype=torch.float64)
    block = torch.randn(2, b, hk, k, d, dtype=torch.float64)
    pos = cache.lengths[:, None] + torch.arange(k)[None]
    write(pos, block[0], block[1])
    kv_len = -(-(int(pos.max()) + 1) // 8) * 8                 # keys read in whole pages (masked past the rows)
    visible = visible_keys(pos, True, kv_len)                 # [b, 1, K, L] causal
    got = ragged_attention(q, *read(slots, kv_len), mask=visible, scale=d ** -0.5)
    for i in range(b):
        ks = torch.stack([t[0] for t in truth[i]], 1)         # [Hk, n, D]
        vs = torch.stack([t[1] for t in truth[i]], 1)
        ks, vs = torch.cat([ks, block[0, i]], 1), torch.cat([vs, block[1, i]], 1)
        n = ks.shape[1] - k
        mask = torch.arange(n + k)[None, :] < (n + torch.arange(k) + 1)[:, None]
        want = F.scaled_dot_product_attention(q[i:i + 1], ks[None].repeat_interleave(h // hk, 1),
                                              vs[None].repeat_interleave(h // hk, 1), attn_mask=mask,
                                              scale=d ** -0.5)
        torch.testing.assert_close(got[i:i + 1], want)
    # the same through a subset read (slot gather path)
    sub = torch.tensor([2, 0])
    got_sub = ragged_attention(q[sub], *read(sub, kv_len), mask=visible[sub], scale=d ** -0.5)
    torch.testing.assert_close(got_sub, got[sub])
