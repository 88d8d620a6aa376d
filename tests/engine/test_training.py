"""Diffusion-view training: the dual-pass mask, train/inference agreement, and what training changes."""
from __future__ import annotations

import warnings

import torch

from orthrus.model.backends import BlockBatch, RaggedSDPA
from orthrus.model.cache import PagedKVCache
from orthrus.engine.device.proposer import DiffusionProposer
from orthrus_train.training import (distill_loss, dual_pass_mask, freeze_all_but_diffusion, sample_anchors,
                              student_pass, teacher_pass)
from support.tiny_models import tiny_model


def naive_mask(anchors: list[int], seq_len: int, k: int) -> torch.Tensor:
    n = len(anchors) * k
    m = torch.zeros(n, seq_len + n, dtype=torch.bool)
    for qi in range(n):
        qa = anchors[qi // k]
        for kj in range(seq_len + n):
            if kj < seq_len:
                m[qi, kj] = kj < qa                                   # AR key strictly before the anchor
            else:
                m[qi, kj] = (kj - seq_len) // k == qi // k            # same block, any position
    return m


def test_dual_pass_mask_equals_naive_builder_on_random_anchors():
    g = torch.Generator().manual_seed(0)
    for seq_len, num, k in [(16, 3, 4), (23, 5, 3), (9, 8, 2)]:
        anchors = sample_anchors(2, seq_len, num, g)
        assert (anchors[:, 1:] > anchors[:, :-1]).all() and anchors.max() <= seq_len - 2
        got = dual_pass_mask(anchors, seq_len, k)
        for b in range(2):
            assert torch.equal(got[b], naive_mask(anchors[b].tolist(), seq_len, k))


def test_training_blocks_equal_inference_drafts():
    """A block's training-time logits equal the engine's draft logits for the same prefix."""
    model = tiny_model(seed=11, diff_noise=0.5)
    k, tokens = 4, torch.randint(0, 60, (1, 20), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[0, 5, 11, 17]])
    train_logits = student_pass(model, tokens, anchors, teacher_pass(model, tokens)[0], k)[0]  # [A, K-1, V]
    proposer = DiffusionProposer(model)
    for i, a in enumerate(anchors[0].tolist()):
        cache = PagedKVCache.contiguous(2, 1, 2, 64, 8, torch.float64, "cpu")
        slots = torch.tensor([0])
        if a > 0:
            pos = torch.arange(a)[None]
            model.forward_cached(tokens[:, :a], cache, BlockBatch(slots, pos, a), diffusion=False,
                                 backend=RaggedSDPA())
        pos = a + torch.arange(k)[None]
        view = BlockBatch(slots, pos, a + k, causal=False)
        infer = proposer.propose(tokens[:, a], view, cache, slots, RaggedSDPA())[0]
        torch.testing.assert_close(train_logits[i], infer)


def test_flex_attention_path_equals_dense_path():
    model = tiny_model(seed=12, diff_noise=0.3, dtype=torch.float32)
    tokens = torch.randint(0, 60, (2, 24), generator=torch.Generator().manual_seed(2))
    anchors = sample_anchors(2, 24, 4, torch.Generator().manual_seed(3))
    ar_kv = teacher_pass(model, tokens)[0]
    dense = student_pass(model, tokens, anchors, ar_kv, 4, use_flex=False)
    with warnings.catch_warnings(), torch.no_grad():    # CPU FlexAttention has no backward
        warnings.simplefilter("ignore")       # eager FlexAttention on CPU warns that it is unfused
        flex = student_pass(model, tokens, anchors, ar_kv, 4, use_flex=True)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-4)


def test_only_twins_change_and_loss_falls():
    model = tiny_model(seed=13, diff_noise=1.0, dtype=torch.float32, scale=3.0)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(freeze_all_but_diffusion(model), lr=3e-3)
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 60, (4, 32), generator=g)
    anchors = sample_anchors(4, 32, 6, g)
    losses = []
    for _ in range(15):
        loss, stats = distill_loss(model, tokens, anchors, 4)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(stats.loss)
    assert losses[-1] < 0.7 * losses[0], losses
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("_diff." in name), name
