"""OrthrusForCausalLM: a Qwen3 decoder whose attention layers carry a diffusion-view twin.

Embeddings, norms, MLPs, the final norm and the LM head are shared by both views; only attention
differs (see ``attention.py``). State-dict names match the released checkpoints
(``model.layers.N.self_attn.q_proj_diff.weight`` …), so loading needs no key mapping.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import Qwen3Config

from orthrus.model import checkpoint, compiled
from orthrus.model.attention import AR_NAMES, DIFF_SUFFIX, OrthrusAttention, merge_heads
from orthrus.model.backends import Attend, AttentionBackend, BlockBatch, DenseSDPA
from orthrus.model.cache import PagedKVCache
from orthrus.model.layers import MLP, RMSNorm, init_weights, rotary_embedding, skipped_init
from orthrus.model.ragged import RaggedBatch, ragged_attend
from orthrus.ranges import named_range, ranged

DEFAULT_BLOCK_SIZE = 32


class OrthrusDecoderLayer(nn.Module):
    """Pre-norm Qwen3 block; the attention view and the ``attend`` callable are chosen per call."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = OrthrusAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend,
                diffusion: bool) -> torch.Tensor:
        """``h [b, T, E]`` → ``[b, T, E]``: attention (one view, through ``attend``), then the shared MLP;
        the work around attention compiled where the caller runs with compiled pieces (``compiled.py``)."""
        fns = compiled.active()
        if fns is not None:
            return compiled.layer_forward(fns, self, h, cos, sin, attend, diffusion)
        q, k, v = self.attention_inputs(h, cos, sin, diffusion)
        attn = attend(self.self_attn.layer_idx, q, k, v, self.self_attn.scale)
        return self.finish(h, merge_heads(attn), diffusion)

    def attention_inputs(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, diffusion: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer's work before attention: input RMSNorm, one view's q/k/v, their norms and RoPE."""
        return self.self_attn.project(self.input_layernorm(h), cos, sin, diffusion)

    def finish(self, h: torch.Tensor, merged: torch.Tensor, diffusion: bool) -> torch.Tensor:
        """The layer's work after attention (``merged [b, T, H*D]``): output projection, residual, MLP."""
        h = h + self.self_attn.project_out(merged, diffusion)
        return h + self.mlp(self.post_attention_layernorm(h))


class OrthrusModel(nn.Module):
    """Embeddings, decoder layers and final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(OrthrusDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend,
                diffusion: bool) -> torch.Tensor:
        """THE layer loop (inference, the plain AR forward and training all run it): ``input_ids
        [b, T]`` at ``positions [b, T]`` through one view → final-norm hidden ``[b, T, E]``."""
        h = self.embed_tokens(input_ids)                                   # [b, T, E]
        cos, sin = self.rotary_emb(h, positions)                           # [b, T, D]
        for layer in self.layers:
            h = layer(h, cos, sin, attend, diffusion)
        return self.norm(h)


class OrthrusForCausalLM(nn.Module):
    """One Qwen3 model, two attention views sharing one KV cache (docs/design.md §2.1).

    ``forward(input_ids)`` is the plain AR model (all positions' logits). The engine uses
    ``forward_cached`` to run either view on a block over the ragged cache; both, and training, run
    the one layer loop ``OrthrusModel.forward`` with a different ``attend`` (``backends.py``).
    A plain ``nn.Module`` (``from_pretrained``, ``save_pretrained`` and the initialisation are this
    package's own, ``layers.py``): transformers' ``PreTrainedModel`` costs seconds of import.
    """

    def __init__(self, config: Qwen3Config) -> None:
        if getattr(config, "use_sliding_window", False):
            raise ValueError("config.use_sliding_window=True is not supported (Qwen3 models use full attention)")
        super().__init__()
        self.config = config
        self.model = OrthrusModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if not self.lm_head.weight.is_meta:       # from_pretrained builds on "meta", then assigns weights
            init_weights(self, getattr(config, "initializer_range", None) or 0.02)
        self.copy_ar_to_diffusion()  # the twins start as copies: the AR view is the original model

    @property
    def block_size(self) -> int:
        """Draft block size K the diffusion view was trained with."""
        return int(getattr(self.config, "block_size", None) or DEFAULT_BLOCK_SIZE)

    @property
    def mask_token_id(self) -> int:
        """Token id fed at the K-1 masked block positions (an unused embedding row)."""
        mask = getattr(self.config, "mask_token_id", None)
        return int(mask) if mask is not None else self.config.vocab_size - 1

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every EOS id of the config (and of generation_config.json when loaded from a directory)."""
        ids: set[int] = set(getattr(self, "_extra_eos_ids", ()))
        eos = self.config.eos_token_id
        ids.update([eos] if isinstance(eos, int) else list(eos or []))
        return tuple(sorted(ids))

    def diffusion_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """The ``*_diff`` twins: the only parameters training changes."""
        return [(n, p) for n, p in self.named_parameters() if DIFF_SUFFIX + "." in n]

    @torch.no_grad()
    def copy_ar_to_diffusion(self) -> None:
        """Set every twin to its AR counterpart (how a plain Qwen3 checkpoint becomes Orthrus)."""
        for layer in self.model.layers:
            for name in AR_NAMES:
                getattr(layer.self_attn, name + DIFF_SUFFIX).load_state_dict(
                    getattr(layer.self_attn, name).state_dict())

    def forward_cached(self, input_ids: torch.Tensor, cache: PagedKVCache, batch: BlockBatch,
                       diffusion: bool, backend: AttentionBackend) -> torch.Tensor:
        """Run one view on ``input_ids [b, T]`` over the paged cache through ``backend`` (which
        writes the block's K/V and attends) → final hidden ``[b, T, E]``."""
        with ranged("draft_forward" if diffusion else "verify_forward"):     # once per forward: free
            return self.model(input_ids, batch.positions, backend.bind(batch, cache), diffusion)

    def forward_ragged(self, tokens: torch.Tensor, cache: PagedKVCache, batch: RaggedBatch, diffusion: bool,
                       backend: AttentionBackend) -> torch.Tensor:
        """Run one view on a flat token batch ``tokens [N]`` (``ragged.py``: no padding reaches a
        linear layer; attention per row over the paged cache through ``backend``) → hidden ``[N, E]``."""
        with ranged("draft_forward" if diffusion else "verify_forward"):
            attend = ragged_attend(batch, cache, backend, causal=not diffusion)
            return self.model(tokens[None], batch.positions[None], attend, diffusion)[0]

    def forward_dense(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                      mask: torch.Tensor | None = None, diffusion: bool = False) -> torch.Tensor:
        """Whole-sequence forward without a cache → final hidden ``[b, T, E]`` (None mask = causal)."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        return self.model(input_ids, positions, DenseSDPA(mask), diffusion)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Plain causal AR view: logits ``[b, T, V]`` for every position."""
        return self.lm_head(self.forward_dense(input_ids))

    @named_range("lm_head")
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``[..., E]`` → ``[..., V]``."""
        return self.lm_head(hidden)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        device: str | torch.device = "cpu") -> "OrthrusForCausalLM":
        """Load an Orthrus or plain Qwen3 checkpoint from a local HF-layout directory (no remote code);
        twins absent from the checkpoint start as AR copies."""
        root = Path(path)
        config = checkpoint.read_config(root)
        found = checkpoint.read_tensors(root)
        with torch.device("meta"), skipped_init():
            model = cls(config)
        state = checkpoint.complete_state(dict(model.state_dict()), found, bool(config.tie_word_embeddings), root)
        model.load_state_dict({k: v.to(dtype=dtype) for k, v in state.items()}, assign=True, strict=True)
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.model.rotary_emb = rotary_embedding(config)   # not persistent: rebuilt off meta
        model._extra_eos_ids = checkpoint.generation_eos(root)
        return model.to(device=device).eval()

    def save_pretrained(self, path: str, dtype: torch.dtype | None = None) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the released Orthrus layout."""
        self.config.block_size = self.block_size
        self.config.mask_token_id = self.mask_token_id
        checkpoint.write_checkpoint(path, self.config, self.state_dict(), dtype=dtype)
