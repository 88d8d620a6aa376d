"""Job configuration: the pydantic model of a job's config, section by section (read from YAML with
``--set key.path=value`` overrides by ``config_file.py``).

Every section rejects unknown keys (``extra="forbid"``), so a typo fails at load time naming the
field instead of silently falling back to a default.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from orthrus import EngineSettings
# The sampling section and the shared base live in their own modules; both names stay importable from here.
from pipeline.sampling_config import SamplingConfig  # noqa: F401
from pipeline.sections import ConfigError, _Section


class InputConfig(_Section):
    """Where the prompts come from and which columns hold what."""

    paths: list[str] = Field(min_length=1, description=(
        "Inputs (see input.format): files, directories or prefixes (read recursively) or glob patterns, as local "
        "paths or URIs (s3://bucket/prefix, gs://..., hdfs://...; see the storage section). Relative "
        "paths are resolved against the driver's working directory."))
    id_column: str = Field("id", min_length=1, description=(
        "Column holding each row's unique id. If no input file has it, ids are derived as "
        "'<file name>:<row index>'."))
    prompt_column: str = Field("prompt", min_length=1, description="Column holding a plain-text prompt.")
    messages_column: str = Field("messages", min_length=1, description=(
        "Column holding chat messages (list of {role, content}, or the same as a JSON string)."))
    verify: Literal["footers", "full"] = Field("footers", description=(
        "'footers': the driver reads footers only (start-up grows with files, not rows); ids are checked "
        "by Ray tasks before the first commit, and a file with a corrupt page stops the job (exit 2) when "
        "its read task reaches it. 'full': every row group of every file is read by Ray tasks before any "
        "actor loads the model, so such a file stops the job up front."))
    format: Literal["auto", "parquet", "jsonl", "openai_batch"] = Field("auto", description=(
        "'parquet'; 'jsonl' (one JSON object per line, its keys are columns); 'openai_batch' (OpenAI Batch "
        "API request lines: custom_id is the id, body.messages or body.prompt the prompt, body's max_tokens, "
        "temperature, top_p, seed, stop, logprobs/top_logprobs the row's sampling, response_format or vLLM's "
        "guided_json/guided_regex/guided_choice/guided_grammar its structured output). JSONL files may be "
        "compressed (.gz, .zst). 'auto': from the file extension (.parquet; .jsonl, .ndjson, .json with an "
        "optional .gz or .zst). JSONL files are converted once, by Ray tasks before any model loads, into "
        "Parquet under <output>/_staged/ (reused on resume while the source is unchanged); a malformed "
        "line becomes an error row naming its line number."))


class OutputConfig(_Section):
    """Where completions and the run summary go."""

    path: str = Field(min_length=1, description=(
        "Output directory or object-store prefix (s3://bucket/prefix, ...): Parquet parts under data/, "
        "summary.json and summary.png at the top. Must not be inside an input directory."))
    part_bytes: int = Field(128 * 1024 * 1024, ge=1, description=(
        "Commit the open part once it holds this many bytes (Arrow size). Parts are sized for storage, "
        "not for the engine: many engine batches stream into one part."))
    part_seconds: float = Field(60.0, gt=0.0, allow_inf_nan=False, description=(
        "Commit the open part once it has been open this long, whatever its size: the most work a "
        "kill can lose (resume regenerates it)."))
    format: Literal["parquet", "jsonl", "openai_batch"] | None = Field(None, description=(
        "The committed parts under data/ are always Parquet (they are the exactly-once ledger that resume "
        "and the repairs read). 'jsonl' also writes results.jsonl (one object per output row); "
        "'openai_batch' writes results.jsonl in the OpenAI Batch output format and the failed requests to "
        "errors.jsonl. Both are rendered from data/ by a Ray task when every row is done (again after a "
        "resume, --retry-errors or --dedupe). None: 'openai_batch' for openai_batch input, 'jsonl' for "
        "JSONL input, else 'parquet' (data/ only)."))


class ModelConfig(_Section):
    """The Orthrus checkpoint to load."""

    path: str = Field(min_length=1, description=(
        "HF-layout checkpoint (with tokenizer files): a local directory, an object-store prefix "
        "(s3://bucket/model, downloaded once per node into storage.model_cache_dir), or a Hugging "
        "Face hub id."))
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit); hub ids only.")


class PromptConfig(_Section):
    """How a row becomes prompt text."""

    chat_template: Literal["auto", "on", "off"] = Field("auto", description=(
        "'on': apply the tokenizer's chat template (messages, or the prompt as one user message); "
        "'off': tokenize the prompt column as is; 'auto': 'on' if the tokenizer has a template."))
    enable_thinking: bool | None = Field(None, description=(
        "Passed to the chat template as enable_thinking (Qwen3 thinking mode); None leaves the "
        "template's default."))

    @field_validator("chat_template", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean; accept what the user meant.
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class EngineKwargs(_Section):
    """How each replica builds its Orthrus engine (``OrthrusEngine``'s own keyword names, plus dtype)."""

    max_batch_size: int = Field(8, ge=1, description="Decoding slots per replica (continuous batching).")
    block_size: int | None = Field(None, ge=2, description="Draft block size K; None = the model's.")
    speculative: bool | Literal["auto"] = Field(True, description=(
        "true: self-speculative decoding; false: plain AR on the same engine; 'auto': per iteration, "
        "the block size (K, K/2, ... 2) or plain AR step measured fastest at the current batch occupancy."))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description=(
        "Weights dtype; 'auto' = bfloat16 on GPU, float32 on CPU."))
    max_seq_len: int | None = Field(None, ge=2, description=(
        "Context limit (prompt + generated tokens); the KV cache is allocated for it in every slot. "
        "None = the model's max_position_embeddings capped at 8192."))
    attention: Literal["auto", "sdpa", "flash"] = Field("auto", description=(
        "Attention kernel over the KV cache: 'flash' = FlashAttention's flash_attn_with_kvcache with "
        "per-row lengths (needs GPU replicas, bf16/fp16 and the flash-attn package); 'sdpa' = PyTorch "
        "SDPA with a ragged mask; 'auto' = flash where it can run, sdpa elsewhere."))
    static_shapes: bool | None = Field(None, description=(
        "Pad each decode iteration to static shapes, so that on GPU replicas (flash or SDPA) it is captured "
        "once as a CUDA graph and replayed (one launch per iteration instead of thousands). None: on for GPU "
        "replicas, off on CPU; false: eager everywhere; true: the static path on CPU too (for tests). "
        "(Formerly cuda_graphs: true/false, still accepted.)"))
    prefix_cache: bool = Field(True, description=(
        "A prompt that shares leading whole KV pages of tokens with a prompt the cache holds (the n samples "
        "of a row, a common system prompt) shares those pages instead of prefilling them again (a running "
        "row's prompt is also extended token by token); only the rest is computed. Pages of finished rows "
        "stay cached until the pool needs them. Lossless (the shared K/V is what the prefill would "
        "compute): false only to measure it. summary.json's prefill section and the live metrics count "
        "tokens computed and tokens shared."))
    kv_cache_tokens: int | None = Field(None, ge=1, description=(
        "Size of each replica's paged KV cache, in token positions (at least one row at full length: "
        "max_seq_len + block size, in whole pages of 16 tokens, 256 with flash). Rows take pages as they "
        "grow, so with rows shorter than max_seq_len more rows fit than max_batch_size x max_seq_len "
        "would suggest: raise max_batch_size (the cap on rows in flight) to use it. When the pool runs "
        "short the newest rows are preempted and their K/V recomputed later, every token kept. None: "
        "every slot at full length on CPU (never preempts); on GPU what 90% of free memory holds after "
        "the model, less 2 GiB, capped at that."))

    max_num_batched_tokens: int | None = Field(None, ge=1, description=(
        "The step's token budget (vLLM's name): each engine step runs ONE forward over the running rows' "
        "blocks (a speculative cycle's verify block, or an AR step's token) and then chunks of the prompts "
        "being prefilled, oldest first, up to this many tokens in all. A long prompt is so prefilled over "
        "several steps while the other rows keep decoding. Smaller: running rows wait less behind long "
        "prompts; larger: prompts start sooner. None: 8192 on GPU, 2048 on CPU."))

    adaptive_verify: bool = Field(True, description=(
        "A speculative cycle verifies only as many of its drafts as pay, where the drafter is most "
        "confident, the number chosen per batch occupancy from measured step costs; the output stays "
        "exactly the AR model's. It adapts where every row of a cycle is greedy, or with speculative: "
        "auto (a sampled row's draws depend on it, so seeded sampled rows under fixed speculation "
        "verify every draft). False: every draft is verified."))

    compile: bool | None = Field(None, description=(
        "Run each decoder layer's work around attention (norms, projections, rotary, MLP, residuals) "
        "through torch.compile (inductor: fused kernels, under the CUDA graphs on GPU replicas); attention, "
        "sampling and acceptance stay eager. Exact: the same tokens as eager. None: on for GPU "
        "replicas, off on CPU (there the first compile costs minutes of a small machine for a modest gain). "
        "Compiled kernels are cached on the node's local disk (TORCHINDUCTOR_CACHE_DIR, default "
        "~/.cache/orthrus/inductor), so a second process on a node starts warm; summary.json's "
        "engine.compile_seconds sums the time every replica spent compiling."))

    @model_validator(mode="before")
    @classmethod
    def _formerly_cuda_graphs(cls, data: Any) -> Any:
        # The setting's name before it took the engine's (one name from the YAML to the engine).
        if isinstance(data, dict) and "cuda_graphs" in data:
            data = dict(data)
            graphs = data.pop("cuda_graphs")
            if "static_shapes" in data:
                raise ValueError("cuda_graphs is the former name of static_shapes: give one of them")
            data["static_shapes"] = None if graphs is True else graphs
        return data

    def engine_settings(self, **chosen: Any) -> EngineSettings:
        """The engine's settings of the same names (``orthrus.EngineSettings``), with ``chosen`` ones
        (the actor's own slot count or mode) over them."""
        given = {name: getattr(self, name) for name in EngineSettings.names() if name in type(self).model_fields}
        return EngineSettings(**{**given, **chosen})

    @model_validator(mode="after")
    def _flash_needs_half_precision(self) -> "EngineKwargs":
        if self.attention == "flash" and self.dtype == "float32":
            raise ValueError("attention='flash' needs dtype bfloat16, float16 or auto, not float32")
        return self

    @model_validator(mode="after")
    def _pool_holds_one_row(self) -> "EngineKwargs":
        # Checkable here only when both sizes are set (else they come from the model, and the engine checks).
        if self.kv_cache_tokens is not None and self.max_seq_len is not None and self.block_size is not None:
            need = self.max_seq_len + self.block_size
            if self.kv_cache_tokens < need:
                raise ValueError(f"kv_cache_tokens must hold one row at full length (max_seq_len + block_size "
                                 f"= {need}), got {self.kv_cache_tokens}")
        return self


# engine.batch_size left unset: a call carries about this many new tokens (measured with
# ``python -m jobs.bench short``: 1-token rows in 64-row calls ran at about half the bare engine's
# rate, the rest being each call's cost around the engine), and never fewer than MIN_BATCH_ROWS rows.
BATCH_TOKENS = 1024
MIN_BATCH_ROWS = 64


# The prepare stage works on windows of at least this many rows: large enough that a task's overhead
# is small next to its tokenization (and prefix grouping has rows to order), small enough that the
# first batches reach the actors early.
PREPARE_ROWS = 1024


class GroupingFields(_Section):
    """Prefix grouping (``pipeline/requests/grouping.py``), the same two fields in the job's engine
    section and in the processor's config."""

    prefix_grouping: bool = Field(True, description=(
        "Order each prepared window of rows by prompt token ids (ties by input position, error rows last) "
        "before it is cut into batches, so rows that share a prefix (a system prompt, a few-shot block, a "
        "document with many questions) reach an actor together and meet in its prefix cache. Output, "
        "seeds and exactly-once are unaffected (rows keep their coordinates). The processor leaves "
        "order alone when the DataContext asks to preserve it."))
    prefix_grouping_rows: int | None = Field(None, ge=1, description=(
        "The window: rows prepared (tokenized and ordered) together in one task. None = the prepare "
        "batch, max(1024, batch size). Larger windows group more rows; each window is one task's work "
        "before its first row reaches an actor."))

    def prepare_window(self, batch_rows: int) -> int:
        """Rows per prepare task (the grouping window)."""
        return self.prefix_grouping_rows or max(PREPARE_ROWS, batch_rows)


class EngineConfig(EngineKwargs, GroupingFields):
    """How each replica runs the Orthrus engine, and how batches reach it."""

    batch_size: int | None = Field(None, ge=1, description=(
        "Rows handed to one actor call (Ray Data's batch, and the unit the output commits). None = sized "
        "by work: enough rows that a call carries about 1,024 new tokens at sampling.max_new_tokens -- 64 "
        "rows at 16 or more new tokens, up to 1,024 rows at 1 -- because every call has a fixed cost "
        "around the engine (a Ray task, its objects, the driver's bookkeeping) that short outputs would "
        "otherwise pay every 64 rows."))
    max_concurrent_batches: int = Field(4, ge=1, description=(
        "Batches each replica holds at once, all feeding its one streaming engine, so its slots stay "
        "busy across batch boundaries; each batch still returns on its own when its rows are done."))


class ResourcesConfig(_Section):
    """Ray resources of the generation actors."""

    replicas: int | None = Field(None, ge=1, description=(
        "Number of model replicas (actors); None = one per GPU in the cluster, or 1 without GPUs."))
    gpus_per_replica: float | None = Field(None, ge=0.0, description=(
        "GPUs per replica; None = 1 when the cluster has GPUs, 0 (CPU) otherwise. Set it explicitly "
        "on an autoscaling cluster whose GPU workers are not up yet."))
    cpus_per_replica: float = Field(1.0, gt=0.0, description=(
        "CPUs per replica; leave at least one CPU free for the read/tokenize/detokenize tasks."))


class BehaviourConfig(_Section):
    """What to do with an existing output directory, and the guards that bound a run."""

    resume: bool = Field(False, description="Continue into an existing output dir, skipping finished rows.")
    overwrite: bool = Field(False, description="Delete an existing output dir (of a previous run) first.")
    dedupe: bool = Field(False, description=(
        "With resume: first remove rows whose (id, sample_index) was committed before (left by two jobs "
        "that once wrote to the directory at the same time), keeping the first committed copy of each."))
    retry_errors: bool = Field(False, description=(
        "With resume: generate again the rows committed as errors (they move to <output>/retried/, so "
        "data/ keeps every (id, sample_index) exactly once)."))
    allow_config_change: bool = Field(False, description=(
        "With resume: accept an output directory generated with another model, sampling or prompt "
        "configuration (refused by default, naming what changed)."))
    row_timeout_s: float | None = Field(None, gt=0.0, allow_inf_nan=False, description=(
        "A row that holds its engine slot longer than this (seconds from admission) is aborted and "
        "becomes an error row saying so; its slot goes to the next row. None = no limit."))
    max_wall_seconds: float | None = Field(None, gt=0.0, allow_inf_nan=False, description=(
        "End the job cleanly after this many seconds: what was committed stays complete, the "
        "summary is written, the exit status is 1 and --resume continues. None = no limit."))

    @model_validator(mode="after")
    def _exclusive(self) -> "BehaviourConfig":
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite are mutually exclusive")
        for name in ("dedupe", "retry_errors", "allow_config_change"):
            if getattr(self, name) and not self.resume:
                raise ValueError(f"{name} applies to an existing output: it needs resume")
        return self


class AuditConfig(_Section):
    """The lossless audit: re-decode some greedy rows with plain AR and compare (``pipeline/actor/audit.py``)."""

    fraction: float = Field(0.0, ge=0.0, le=1.0, description=(
        "Fraction of greedy rows each actor re-decodes with plain AR on the same model, picked by a "
        "hash of the id (a rerun picks the same rows); the output gets audit_match and "
        "audit_first_divergence. 0 = off. Cost: the audited rows decoded once more in plain AR, and a "
        "batch holding one returns when its audit is done too."))
    max_batch_size: int = Field(4, ge=1, description=(
        "Slots of the audit engine in each actor (its KV cache is allocated for max_seq_len in each)."))


class StorageConfig(_Section):
    """How URIs in input.paths, output.path and model.path reach their store (credentials: never here)."""

    region: str | None = Field(None, description=(
        "S3 region (None: the environment's AWS_REGION/AWS_DEFAULT_REGION or the SDK's default); for "
        "gs:// the location of buckets pyarrow creates (none here)."))
    endpoint: str | None = Field(None, description=(
        "Endpoint override for S3- or GCS-compatible stores, e.g. 'http://minio.internal:9000' "
        "(the scheme, http or https, is taken from it). None: the provider's own endpoint."))
    anonymous: bool = Field(False, description="Access public buckets without credentials.")
    connect_timeout_s: float | None = Field(None, gt=0.0, description="S3 connect timeout; None: the SDK's.")
    request_timeout_s: float | None = Field(None, gt=0.0, description="S3/GCS request timeout; None: the SDK's.")
    model_cache_dir: str = Field("~/.cache/orthrus/models", min_length=1, description=(
        "Local directory where each node keeps models downloaded from object storage (one download per "
        "node and model, guarded by a file lock; reused by later jobs while the remote files are unchanged)."))


class JobConfig(_Section):
    """One generation job."""

    input: InputConfig = Field(description="Input Parquet files and column names.")
    output: OutputConfig = Field(description="Output directory.")
    model: ModelConfig = Field(description="Checkpoint to load.")
    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Prompt formatting.")
    sampling: SamplingConfig = Field(default_factory=SamplingConfig, description="Sampling defaults.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine settings.")
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Actor resources.")
    behaviour: BehaviourConfig = Field(default_factory=BehaviourConfig, description="Resume / overwrite / guards.")
    audit: AuditConfig = Field(default_factory=AuditConfig, description="Lossless audit against plain AR.")
    storage: StorageConfig = Field(default_factory=StorageConfig, description=(
        "Object-store settings for URIs (region, endpoint, anonymous access, model cache)."))

    @property
    def batch_rows(self) -> int:
        """Rows per actor call: ``engine.batch_size``, or sized by work (:data:`BATCH_TOKENS`)."""
        if self.engine.batch_size is not None:
            return self.engine.batch_size
        return max(MIN_BATCH_ROWS, min(BATCH_TOKENS // self.sampling.max_new_tokens, BATCH_TOKENS))


def describe_errors(err: ValidationError, source: str) -> str:
    """One line per problem, each starting with the dotted field path."""
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<top level>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        lines.append(f"  {where}: {msg}")
    return f"invalid config ({source}):\n" + "\n".join(lines)
