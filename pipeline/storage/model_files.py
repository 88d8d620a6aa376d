"""Locate a checkpoint (local directory, object-store prefix or Hugging Face hub id) and load its
tokenizer once per process."""
from __future__ import annotations

import functools
import json
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
    """The checkpoint's tokenizer (cached: Ray reuses worker processes across tasks): the class its
    ``tokenizer_config.json`` names where transformers exports one, else ``AutoTokenizer``'s pick.

    Why not always ``AutoTokenizer``: importing it imports transformers' config machinery, which
    imports torch (2-4 s on a small machine) in the driver's preflight and in every read task that
    tokenizes, none of which runs the model. For the named class AutoTokenizer builds the same
    tokenizer (tests/unit/test_startup_imports.py compares both on our two tokenizers)."""
    named = _named_tokenizer_class(model_dir)
    try:
        if named is not None:
            return named.from_pretrained(model_dir)
        from transformers import AutoTokenizer

        # Explicit: tokenizer_config.json's auto_map must never make a checkpoint a source of code.
        return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for a missing/broken tokenizer
        raise ConfigError(f"model.path: cannot load a tokenizer from {model_dir} ({type(e).__name__}: {e})") from None


def _named_tokenizer_class(model_dir: str) -> type | None:
    """The tokenizer class ``tokenizer_config.json`` names, if transformers exports it (never a
    checkpoint's own code: ``auto_map`` is not read); None: let ``AutoTokenizer`` decide."""
    try:
        with open(os.path.join(model_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or not name.isidentifier():
        return None
    import transformers

    try:
        found = getattr(transformers, name, None)
    except Exception:  # noqa: BLE001 - a lazily imported class whose module fails: AutoTokenizer decides
        return None
    base = transformers.PreTrainedTokenizerBase
    return found if isinstance(found, type) and issubclass(found, base) else None


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
