"""Reading and writing checkpoints in the released Orthrus layout (plain HF directories).

A checkpoint directory is data, never code: we read ``config.json``, ``generation_config.json``
and safetensors only; ``auto_map``/``modeling_*.py`` files are ignored (no ``trust_remote_code``).
This module knows configs and state dicts, not the model class (``qwen3.py`` builds the model from
them), so the two never import each other in a cycle. It is the project's one checkpoint writer.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from orthrus.model.attention import DIFF_SUFFIX

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(root: Path) -> Qwen3Config:
    """The checkpoint's ``config.json`` as a Qwen3 config (``auto_map`` dropped); errors name the file."""
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{root}: no config.json (expected a local HF-layout checkpoint directory)")
    raw = json.loads(cfg_file.read_text())
    if raw.get("model_type") != "qwen3":
        raise ValueError(f"{cfg_file}: model_type is {raw.get('model_type')!r}; Orthrus needs a 'qwen3' model")
    raw.pop("auto_map", None)  # never a source of code
    return Qwen3Config.from_dict(raw)


def read_tensors(root: Path) -> dict[str, torch.Tensor]:
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


def complete_state(expected: dict[str, torch.Tensor], found: dict[str, torch.Tensor],
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


def generation_eos(root: Path) -> tuple[int, ...]:
    gen = root / "generation_config.json"
    if not gen.is_file():
        return ()
    eos = json.loads(gen.read_text()).get("eos_token_id")
    return tuple([eos] if isinstance(eos, int) else (eos or []))


def write_checkpoint(path: str | Path, config: Qwen3Config, state: dict[str, torch.Tensor],
                     dtype: torch.dtype | None = None) -> None:
    """Write ``config.json`` + ``model.safetensors`` (tensors cast to ``dtype`` if given; a tied LM
    head stored once). ``config`` must carry ``block_size`` and ``mask_token_id``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for field in ("block_size", "mask_token_id"):
        if getattr(config, field, None) is None:
            raise ValueError(f"config.{field} is required in an Orthrus checkpoint")
    state = {k: v.detach().to(dtype=dtype or v.dtype).contiguous().cpu()  # SYNC: saving only
             for k, v in state.items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config.architectures = ["OrthrusLM"]
    config.dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    config.save_pretrained(str(root))
    save_file(state, str(root / WEIGHTS), metadata={"format": "pt"})
    os.chmod(root / WEIGHTS, 0o644)  # save_file creates it owner-only
