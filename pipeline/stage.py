"""GPU stage: a Ray Data callable-class actor holding one Orthrus model and engine.

The actor loads the model once, then decodes each batch it is handed with the engine's continuous
batching and detokenizes the result (``postprocess.py``). Per-row failures (the engine's request
checks, or an exception while decoding one row) become error rows. Resource exhaustion is not a
row's fault: it propagates and stops the job (rerun with --resume after lowering
engine.max_batch_size). An actor *process* that dies is restarted by Ray and its batch retried.
"""
from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass

import pyarrow as pa
import torch

from orthrus import GenerationResult, OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline import schema as S
from pipeline.config import EngineConfig, ModelConfig, SamplingConfig
from pipeline.model_files import load_tokenizer, resolve_model_dir
from pipeline.postprocess import detokenize_batch

_FATAL = (MemoryError, torch.OutOfMemoryError)  # not a row's fault: never turned into error rows
_DROP = [S.PROMPT_IDS, S.TEMPERATURE, S.TOP_P, S.TOP_K, S.MAX_NEW_TOKENS, "error", "seed"]


@dataclass(frozen=True)
class StagePlan:
    """Constructor argument of :class:`GenerationStage`."""

    model: ModelConfig
    engine: EngineConfig
    sampling: SamplingConfig
    use_gpu: bool


def _torch_dtype(name: str, device: str) -> torch.dtype:
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

    def __init__(self, plan: StagePlan) -> None:
        self.plan = plan
        self.device = "cuda" if plan.use_gpu and torch.cuda.is_available() else "cpu"
        model_dir = resolve_model_dir(plan.model)
        model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=_torch_dtype(plan.engine.dtype, self.device),
                                                   device=self.device)
        self.engine = OrthrusEngine(model, max_batch_size=plan.engine.max_batch_size,
                                    block_size=plan.engine.block_size, max_seq_len=plan.engine.max_seq_len)
        self.stop_ids = set(self.engine.eos_token_ids) | set(plan.sampling.stop_token_ids)
        self.tokenizer = load_tokenizer(model_dir)
        self.actor, self.gpu_ids = _actor_identity()
        self.total_tokens, self.total_seconds = 0, 0.0
        print(f"[orthrus] actor {self.actor} gpu_ids=[{self.gpu_ids}] device={self.device} "
              f"model={model_dir} block_size={self.engine.block_size} slots={self.engine.max_batch_size}",
              flush=True)

    def _params(self, batch: pa.Table) -> list[SamplingParams | None]:
        cols = {name: batch[name].to_pylist() for name in
                (S.TEMPERATURE, S.TOP_P, S.TOP_K, S.MAX_NEW_TOKENS, "seed", "error")}
        stop = tuple(self.plan.sampling.stop_token_ids)
        return [None if cols["error"][i] is not None else
                SamplingParams(temperature=cols[S.TEMPERATURE][i], top_p=cols[S.TOP_P][i], top_k=cols[S.TOP_K][i],
                               max_new_tokens=cols[S.MAX_NEW_TOKENS][i], seed=cols["seed"][i], stop_token_ids=stop)
                for i in range(batch.num_rows)]

    def _generate(self, prompts: list[list[int]], params: list[SamplingParams]
                  ) -> tuple[list[GenerationResult | Exception], list[float]]:
        """Decode all rows together; if that fails, decode one by one to isolate the bad rows."""
        start = time.perf_counter()
        try:
            results = self.engine.generate(prompts, params, speculative=self.plan.engine.speculative)
            return list(results), [time.perf_counter() - start] * len(prompts)
        except _FATAL:
            raise
        except Exception as e:  # noqa: BLE001 - any engine error is narrowed to rows below
            if len(prompts) == 1:
                return [e], [time.perf_counter() - start]
        pairs = [self._generate([p], [sp]) for p, sp in zip(prompts, params)]
        return [r[0][0] for r in pairs], [r[1][0] for r in pairs]

    def _check(self, prompts: list[list[int]], params: list[SamplingParams | None],
               errors: list[str | None]) -> list[int]:
        """Indices of rows to decode; the engine's request check turns the rest into error rows."""
        todo = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if errors[i] is not None:
                continue
            try:
                self.engine.check_request(prompt, p)
                todo.append(i)
            except ValueError as e:
                errors[i] = f"invalid request: {e}"
        return todo

    def __call__(self, batch: pa.Table) -> pa.Table:
        call_start = time.perf_counter()
        errors = batch["error"].to_pylist()
        prompts = batch[S.PROMPT_IDS].to_pylist()
        params = self._params(batch)
        todo = self._check(prompts, params, errors)
        results: list[GenerationResult | Exception | None] = [None] * batch.num_rows
        seconds: list[float | None] = [None] * batch.num_rows
        if todo:
            out, secs = self._generate([prompts[i] for i in todo], [params[i] for i in todo])
            for i, r, s in zip(todo, out, secs):
                results[i], seconds[i] = r, s
                if isinstance(r, Exception):
                    errors[i] = f"decoding failed: {type(r).__name__}: {r}"
        table = self._assemble(batch, results, seconds, errors, params, time.perf_counter() - call_start)
        table = detokenize_batch(table, self.tokenizer, tuple(self.plan.sampling.stop))
        self._log(batch.num_rows, sum(len(r.token_ids) for r in results if isinstance(r, GenerationResult)),
                  time.perf_counter() - call_start)
        return table

    def _text_ids(self, r: GenerationResult) -> list[int]:
        """Generated ids minus the stop token that ended the row (it is not part of the text)."""
        ids = list(r.token_ids)
        if r.finish_reason == "stop" and ids and ids[-1] in self.stop_ids:
            ids.pop()
        return ids

    def _assemble(self, batch: pa.Table, results: list, seconds: list, errors: list[str | None],
                  params: list[SamplingParams | None], call_seconds: float) -> pa.Table:
        ok = [r if isinstance(r, GenerationResult) else None for r in results]
        stat = lambda name: [getattr(r.stats, name) if r else None for r in ok]  # noqa: E731
        n = batch.num_rows
        cols = {
            "finish_reason": (pa.string(), [r.finish_reason if r else "error" for r in ok]),
            "error": (pa.string(), [None if r else (e or "not decoded") for r, e in zip(ok, errors)]),
            "num_completion_tokens": (pa.int64(), [len(r.token_ids) if r else None for r in ok]),
            "num_cycles": (pa.int64(), stat("num_cycles")),
            "num_forward_passes": (pa.int64(), stat("num_forward_passes")),
            "num_draft_tokens": (pa.int64(), stat("num_draft_tokens")),
            "num_accepted_draft_tokens": (pa.int64(), stat("num_accepted_draft_tokens")),
            "tokens_per_cycle": (pa.float64(), [float(r.stats.tokens_per_cycle) if r else None for r in ok]),
            "accept_length_histogram": (pa.list_(pa.int64()), [list(r.stats.accept_length_histogram) if r else None
                                                               for r in ok]),
            "decode_seconds": (pa.float64(), [s if r else None for r, s in zip(ok, seconds)]),
            "seed": (pa.int64(), [p.seed if p else s for p, s in zip(params, batch["seed"].to_pylist())]),
            "model": (pa.string(), [self.plan.model.path] * n),
            S.TEXT_IDS: (pa.list_(pa.int32()), [self._text_ids(r) if r else None for r in ok]),
            S.ACTOR: (pa.string(), [self.actor] * n),
            S.GPU_IDS: (pa.string(), [self.gpu_ids] * n),
            S.CALL_ID: (pa.string(), [uuid.uuid4().hex] * n),
            S.CALL_SECONDS: (pa.float64(), [call_seconds] * n),
        }
        table = batch.drop_columns(_DROP)
        for name, (typ, values) in cols.items():
            table = table.append_column(pa.field(name, typ), pa.array(values, typ))
        return table

    def _log(self, rows: int, tokens: int, seconds: float) -> None:
        """Per-actor throughput, visible in the driver's log while the job runs."""
        self.total_tokens += tokens
        self.total_seconds += seconds
        print(f"[orthrus] actor {self.actor} gpu_ids=[{self.gpu_ids}]: {rows} rows, {tokens} tokens in "
              f"{seconds:.2f}s = {tokens / max(seconds, 1e-9):.1f} tok/s (actor total {self.total_tokens} "
              f"tokens, {self.total_tokens / max(self.total_seconds, 1e-9):.1f} tok/s)", flush=True)
