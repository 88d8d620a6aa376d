"""Loading and saving checkpoints in the released Orthrus layout (plain HF directories).

A checkpoint directory is data, never code: we read ``config.json``, ``generation_config.json``
and safetensors only; ``auto_map``/``modeling_*.py`` files are ignored (no ``trust_remote_code``).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from orthrus.attention import DIFF_SUFFIX

if TYPE_CHECKING:
    from orthrus.model import OrthrusForCausalLM

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_config(root: Path) -> Qwen3Config:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json (expected a local HF-layout checkpoint directory)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"{cfg_file}: model_type is {raw.get('model_type')!r}; Orthrus needs a 'qwen3' model")
    raw.pop("auto_map", None)  # never a source of code
    return Qwen3Config.from_dict(raw)


def _read_tensors(root: Path) -> dict[str, torch.Tensor]:
    if (root / INDEX).is_file():
        shards = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    elif (root / WEIGHTS).is_file():
        shards = [WEIGHTS]
    else:
        raise FileNotFoundError(f"{root}: no {WEIGHTS} or {INDEX}")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(str(root / shard)))
    return tensors


def _complete_state(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor],
                    tied: bool, where: Path) -> dict[str, torch.Tensor]:
    """Fill in twins missing from a plain Qwen3 checkpoint; fail on anything else missing/unknown."""
    state = {k: v for k, v in found.items() if not k.endswith(IGNORED_SUFFIXES)}
    for key in expected:
        if key in state:
            continue
        ar_key = key.replace(DIFF_SUFFIX + ".", ".")
        if ar_key != key and ar_key in state:
            state[key] = state[ar_key].clone()
    if tied:
        state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
    missing = sorted(k for k in expected if state.get(k) is None)
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{where}: checkpoint does not match the Qwen3/Orthrus layout; "
                         f"missing={missing[:8]} unexpected={unexpected[:8]}")
    for key, ref in expected.items():
        if tuple(state[key].shape) != tuple(ref.shape):
            raise ValueError(f"{where}: tensor {key} has shape {tuple(state[key].shape)}, "
                             f"config implies {tuple(ref.shape)}")
    return state


def _generation_eos(root: Path) -> tuple[int, ...]:
    gen = root / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple([eos] if isinstance(eos, int) else (eos or []))


def load_checkpoint(cls: type["OrthrusForCausalLM"], path: str, dtype: torch.dtype,
                    device: str | torch.device) -> "OrthrusForCausalLM":
    """Build the model from ``path``; twins absent from the checkpoint start as AR copies."""
    root = Path(path)
    config = _read_config(root)
    found = _read_tensors(root)
    with torch.device("meta"):
        model = cls(config)
    expected = {k: v for k, v in model.state_dict().items()}
    state = _complete_state(expected, found, bool(config.tie_word_embeddings), root)
    state = {k: v.to(dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, assign=True, strict=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rotary buffers are not persistent: rebuild them off the meta device.
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    model.model.rotary_emb = Qwen3RotaryEmbedding(config=config)
    model._extra_eos_ids = _generation_eos(root)
    return model.to(device=device).eval()


def save_checkpoint(model: "OrthrusForCausalLM", path: str, dtype: torch.dtype | None = None) -> None:
    """Save config + safetensors (optionally cast to ``dtype``); a tied LM head is stored once."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    config = model.config
    config.architectures = ["OrthrusLM"]
    config.block_size = model.block_size
    config.mask_token_id = model.mask_token_id
    config.save_pretrained(str(root))
    state = {k: v.detach().to(dtype=dtype or v.dtype).contiguous() for k, v in model.state_dict().items()}
    state = {k: v.cpu() for k, v in state.items()}  # SYNC: saving only, never in the decode loop
    config.dtype = str(dtype or next(model.parameters()).dtype).removeprefix("torch.")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(root / WEIGHTS), metadata={"format": "pt"})
