"""Attention backends against each other and the one layer loop against itself (CPU, float64)."""
from __future__ import annotations

import pytest
import torch

from orthrus.model.backends import BlockBatch, FlashKVCache, RaggedSDPA, choose_backend, visible_keys
from orthrus.model.cache import PagedKVCache
from support.oracles import reference_flash_attn_with_kvcache
from support.tiny_models import tiny_model

B, HK, H, D, S = 3, 2, 4, 8, 24


def test_visibility_rule():
    pos = torch.tensor([[2, 3, 4], [5, 6, 7]])
    causal = visible_keys(pos, True, 9)[:, 0]                       # [b, T, L]
    block = visible_keys(pos, False, 9)[:, 0]
    assert causal.sum(-1).tolist() == [[3, 4, 5], [6, 7, 8]]        # j <= p
    assert block.sum(-1).tolist() == [[5, 5, 5], [8, 8, 8]]         # j < start + T


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("slots", [None, torch.tensor([2, 0])], ids=["all", "subset"])
def test_sdpa_and_flash_backends_agree(causal, slots):
    g = torch.Generator().manual_seed(0)
    caches = []
    for _ in range(2):
        cache = PagedKVCache.contiguous(1, B, HK, S, D, torch.float64, "cpu", page_size=4)
        # scattered pages: slot s's entries are not consecutive pages
        order = torch.randperm(cache.table.numel(), generator=torch.Generator().manual_seed(3))
        cache.table.copy_(cache.table.flatten()[order].view_as(cache.table))
        cache.k[0].copy_(torch.randn(cache.k[0].shape, generator=g.manual_seed(1), dtype=torch.float64))
        cache.v[0].copy_(torch.randn(cache.v[0].shape, generator=g.manual_seed(2), dtype=torch.float64))
        caches.append(cache)
    b = B if slots is None else len(slots)
    starts = torch.tensor([5, 0, 9])[:b]
    pos = starts[:, None] + torch.arange(4)[None]                    # [b, T]
    q = torch.randn(b, H, 4, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, HK, 4, D, generator=g, dtype=torch.float64) for _ in range(2))
    batch = BlockBatch(slots, pos, int(pos.max()) + 1, causal=causal)
    outs = [backend.bind(batch, cache)(0, q, k, v, D ** -0.5)
            for backend, cache in zip([RaggedSDPA(key_bucket=8), FlashKVCache(reference_flash_attn_with_kvcache)],
                                      caches)]
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(caches[0].k[0], caches[1].k[0])      # both appended the block in place
    torch.testing.assert_close(caches[0].v[0], caches[1].v[0])


def test_key_bucket_is_capped_at_capacity_and_keys_are_read_in_whole_pages():
    cache = PagedKVCache.contiguous(1, B, HK, S, D, torch.float64, "cpu", page_size=4)
    pos = torch.tensor([[20]])
    assert RaggedSDPA(16).prepare(BlockBatch(None, pos, 21), cache).kv_len == S      # 32 capped at 24
    assert RaggedSDPA(8).prepare(BlockBatch(None, pos, 9), cache).kv_len == 16
    got = RaggedSDPA().prepare(BlockBatch(None, pos, 21), cache)
    assert got.kv_len == 24 and got.key_pages.shape == (B, 6) and got.mask.shape[-1] == 24   # 21 → 6 pages


def test_choose_backend_on_cpu():
    backend = choose_backend("auto", torch.device("cpu"), torch.float64, H, HK, D, key_bucket=4)
    assert backend == RaggedSDPA(4) and backend.name == "sdpa"


def test_cached_and_dense_forwards_run_the_same_loop():
    model = tiny_model(seed=5)
    ids = torch.randint(0, 60, (2, 7), generator=torch.Generator().manual_seed(3))
    cache = PagedKVCache.contiguous(2, 2, 2, 16, 8, torch.float64, "cpu")
    pos = torch.arange(7)[None].expand(2, 7)
    cached = model.forward_cached(ids, cache, BlockBatch(None, pos, 7), diffusion=False, backend=RaggedSDPA())
    torch.testing.assert_close(cached, model.forward_dense(ids))
