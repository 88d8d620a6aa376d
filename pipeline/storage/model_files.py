"""Locate a checkpoint (local directory, object-store prefix or Hugging Face hub id) and load its
tokenizer once per process."""
from __future__ import annotations

import functools
import os
import re

from pipeline.config import ConfigError, ModelConfig, StorageConfig
from pipeline.storage.model_cache import download
from pipeline.storage.uris import info, is_remote, local_path, locate

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


_METADATA = ["*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja"]  # config + tokenizer, no weights


@functools.lru_cache(maxsize=8)  # per process: hub lookups are network calls
def resolve_model_dir(cfg: ModelConfig, storage: StorageConfig = StorageConfig(), weights: bool = True) -> str:
    """A local directory holding the checkpoint; object-store prefixes are downloaded into the node's
    model cache (``model_cache.py``), hub ids into the local HF cache.

    Runs on the driver (preflight: ``weights=False``, config and tokenizer only) and again on every
    actor, because actors may sit on nodes whose cache the driver never filled.
    """
    if is_remote(cfg.path):
        loc = locate(cfg.path, storage, "model.path")
        info(loc, "model.path")   # a missing bucket or refused credentials: say so before listing
        return download(loc, storage, None if weights else _METADATA)
    if os.path.isdir(local_path(cfg.path)):
        return os.path.abspath(local_path(cfg.path))
    if not _HUB_ID.match(cfg.path):
        raise ConfigError(f"model.path: {cfg.path!r} is neither a local directory nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(cfg.path, revision=cfg.revision, allow_patterns=None if weights else _METADATA)
    except Exception as e:  # network, auth or missing repo: all mean "cannot get this model"
        raise ConfigError(f"model.path: {cfg.path!r} is not a local directory and could not be fetched "
                          f"from the hub ({type(e).__name__}: {e})") from None


@functools.lru_cache(maxsize=4)
def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer (cached: Ray reuses worker processes across tasks)."""
    from transformers import AutoTokenizer

    try:
        # Explicit: tokenizer_config.json's auto_map must never make a checkpoint a source of code.
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise ConfigError(f"model.path: cannot load a tokenizer from {model_dir} ({type(e).__name__}: {e})") from None


def check_weight_headers(model_dir: str) -> None:
    """Read the header of every local ``*.safetensors`` file (names, dtypes, shapes: no tensor data),
    so that a truncated or corrupt weights file is refused before any actor starts loading it."""
    from safetensors import safe_open

    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            try:
                # numpy, not "pt": the same header checks without importing torch into the driver
                with safe_open(os.path.join(model_dir, name), framework="numpy") as f:
                    f.keys()
            except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
                raise ConfigError(f"model.path: weights file {name} in {model_dir} is not readable "
                                  f"({type(e).__name__}: {e})") from None
