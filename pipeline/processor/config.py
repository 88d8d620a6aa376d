"""``OrthrusProcessorConfig``: the processor's settings, named as Ray Data LLM's ``vLLMEngineProcessorConfig``
names the same concepts (model_source, batch_size, concurrency, max_concurrent_batches,
accelerator_type, resources_per_bundle, apply_chat_template, chat_template, tokenize, detokenize,
engine_kwargs).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from pipeline.config import (AuditConfig, ConfigError, EngineKwargs, GroupingFields, ModelConfig, StorageConfig,
                             describe_errors)


class OrthrusProcessorConfig(GroupingFields):
    """How ``build_orthrus_processor`` generates: the model, its replicas, prompts, and the engine."""

    model_source: str = Field(min_length=1, description=(
        "HF-layout Orthrus checkpoint with tokenizer files: a local directory (on every node), an "
        "object-store prefix (s3://..., downloaded once per node into storage.model_cache_dir) or a hub id."))
    model_revision: str | None = Field(None, description="Hub revision (branch, tag or commit); hub ids only.")
    batch_size: int = Field(32, ge=1, description="Rows handed to one actor call.")
    concurrency: int | tuple[int, int] = Field(1, description=(
        "Model replicas (actors): n, or (min, max) for an autoscaling pool."))
    max_concurrent_batches: int = Field(4, ge=1, description=(
        "Batches each replica holds at once, all feeding its one streaming engine (its slots stay busy "
        "across batch boundaries; each batch still returns when its own rows are done)."))
    accelerator_type: str | None = Field(None, description=(
        "None: replicas run on CPU. 'GPU': one GPU each. A Ray accelerator type (e.g. 'H100'): one GPU "
        "of that type each."))
    resources_per_bundle: dict[str, float] | None = Field(None, description=(
        "Resources each replica reserves, e.g. {'GPU': 1, 'CPU': 2}; overrides the defaults "
        "(CPU 1, and GPU 1 with an accelerator_type)."))
    apply_chat_template: bool | Literal["auto"] = Field("auto", description=(
        "Format 'messages' (or 'prompt' as one user message) with the chat template; False tokenizes "
        "'prompt' as is; 'auto' = if the tokenizer (or chat_template) has one."))
    chat_template: str | None = Field(None, description="A Jinja chat template replacing the tokenizer's own.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "Extra variables for the chat template, e.g. {'enable_thinking': False} for Qwen3."))
    tokenize: bool = Field(True, description=(
        "False: rows carry token ids in 'tokenized_prompt' (no template, no tokenizer call)."))
    detokenize: bool = Field(True, description="False: 'generated_text' stays null (ids only).")
    engine_kwargs: EngineKwargs = Field(default_factory=EngineKwargs, description=(
        "OrthrusEngine keyword arguments (max_batch_size, block_size, speculative, max_seq_len, attention, "
        "static_shapes, prefix_cache, kv_cache_tokens, max_num_batched_tokens, adaptive_verify, compile) and dtype."))
    row_timeout_s: float | None = Field(None, gt=0.0, allow_inf_nan=False, description=(
        "A row holding its engine slot longer than this is aborted and becomes an error row."))
    audit: AuditConfig = Field(default_factory=AuditConfig, description="Lossless audit against plain AR.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description=(
        "Object-store settings for an s3:// model_source (region, endpoint, model cache)."))

    @field_validator("concurrency")
    @classmethod
    def _pool(cls, v: int | tuple[int, int]) -> int | tuple[int, int]:
        low, high = (v, v) if isinstance(v, int) else v
        if not 1 <= low <= high:
            raise ValueError("must be n >= 1 or (min, max) with 1 <= min <= max")
        return v

    @property
    def model(self) -> ModelConfig:
        """The checkpoint, as the job names it."""
        return ModelConfig(path=self.model_source, revision=self.model_revision)

    @property
    def bundle(self) -> dict[str, float]:
        """What each replica reserves: {'CPU': c, 'GPU': g}."""
        if self.resources_per_bundle is not None:
            return {"CPU": 1.0, "GPU": 0.0, **self.resources_per_bundle}
        return {"CPU": 1.0, "GPU": 1.0 if self.accelerator_type else 0.0}


def processor_config(data: dict[str, Any] | OrthrusProcessorConfig) -> OrthrusProcessorConfig:
    """Validate a dict (or pass a config through); :class:`ConfigError` names each bad field."""
    if isinstance(data, OrthrusProcessorConfig):
        return data
    try:
        return OrthrusProcessorConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(describe_errors(e, "OrthrusProcessorConfig")) from None
