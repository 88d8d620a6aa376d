"""What an output directory's rows depend on, recorded at each run and compared on resume.

A resume that changed the model, the sampling settings or the prompt formatting would mix rows of
two configurations in one output without a trace. ``_job.json`` records the fingerprint of the run
that wrote it; ``--resume`` with a different one is refused, naming each field that changed, unless
``--allow-config-change``. Included: the model, the input columns that make ids and prompts, every
prompt and sampling setting, and the engine's dtype and context limit (bf16 rounds differently;
the context limit ends rows). Left out on purpose: the other engine settings (block size,
speculation mode, prefix cache, slots, batch size) change speed, not the rows' distribution.
"""
from __future__ import annotations

from pathlib import Path

from pipeline.config import ConfigError, JobConfig

# Settings added after outputs with fingerprints existed, left out at their default (which is what
# those outputs were generated with), so such an output resumes unchanged.
_LATER_DEFAULTS = {"sampling.min_tokens": 0, "sampling.max_thinking_tokens": None,
                   "sampling.repetition_penalty": 1.0, "sampling.presence_penalty": 0.0,
                   "sampling.frequency_penalty": 0.0, "sampling.min_p": 0.0, "sampling.logit_bias": {},
                   "sampling.ignore_eos": False}


def fingerprint(config: JobConfig) -> dict[str, object]:
    """Dotted field -> value for every setting the generated rows depend on."""
    out: dict[str, object] = {"model.path": config.model.path, "model.revision": config.model.revision,
                              "input.id_column": config.input.id_column,
                              "input.prompt_column": config.input.prompt_column,
                              "input.messages_column": config.input.messages_column,
                              "engine.dtype": config.engine.dtype, "engine.max_seq_len": config.engine.max_seq_len}
    for section in ("prompt", "sampling"):
        for name, value in getattr(config, section).model_dump(mode="json").items():
            key = f"{section}.{name}"
            if key not in _LATER_DEFAULTS or value != _LATER_DEFAULTS[key]:
                out[key] = value
    return out


def check_unchanged(recorded: dict | None, legacy_model: str | None, current: dict[str, object],
                    allow_change: bool, root: Path) -> None:
    """Refuse a resume whose fingerprint differs from the recorded one (naming each change)."""
    if recorded is None:            # written before fingerprints existed: only the model is known
        recorded = {"model.path": legacy_model} if legacy_model is not None else {}
        current = {k: v for k, v in current.items() if k in recorded}
    changed = [f"{k}: {recorded.get(k)!r} -> {current.get(k)!r}" for k in sorted(set(recorded) | set(current))
               if recorded.get(k) != current.get(k)]
    if changed and not allow_change:
        raise ConfigError(f"output.path {root} was generated with a different configuration; resuming would mix "
                          f"rows of both in one output. Changed: {'; '.join(changed)}. Restore those settings, "
                          "choose another output.path, or pass --allow-config-change (behaviour.allow_config_change)")
