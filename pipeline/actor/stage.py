"""GPU stage: a Ray Data async callable-class actor holding one Orthrus model and one streaming engine.

The actor loads the model once and steps its engine in its own thread (``engine_loop.py``). Ray Data
hands the actor several batches at once (``engine.max_concurrent_batches``); each batch adds its
rows to the engine and awaits them, so the engine's slots stay busy across batch boundaries while a
batch still returns when its own rows are done (the batch stays the committed unit: exactly-once is
unchanged). Stop strings end rows inside the engine. Results are detokenized here
(``postprocess.py``). With ``audit.fraction`` > 0 an audit engine (plain AR, same weights) in the
same loop re-decodes the audited greedy rows while the batch decodes (``audit.py``);
``behaviour.row_timeout_s`` aborts rows that hold a slot too long (error rows). Each finished batch
updates the actor's live metrics (``metrics.py``).

Failures: the engine's request checks turn bad rows into error rows. If the engine raises while a
batch's rows are in it -- out of memory included -- the batch is retried *alone* in the engine,
then split in halves, recursively; a row that still fails alone becomes an error row with the
message. So one poison row or one group too big for the device costs a few retries, not the job,
and rows of other batches are never blamed for it. An actor *process* that dies is restarted by Ray
and its batches retried. ``faults.FaultyStage``, a test-only subclass, can simulate the out-of-memory case.
"""
from __future__ import annotations

import asyncio
import hashlib
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import pyarrow as pa

import orthrus
from orthrus import EngineStats, RequestOutput, SamplingParams
from pipeline import schema as S
from pipeline.columns import ASSEMBLED
from pipeline.requests.errors import ERROR, row_error
from pipeline.requests.request import REQUEST, Requests, read_requests
from pipeline.actor.audit import first_divergence, is_audited
from pipeline.config import AuditConfig, EngineKwargs, ModelConfig, StorageConfig
from pipeline.actor.engine_loop import AUDIT, EngineLoop, GroupFailed
from pipeline.actor.records import BATCH_RECORD, EngineSnapshot, growth, occupancy_record
from pipeline.actor.metrics import ActorMetrics
from pipeline.storage.model_files import load_tokenizer, resolve_model_dir
from pipeline.actor.postprocess import detokenize_batch
from pipeline.actor.results import result_columns

if TYPE_CHECKING:        # torch and the model load in the actor only: the job's driver imports this module too
    import torch
    from orthrus import OrthrusEngine, OrthrusForCausalLM


@dataclass(frozen=True)
class StagePlan:
    """Constructor argument of :class:`GenerationStage`."""

    model: ModelConfig
    engine: EngineKwargs
    use_gpu: bool
    audit: AuditConfig = AuditConfig()
    row_timeout_s: float | None = None
    storage: StorageConfig = StorageConfig()
    detokenize: bool = True           # False: generated_text stays null (ids only)
    batch_records: bool = False       # the job's driver reads one ``__batch`` record per batch


def _torch_dtype(name: str, device: str) -> torch.dtype:
    import torch

    if name == "auto":
        return torch.bfloat16 if device == "cuda" else torch.float32
    return getattr(torch, name)


def _actor_identity() -> tuple[str, str]:
    """('pid@node-ip', 'comma-separated Ray GPU ids'); on CPU with logical GPUs the ids still differ."""
    import ray

    if not ray.is_initialized():  # constructed outside Ray (unit tests): no GPU ids to report
        return f"{os.getpid()}@local", ""
    gpu_ids = ",".join(str(g) for g in ray.get_gpu_ids())
    return f"{os.getpid()}@{ray.util.get_node_ip_address()}", gpu_ids


class GenerationStage:
    """``map_batches`` callable class: one model replica per actor."""

    wants_row_keys = False      # a subclass acting on rows' ids (``faults.FaultyStage``) sets it

    def __init__(self, plan: StagePlan) -> None:
        constructed = time.time()     # wall clock: the driver's start-up split compares it with its own moments
        import torch

        self.plan = plan
        self.device = "cuda" if plan.use_gpu and torch.cuda.is_available() else "cpu"
        model_dir = resolve_model_dir(plan.model, plan.storage)
        model = orthrus.OrthrusForCausalLM.from_pretrained(
            model_dir, dtype=_torch_dtype(plan.engine.dtype, self.device), device=self.device)
        self.tokenizer = load_tokenizer(model_dir)   # before the engines: they detect stop strings
        self.engine = self._engine(model, plan.engine.max_batch_size, plan.engine.speculative, plan.engine.kv_cache_tokens)
        # The audit engine: plain AR on the same weights, its own (small) KV cache, same loop thread.
        audit = self._engine(model, plan.audit.max_batch_size, False) if plan.audit.fraction > 0 else None
        self.eos_ids = frozenset(self.engine.eos_token_ids)
        self.loop = EngineLoop(self.engine, audit, plan.row_timeout_s)
        self.actor, self.gpu_ids = _actor_identity()
        self.metrics = _actor_metrics(self.actor)
        self.total_tokens = 0
        self.reported = EngineStats()   # the engine's counters at the previous batch record
        self.constructed = {"start": constructed, "end": time.time()}
        print(f"[orthrus] actor {self.actor} gpu_ids=[{self.gpu_ids}] device={self.device} "
              f"model={model_dir} block_size={self.engine.block_size} slots={self.engine.max_batch_size}",
              flush=True)

    def _engine(self, model: OrthrusForCausalLM, slots: int, speculative: bool | str,
                kv_cache_tokens: int | None = None) -> OrthrusEngine:
        settings = self.plan.engine.engine_settings(max_batch_size=slots, speculative=speculative,
                                                    kv_cache_tokens=kv_cache_tokens)
        return orthrus.OrthrusEngine(model, settings, tokenizer=self.tokenizer)

    async def _before_batch(self) -> None:
        """Called as each batch arrives (the test-only ``faults.FaultyStage`` slows it down)."""

    def _before_generate(self, ids: list[str]) -> None:
        """Called right before rows go into the engine (``faults.FaultyStage`` raises out of memory)."""

    async def _generate(self, ids: list[str], prompts: list[list[int]], params: list[SamplingParams]
                        ) -> list[RequestOutput | Exception]:
        """Decode rows in the shared engine; if a step fails while they are in it, isolate them."""
        try:
            self._before_generate(ids)
            return await self.loop.run(prompts, params)
        except Exception as e:  # noqa: BLE001 - narrowed to rows below; torch.OutOfMemoryError is one
            cause = e.cause if isinstance(e, GroupFailed) else e
            print(f"[orthrus] actor {self.actor}: {type(cause).__name__} with {len(prompts)} rows of this batch in "
                  "the engine; retrying them alone", flush=True)
        return await self._isolate(ids, prompts, params)

    async def _isolate(self, ids: list[str], prompts: list[list[int]], params: list[SamplingParams]
                       ) -> list[RequestOutput | Exception]:
        """Decode rows alone in the engine; if that raises, split in halves and retry each half.

        Any exception counts, out of memory included: a group too big for the device shrinks until
        it fits, and a row that breaks the engine is narrowed down in ~log2(len) rounds and
        returned as its exception (the caller turns it into an error row). Each row's sample
        depends only on its own seed, so a retried row decodes exactly as it would have in the batch.
        """
        try:
            self._before_generate(ids)
            return await self.loop.run(prompts, params, exclusive=True)
        except Exception as e:  # noqa: BLE001 - see above
            cause = e.cause if isinstance(e, GroupFailed) else e
            if self.device == "cuda":
                import torch

                torch.cuda.empty_cache()  # give the retry the memory the failed attempt held
            if len(prompts) == 1:
                return [cause]
            print(f"[orthrus] actor {self.actor}: {type(cause).__name__} on {len(prompts)} rows; retrying as "
                  f"{len(prompts) // 2} + {len(prompts) - len(prompts) // 2}", flush=True)
        half = len(prompts) // 2
        left = await self._isolate(ids[:half], prompts[:half], params[:half])
        return left + await self._isolate(ids[half:], prompts[half:], params[half:])

    def _check(self, requests: Requests, errors: list[str | None]) -> list[int]:
        """Indices of rows to decode; the engine's request checks (column-wise over the batch's
        prompts) turn the rest into error rows."""
        todo = []
        for i, p in enumerate(requests.params):
            if errors[i] is not None or p is None:
                errors[i] = errors[i] or row_error("not generated: the row has no request")
            else:
                todo.append(i)
        if not todo:
            return todo
        prompts = requests.prompt_ids.take(pa.array(todo, pa.int64()))
        problems = self.engine.check_requests(prompts.values.to_numpy(zero_copy_only=False),
                                              prompts.offsets.to_numpy(), [requests.params[i] for i in todo])
        for i, problem in zip(todo, problems):
            if problem is not None:
                errors[i] = row_error("invalid request", problem)
        return [i for i, problem in zip(todo, problems) if problem is None]

    async def __call__(self, batch: pa.Table) -> pa.Table:
        call_start, arrival, started = time.perf_counter(), self.loop.occupancy(), time.time()
        errors = batch[ERROR].to_pylist() if ERROR in batch.column_names else [None] * batch.num_rows
        requests = read_requests(batch[REQUEST])
        todo = self._check(requests, errors)
        prompts, params = requests.prompts, requests.params
        results: list[RequestOutput | Exception | None] = [None] * batch.num_rows
        audits: dict[int, int | None] = {}      # audited row -> its first divergence (None: equal to AR)
        await self._before_batch()
        if todo:
            fraction = self.plan.audit.fraction
            ids = _row_keys(batch, requests) if self.wants_row_keys or fraction > 0 else []   # read only there
            audited = [i for i in todo if params[i].greedy and is_audited(ids[i], fraction)] if fraction > 0 else []
            out, ar = await asyncio.gather(
                self._generate([ids[i] for i in todo] if ids else [], [prompts[i] for i in todo],
                               [params[i] for i in todo]),
                self._audit([prompts[i] for i in audited], [params[i] for i in audited]))
            for i, r in zip(todo, out):
                results[i] = self._finished(r, i, errors)
            for i, r in zip(audited, ar):    # an audit that failed or timed out leaves the columns null
                if isinstance(results[i], RequestOutput) and r is not None and r.finish_reason != "abort":
                    audits[i] = first_divergence(results[i].token_ids, r.token_ids)
        seconds = time.perf_counter() - call_start
        end = self.loop.occupancy()
        # Counters since the previous batch's end (not since this one's arrival: batches overlap),
        # so this actor's batches add up to its engine's counts.
        since, self.reported = growth(end.stats, self.reported), end.stats
        table = self._assemble(batch, results, errors, params, audits, (started, seconds), (arrival, end), since)
        table = detokenize_batch(table, self.tokenizer if self.plan.detokenize else None, self.engine.reasoning)
        if self.metrics is not None:
            try:
                self.metrics.record(table, end, since)
            except Exception as e:  # noqa: BLE001 - metrics are for watching; they never fail a finished batch
                print(f"[orthrus] actor {self.actor}: could not update metrics: {type(e).__name__}: {e}", flush=True)
        self._log(batch.num_rows, sum(len(r.token_ids) for r in results if isinstance(r, RequestOutput)),
                  time.perf_counter() - call_start, end.engine_ms / 1000)
        return table

    def _finished(self, r: RequestOutput | Exception, i: int, errors: list[str | None]) -> RequestOutput | None:
        """A decoded row's result, or None with ``errors[i]`` set (a failed or timed-out row)."""
        if isinstance(r, Exception):
            errors[i] = row_error("decoding failed", r)
            return None
        if r.finish_reason == "error":   # the row's own grammar failed mid-decode; its batch-mates went on
            errors[i] = row_error("decoding failed", r.error)
            return None
        if r.finish_reason == "abort":   # only the row timeout aborts a request that reaches here
            errors[i] = row_error(f"row timeout: aborted after {r.engine_seconds:.1f} s in the engine "
                                  f"(behaviour.row_timeout_s={self.plan.row_timeout_s}) with {len(r.token_ids)} "
                                  "tokens generated")
            return None
        return r

    async def _audit(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput | None]:
        """Plain-AR re-decodes of the audited rows (None for each if the audit engine failed)."""
        if not prompts:
            return []
        try:
            return await self.loop.run(prompts, params, engine=AUDIT)
        except GroupFailed as e:    # the audit is evidence, not output: a failure loses no row
            print(f"[orthrus] actor {self.actor}: the audit of {len(prompts)} rows failed ({e}); their audit "
                  "columns stay null", flush=True)
            return [None] * len(prompts)

    def _assemble(self, batch: pa.Table, results: list, errors: list[str | None], params: list,
                  audits: dict[int, int | None], call_time: tuple[float, float],
                  occupancy: tuple[EngineSnapshot, EngineSnapshot], since: EngineStats) -> pa.Table:
        """The batch's rows with the engine's and the actor's columns of the table (``columns.ASSEMBLED``,
        in its order; the detokenizer adds the text columns)."""
        ok = [r if isinstance(r, RequestOutput) else None for r in results]
        started, call_seconds = call_time
        n = batch.num_rows
        cols = {name: pa.array(values, S.TYPES[name])
                for name, values in result_columns(ok, errors, params, self.eos_ids).items()}
        cols["batch_wall_seconds"] = pa.repeat(pa.scalar(call_seconds, pa.float64()), n)
        cols["model"] = pa.repeat(pa.scalar(self.plan.model.path, pa.string()), n)
        for name, values in (("audit_match", [audits[i] is None if i in audits else None for i in range(n)]),
                             ("audit_first_divergence", [audits.get(i) for i in range(n)])):
            cols[name] = pa.array(values, S.TYPES[name]) if audits else pa.nulls(n, S.TYPES[name])
        table = _with_columns(batch.drop_columns([c for c in (REQUEST, ERROR, S.STARTUP) if c in batch.column_names]),
                              {name: cols[name] for name in ASSEMBLED})
        if not self.plan.batch_records:
            return table
        record = {"actor": self.actor, "gpu_ids": self.gpu_ids, "call_id": uuid.uuid4().hex, "rows": n,
                  "tokens": sum(len(r.token_ids) for r in ok if r), "seconds": call_seconds, "started": started,
                  "occupancy": occupancy_record(*occupancy), "since": asdict(since),
                  "kv_pages": None if occupancy[1].kv is None else asdict(occupancy[1].kv),
                  "constructed": self.constructed, "input": _input_times(batch)}
        # One record per batch, on its first row: the driver reads the few non-null ones.
        return table.append_column(pa.field(S.BATCH, BATCH_RECORD),
                                   pa.array(([record] + [None] * (n - 1)) if n else [], BATCH_RECORD))

    def _log(self, rows: int, tokens: int, seconds: float, engine_seconds: float) -> None:
        """Per-actor throughput, visible in the driver's log while the job runs (the actor total is
        over the engine's busy time: batches overlap, so their wall times do not add up)."""
        self.total_tokens += tokens
        print(f"[orthrus] actor {self.actor} gpu_ids=[{self.gpu_ids}]: batch of {rows} rows, {tokens} tokens in "
              f"{seconds:.2f}s (actor total {self.total_tokens} tokens, "
              f"{self.total_tokens / max(engine_seconds, 1e-9):.1f} tok/s of engine time)", flush=True)


def _with_columns(table: pa.Table, columns: dict[str, pa.Array]) -> pa.Table:
    """``table`` plus ``columns``, built once (one ``append_column`` each would copy the table's
    column list and schema every time)."""
    schema = pa.schema([*table.schema, *(pa.field(name, a.type) for name, a in columns.items())],
                       metadata=table.schema.metadata)
    return pa.Table.from_arrays([*table.columns, *columns.values()], schema=schema)


def _input_times(batch: pa.Table) -> dict | None:
    """The earliest-prepared input times the batch's rows carry (``schema.STARTUP``), or None."""
    if S.STARTUP not in batch.column_names:
        return None
    found = [r for r in batch[S.STARTUP].drop_null().to_pylist() if r["prepare_end"] is not None]
    return min(found, key=lambda r: r["prepare_end"]) if found else None


def _row_keys(batch: pa.Table, requests: Requests) -> list[str]:
    """A stable key per row (audit selection, fault tests): its ``id``, or without one (a user's
    dataset) a digest of its request, so a rerun audits the same rows."""
    if "id" in batch.column_names:
        return [str(i) for i in batch["id"].to_pylist()]
    return [hashlib.blake2b(repr(None if p is None else (ids, p)).encode(), digest_size=8).hexdigest()
            for ids, p in zip(requests.prompts, requests.params)]


def _actor_metrics(actor: str) -> ActorMetrics | None:
    """Live metrics through Ray's metrics API; None when the stage runs outside Ray (unit tests)."""
    import ray

    return ActorMetrics(actor) if ray.is_initialized() else None
