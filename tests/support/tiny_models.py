"""Tiny deterministic models for the core tests (random weights, float64 where exactness is claimed)."""
from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from orthrus import OrthrusForCausalLM


def tiny_config(vocab: int = 64, block_size: int = 4, eos: int | list[int] = 63, layers: int = 2,
                max_pos: int = 256) -> Qwen3Config:
    """A 2-layer GQA Qwen3 config; the mask token is the last vocabulary row."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=max_pos,
                      eos_token_id=eos, tie_word_embeddings=False, rope_theta=10000.0)
    cfg.block_size = block_size
    cfg.mask_token_id = vocab - 1
    return cfg


def tiny_model(seed: int = 0, diff_noise: float = 0.0, dtype: torch.dtype = torch.float64,
               scale: float = 1.0, **cfg_kwargs) -> OrthrusForCausalLM:
    """Random Orthrus model; ``diff_noise`` perturbs the twins so the draft differs from the AR view.

    ``scale`` multiplies the LM head so the random model's distributions are peaked enough to be
    interesting (a flat random model makes every sampled test trivially pass).
    """
    torch.manual_seed(seed)
    model = OrthrusForCausalLM(tiny_config(**cfg_kwargs))
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
        for _, p in model.diffusion_parameters():
            p.add_(diff_noise * torch.randn_like(p) * p.std())
    return model.to(dtype).eval()


def hf_twin(model: OrthrusForCausalLM) -> Qwen3ForCausalLM:
    """transformers' own Qwen3 with the AR weights of ``model`` (the reference decoder)."""
    hf = Qwen3ForCausalLM(model.config).to(next(model.parameters()).dtype)
    ar_state = {k: v for k, v in model.state_dict().items() if "_diff." not in k}
    missing, unexpected = hf.load_state_dict(ar_state, strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return hf.eval()


def hf_greedy(hf: Qwen3ForCausalLM, prompt: list[int], max_new: int, eos: tuple[int, ...]) -> list[int]:
    """transformers' greedy ``generate`` for one prompt → the generated ids."""
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                      eos_token_id=list(eos), pad_token_id=0)
    return out[0, len(prompt):].tolist()
