"""What every job-config section shares: the error that names a field, and the strict base model."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A configuration problem; the message names the offending field (``section.field``)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
