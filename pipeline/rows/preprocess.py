"""CPU stage: validate, expand to the pending samples (the read task chose them), format and tokenize.

Runs as a Ray Data task over Arrow batches. A row that cannot be used becomes an error row (the
``error`` column is set and it skips generation); nothing a single row holds can fail the batch:
undecodable bytes, text the tokenizer rejects and bad sampling values all end as that row's error.
Pass-through columns are cast to the inputs' unified types, so blocks from files whose schemas
differ concatenate.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from orthrus import SamplingParams
from pipeline.rows import schema as S
from pipeline.rows.column_types import convert
from pipeline.config import ModelConfig, PromptConfig, SamplingConfig, StorageConfig
from pipeline.rows.inputs import InputPlan
from pipeline.storage.model_files import load_tokenizer, resolve_model_dir
from pipeline.rows.prompts import InvalidText, RowError, format_prompt


@dataclass(frozen=True)
class PreprocessPlan:
    """Everything the preprocessing task needs (shipped once per operator by Ray Data)."""

    inputs: InputPlan
    model: ModelConfig
    prompt: PromptConfig
    sampling: SamplingConfig
    storage: StorageConfig = StorageConfig()


def derive_seed(base: int, row_id: str, sample_index: int) -> int:
    """A per-sample seed in [0, 2**63) that depends only on (base seed, id, sample index)."""
    digest = hashlib.blake2b(f"{base}\x1f{row_id}\x1f{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _as_int(name: str, value: Any) -> int:
    """Parquet may store integer overrides as floats; accept 40.0, reject 0.5 and anything outside
    int64 (a uint64 or float column can hold such values; the job's columns are int64)."""
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise RowError(f"column {name!r} must be an integer, got {value!r}")
    out = int(value)
    if not -2 ** 63 <= out < 2 ** 63:
        raise RowError(f"column {name!r} holds {value!r}, outside the 64-bit integer range")
    return out


def sampling_for(row: dict[str, Any], sample_index: int, row_id: str, cfg: SamplingConfig) -> SamplingParams:
    """The sample's SamplingParams: config defaults, overridden by the row's non-null columns."""
    def pick(name: str) -> Any:
        value = row.get(name)
        return getattr(cfg, name) if value is None else value

    row_seed = row.get("seed")
    if row_seed is None:
        seed = derive_seed(cfg.seed, row_id, sample_index)
    else:  # checked before adding the index, so all of a row's samples fail or none does
        seed = _as_int("seed", row_seed)
        if not 0 <= seed < 2 ** 63:
            raise RowError(f"column 'seed' must be an int in [0, 2**63), got {seed}")
        seed = (seed + sample_index) % 2 ** 63
    try:
        return SamplingParams(temperature=float(pick("temperature")), top_p=float(pick("top_p")),
                              top_k=_as_int("top_k", pick("top_k")),
                              max_new_tokens=_as_int("max_new_tokens", pick("max_new_tokens")),
                              seed=seed, stop_token_ids=tuple(cfg.stop_token_ids))
    except RowError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a cell holds, it is that row's error
        raise RowError(f"sampling override columns: {e}"[:500]) from None


def _row_ids(batch: pa.Table, plan: InputPlan) -> list[str]:
    if plan.id_column is not None:
        return pc.cast(batch[plan.id_column], pa.string()).to_pylist()
    return batch[S.DERIVED_ID].to_pylist()


def _expand(batch: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """(input row index, sample index) of every pending sample (the read task listed them)."""
    samples = batch[S.SAMPLES].combine_chunks()
    rows = pc.list_parent_indices(samples).to_numpy(zero_copy_only=False).astype(np.int64)
    return rows, pc.list_flatten(samples).to_numpy(zero_copy_only=False).astype(np.int64)


def _values(batch: pa.Table, name: str | None) -> list:
    """A column as Python values; all None when this batch's file lacks it (schemas may differ).

    Parquet readers do not validate UTF-8, so one corrupt cell would make ``to_pylist`` fail the
    whole batch; such cells become :class:`InvalidText` (their row's error) instead.
    """
    if name not in batch.column_names:
        return [None] * batch.num_rows
    col = batch[name]
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        out = []
        for i in range(len(col)):
            try:
                out.append(col[i].as_py())
            except UnicodeDecodeError as e:
                out.append(InvalidText(name, f"byte {e.start}: {e.reason}"))
        return out


def _encode(tokenizer, texts: list[str], add_special: bool) -> list[list[int] | str]:
    """Token ids per text; if the batch call fails, per text, so only the offending row errs."""
    try:
        return [list(ids) for ids in tokenizer(texts, add_special_tokens=add_special)["input_ids"]]
    except Exception:  # noqa: BLE001 - narrowed to rows below
        pass
    out: list[list[int] | str] = []
    for text in texts:
        try:
            out.append(list(tokenizer(text, add_special_tokens=add_special)["input_ids"]))
        except Exception as e:  # noqa: BLE001 - this row's text is the problem
            out.append(f"tokenization failed: {type(e).__name__}: {e}"[:500])
    return out


def _tokenize(batch: pa.Table, needed: np.ndarray, plan: PreprocessPlan) -> dict[int, list[int] | str]:
    """Prompt token ids per needed input row, or the row's error message."""
    tokenizer = load_tokenizer(resolve_model_dir(plan.model, plan.storage, weights=False))
    prompts = _values(batch, plan.inputs.prompt_column)
    messages = _values(batch, plan.inputs.messages_column)
    out: dict[int, list[int] | str] = {}
    texts: dict[int, str] = {}
    add_special = True
    for i in needed.tolist():
        try:
            texts[i], add_special = format_prompt(prompts[i], messages[i], plan.prompt, tokenizer)
        except RowError as e:
            out[i] = str(e)
        except Exception as e:  # noqa: BLE001 - nothing one row holds may fail the batch (or loop on retry)
            out[i] = (f"formatting the prompt failed (columns {plan.inputs.prompt_column!r}, "
                      f"{plan.inputs.messages_column!r}): {type(e).__name__}: {e}")[:500]
    if texts:
        for i, ids in zip(texts, _encode(tokenizer, list(texts.values()), add_special)):
            out[i] = ids if ids else "prompt is empty after tokenization"
    return out


def preprocess_batch(batch: pa.Table, plan: PreprocessPlan) -> pa.Table:
    """Input rows -> one row per pending (id, sample_index), tokenized or marked as an error."""
    ids = _row_ids(batch, plan.inputs)
    rows, samples = _expand(batch)
    tokens = _tokenize(batch, np.unique(rows), plan)
    overrides = {name: _values(batch, name) for name in plan.inputs.override_columns}
    cols: dict[str, list] = {k: [] for k in ("id", "sample_index", "seed", "num_prompt_tokens", "error",
                                             S.PROMPT_IDS, S.TEMPERATURE, S.TOP_P, S.TOP_K, S.MAX_NEW_TOKENS)}
    for r, s in zip(rows.tolist(), samples.tolist()):
        tok, params, error = tokens[r], None, None
        try:
            params = sampling_for({k: v[r] for k, v in overrides.items()}, s, ids[r], plan.sampling)
        except RowError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - e.g. the seed column's own checks
            error = f"sampling override columns: {type(e).__name__}: {e}"[:500]
        if isinstance(tok, str):
            error = tok
        ok = error is None
        cols["id"].append(ids[r])
        cols["sample_index"].append(s)
        cols["seed"].append(params.seed if params else None)
        cols["num_prompt_tokens"].append(len(tok) if not isinstance(tok, str) else None)
        cols["error"].append(error)
        cols[S.PROMPT_IDS].append(tok if ok else [])
        cols[S.TEMPERATURE].append(params.temperature if ok else None)
        cols[S.TOP_P].append(params.top_p if ok else None)
        cols[S.TOP_K].append(params.top_k if ok else None)
        cols[S.MAX_NEW_TOKENS].append(params.max_new_tokens if ok else None)
    take = pa.array(rows, pa.int64())
    coordinates = {S.FILE: batch[S.FILE].take(take), S.ROW: batch[S.ROW].take(take)}
    return _assemble(cols, coordinates, _passthrough(batch, plan.inputs, rows))


def _passthrough(batch: pa.Table, inputs: InputPlan, rows: np.ndarray) -> pa.Table:
    """Pass-through columns of the kept rows (the read task already gave them the inputs' unified,
    view-free types). A column this batch's file lacks stays absent (the driver fills it with
    nulls when it casts to the output schema)."""
    take = pa.array(rows, pa.int64())
    fields = [f for f in inputs.passthrough_fields if f.name in batch.column_names]
    return pa.table({f.name: convert(batch[f.name], f.type).take(take) for f in fields}, schema=pa.schema(fields))


_TYPES = {"id": pa.string(), "sample_index": pa.int64(), "seed": pa.int64(), "num_prompt_tokens": pa.int64(),
          "error": pa.string(), S.PROMPT_IDS: pa.list_(pa.int32()), S.TEMPERATURE: pa.float64(),
          S.TOP_P: pa.float64(), S.TOP_K: pa.int64(), S.MAX_NEW_TOKENS: pa.int64()}


def _assemble(cols: dict[str, list], coordinates: dict[str, pa.ChunkedArray], passthrough: pa.Table) -> pa.Table:
    table = pa.table({**{name: pa.array(values, _TYPES[name]) for name, values in cols.items()}, **coordinates})
    for field in passthrough.schema:
        table = table.append_column(field, passthrough[field.name])
    return table
