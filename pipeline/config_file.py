"""A job's config file: YAML read safely, ``--set key.path=value`` overrides applied, the result
validated as :class:`~pipeline.config.JobConfig`; every problem a :class:`ConfigError` naming the
file, the override or the field."""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipeline.config import ConfigError, JobConfig, describe_errors


def parse_override(item: str) -> tuple[list[str], Any]:
    """``'sampling.temperature=0.7'`` -> (['sampling', 'temperature'], 0.7); the value is YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise ConfigError(f"override {item!r} must look like section.field=value")
    try:
        return key.strip().split("."), yaml.safe_load(raw)  # safe_load: a value never constructs objects
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {e}") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each dotted key in a copy of ``data``; unknown keys are left for validation to reject."""
    out = copy.deepcopy(data)
    for item in overrides:
        path, value = parse_override(item)
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part!r} is not a section")
        node[path[-1]] = value
    return out


def load_config(path: str | Path | None, overrides: list[str] = (), source: str | None = None,
                data: dict[str, Any] | None = None) -> JobConfig:
    """Read YAML (or take ``data``), apply overrides, validate; raise :class:`ConfigError` on problems."""
    if data is None:
        if path is None:
            raise ConfigError("no config given: pass --config FILE")
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
    try:
        return JobConfig.model_validate(apply_overrides(data, list(overrides)))
    except ValidationError as e:
        raise ConfigError(describe_errors(e, source or str(path or "<dict>"))) from None
