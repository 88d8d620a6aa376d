"""Training the diffusion view: dual-pass attention mask, anchor sampling, forward-KL distillation.

Shape legend
    b   sequences            T   tokens per (packed) sequence       A   anchors per sequence
    K   block size           N = A*K block tokens                   V   vocabulary
    H   query heads          Hk  key/value heads                    D   head dim      E   hidden size

One frozen AR pass over the clean sequence gives every layer's K/V (exactly what the inference
cache would hold) and the teacher's next-token distributions. Each anchor ``a`` makes a block
``[x_a, M × (K-1)]`` at positions ``a … a+K-1`` run through the diffusion view. A block query sees
AR keys strictly before its anchor (at inference the anchor is in the block, not in the cache) and
every key of its own block, never another block (docs/design.md §7.1). Block row ``i`` learns the teacher's
distribution for position ``a+i+1``. Only the ``*_diff`` twins receive gradients.

Both passes run the model's one layer loop (``OrthrusModel.forward``); they differ only in their
``attend`` (``orthrus.model.backends.Attend``): causal SDPA that records each layer's K/V, and the
dual-pass mask over ``[AR K/V ; block K/V]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orthrus.model.backends import Attend, DenseSDPA
from orthrus.model.qwen3 import OrthrusForCausalLM


@dataclass(frozen=True)
class DistillStats:
    """One step's numbers: mean forward KL and how often the student's argmax equals the teacher's."""

    loss: float
    top1_agreement: float


def sample_anchors(batch: int, seq_len: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Distinct anchor positions ``[b, A]`` in ``[0, T-2]`` (each block has at least one target)."""
    a = min(num_anchors, seq_len - 1)
    scores = torch.rand(batch, seq_len - 1, generator=generator)
    return scores.argsort(dim=1)[:, :a].sort(dim=1).values


def dual_pass_mask(anchors: torch.Tensor, seq_len: int, block_size: int) -> torch.Tensor:
    """Visibility ``[b, N, T + N]``: block query → AR keys ``< anchor`` and its own block's keys."""
    b, a = anchors.shape
    n = a * block_size
    q_block = torch.arange(n, device=anchors.device) // block_size                 # [N]
    q_anchor = anchors[:, q_block]                                                  # [b, N]
    ar_keys = torch.arange(seq_len, device=anchors.device)
    see_ar = ar_keys[None, None, :] < q_anchor[:, :, None]                          # [b, N, T]
    see_block = (q_block[:, None] == q_block[None, :]).expand(b, n, n)              # [b, N, N]
    return torch.cat([see_ar, see_block], dim=2)


def block_inputs(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block token ids and positions ``[b, N]``: ``[x_a, M, …, M]`` at ``a … a+K-1``."""
    b, a = anchors.shape
    offs = torch.arange(block_size, device=tokens.device)
    positions = (anchors[:, :, None] + offs).reshape(b, a * block_size)
    ids = torch.full((b, a, block_size), mask_token_id, dtype=torch.long, device=tokens.device)
    ids[:, :, 0] = tokens.gather(1, anchors)
    return ids.reshape(b, -1), positions


def _flex_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


_FLEX = None


def _flex():
    """FlexAttention, compiled once on GPU (eager elsewhere: only used there by tests)."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention
        _FLEX = torch.compile(flex_attention) if torch.cuda.is_available() else flex_attention
    return _FLEX


class DualPassAttention:
    """The student pass's ``Attend`` (``orthrus.model.backends``): block queries over ``[AR K/V ;
    block K/V]`` of the same layer. Dense mask on CPU, FlexAttention on GPU."""

    def __init__(self, anchors: torch.Tensor, seq_len: int, block_size: int,
                 ar_kv: list[tuple[torch.Tensor, torch.Tensor]], use_flex: bool | None = None) -> None:
        self.ar_kv = ar_kv                       # per layer (K, V) [b, Hk, T, D] of the teacher pass
        self.use_flex = _flex_available(anchors.device) if use_flex is None else use_flex
        b, a = anchors.shape
        n = a * block_size
        if self.use_flex:
            from torch.nn.attention.flex_attention import create_block_mask

            def mask_mod(bi, h, q, kv):  # same rule as dual_pass_mask, evaluated per element
                qb = q // block_size
                return torch.where(kv < seq_len, kv < anchors[bi, qb], (kv - seq_len) // block_size == qb)
            self.mask = create_block_mask(mask_mod, b, None, n, seq_len + n, device=anchors.device)
        else:
            self.mask = dual_pass_mask(anchors, seq_len, block_size)[:, None]       # [b, 1, N, T+N]

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        """``q [b, H, N, D]``, block ``k, v [b, Hk, N, D]`` → ``[b, H, N, D]``."""
        k_ar, v_ar = self.ar_kv[layer_idx]
        k, v = torch.cat([k_ar, k], 2), torch.cat([v_ar, v], 2)                      # [b, Hk, T+N, D]
        gqa = q.shape[1] != k.shape[1]
        if self.use_flex:
            return _flex()(q, k, v, block_mask=self.mask, scale=scale, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, scale=scale, enable_gqa=gqa)


class RecordingAttend:
    """An ``Attend`` that keeps every layer's (K, V) ``[b, Hk, T, D]`` on its way to ``inner``."""

    def __init__(self, inner: Attend) -> None:
        self.inner = inner
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
        self.kv.append((k, v))      # layers run in order, so kv[i] is layer i's
        return self.inner(layer_idx, q, k, v, scale)


@torch.no_grad()
def teacher_pass(model: OrthrusForCausalLM, tokens: torch.Tensor
                 ) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Frozen AR pass → per-layer (K, V) ``[b, Hk, T, D]`` and teacher logits ``[b, T, V]``."""
    positions = torch.arange(tokens.shape[1], device=tokens.device)[None].expand_as(tokens)
    attend = RecordingAttend(DenseSDPA())                                          # causal
    hidden = model.model(tokens, positions, attend, diffusion=False)               # [b, T, E]
    return attend.kv, model.logits(hidden)


def student_pass(model: OrthrusForCausalLM, tokens: torch.Tensor, anchors: torch.Tensor,
                 ar_kv: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 use_flex: bool | None = None) -> torch.Tensor:
    """Diffusion-view forward of every anchor's block → logits ``[b, A, K-1, V]``."""
    b, a = anchors.shape
    ids, positions = block_inputs(tokens, anchors, block_size, model.mask_token_id)  # [b, N]
    attend = DualPassAttention(anchors, tokens.shape[1], block_size, ar_kv, use_flex)
    h = model.model(ids, positions, attend, diffusion=True)                         # [b, N, E]
    h = h.view(b, a, block_size, -1)[:, :, : block_size - 1]
    return model.logits(h)                                                          # [b, A, K-1, V]


def distill_loss(model: OrthrusForCausalLM, tokens: torch.Tensor, anchors: torch.Tensor, block_size: int,
                 use_flex: bool | None = None) -> tuple[torch.Tensor, DistillStats]:
    """Forward KL(teacher ‖ student) averaged over block positions whose target lies in the sequence."""
    ar_kv, teacher = teacher_pass(model, tokens)
    student = student_pass(model, tokens, anchors, ar_kv, block_size, use_flex)
    b, a, kk, v = student.shape
    src = anchors[:, :, None] + torch.arange(kk, device=tokens.device)             # teacher row a+i → a+i+1
    valid = src + 1 < tokens.shape[1]                                               # [b, A, K-1]
    src = src.clamp(max=tokens.shape[1] - 1)
    t_logp = teacher.log_softmax(-1).gather(1, src.reshape(b, -1, 1).expand(b, a * kk, v)).view(b, a, kk, v)
    s_logp = student.float().log_softmax(-1)
    t_logp = t_logp.float()
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)                                 # [b, A, K-1]
    loss = (kl * valid).sum() / valid.sum().clamp(min=1)
    agree = ((student.argmax(-1) == t_logp.argmax(-1)) & valid).sum() / valid.sum().clamp(min=1)
    return loss, DistillStats(float(loss.detach()), float(agree))


def freeze_all_but_diffusion(model: OrthrusForCausalLM) -> list[torch.nn.Parameter]:
    """Only the ``*_diff`` twins train; returns them for the optimiser."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for _, p in model.diffusion_parameters()]
    for p in params:
        p.requires_grad_(True)
    return params
