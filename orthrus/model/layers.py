"""Qwen3's building blocks (RMSNorm, the gated MLP, rotary embeddings) and its weight initialisation.

These are transformers' ``modeling_qwen3`` pieces written out, op for op, so that the model's
numerics stay identical (``tests/engine`` compares every forward with transformers' own Qwen3 in
float64) while importing the model needs only torch: ``transformers.PreTrainedModel`` and
``modeling_qwen3`` pull in torch's compiler, distributed tensors, sympy and scipy, 5-10 s of an
actor's start-up on a small CPU machine that the engine never uses. The configuration stays
transformers' ``Qwen3Config`` (a cheap import). A RoPE variant other than the default (none of the
released Qwen3 checkpoints uses one) is computed by transformers' own rotary module, imported then.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class RMSNorm(nn.Module):
    """transformers' ``Qwen3RMSNorm``: computed in float32, scaled in the input's dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class MLP(nn.Module):
    """transformers' ``Qwen3MLP``: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act != "silu":     # every Qwen3 checkpoint; another would need transformers' table
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported (Qwen3 uses 'silu')")
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """transformers' ``Qwen3RotaryEmbedding`` for the default RoPE: ``(cos, sin)`` at ``positions``."""

    def __init__(self, config) -> None:
        super().__init__()
        base = config.rope_parameters["rope_theta"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # Built on "meta" (from_pretrained, which rebuilds it after), the frequencies are computed
        # on the CPU: torch's meta kernel for arange would import its compiler (a second of start-up).
        device = "cpu" if torch.get_default_device().type == "meta" else None
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        self.attention_scaling = 1.0
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotary_embedding(config) -> nn.Module:
    """The config's rotary module: ours for the default RoPE, transformers' for a scaled variant."""
    parameters = getattr(config, "rope_parameters", None) or {}
    if parameters.get("rope_type", "default") == "default":
        return RotaryEmbedding(config)
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    return Qwen3RotaryEmbedding(config=config)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb`` (heads on dim 1): ``q, k [b, H, T, D]``, ``cos, sin [b, T, D]``."""
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


@torch.no_grad()
def init_weights(model: nn.Module, std: float) -> None:
    """transformers' ``PreTrainedModel`` initialisation, in its order (children before their parent,
    so a tied LM head draws the shared matrix last): every linear N(0, std) with zero biases, every
    embedding N(0, std) with its padding row zeroed, every norm ones. The same seed gives the same
    weights as before, so the tests' random models (and what they generate) are unchanged."""
    for child in model.children():
        init_weights(child, std)
    if isinstance(model, nn.Linear):
        model.weight.normal_(mean=0.0, std=std)
        if model.bias is not None:
            model.bias.zero_()
    elif isinstance(model, nn.Embedding):
        model.weight.normal_(mean=0.0, std=std)
        if model.padding_idx is not None:
            model.weight[model.padding_idx].zero_()
    elif isinstance(model, RMSNorm):
        model.weight.fill_(1.0)


@contextmanager
def skipped_init() -> Iterator[None]:
    """Build modules without their own random initialisation (``from_pretrained`` builds on "meta"
    and assigns the checkpoint's tensors). Filling a meta tensor at random goes through torch's
    Python reference kernels, which import its compiler: about a second of a worker's start-up.
    What transformers' ``no_init_weights`` does; the functions are restored on exit."""
    names = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "zeros_", "ones_")
    saved = {name: getattr(nn.init, name) for name in names}
    for name in names:
        setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)
