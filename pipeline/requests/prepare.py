"""The processor's CPU stage: rows -> one request struct each (chat template, tokenization, sampling).

Rows in: ``messages`` (list of {role, content}, or that as a JSON string) or ``prompt`` (text), or
with ``tokenize=False`` ``tokenized_prompt`` (token ids); an optional ``sampling_params`` struct or
map with vLLM's names (:data:`SAMPLING_KEYS`, structured output included: ``structured``,
``guided_decoding``/``structured_outputs``, ``guided_json``/``_regex``/``_choice``/``_grammar``,
``requests/structured.py``); an optional ``error`` already set upstream (such a row is not generated
and keeps its error). Rows out: the same rows with ``__request`` (``pipeline/requests/request.py``),
``num_input_tokens``, ``seed`` and ``error``. Runs as Ray Data tasks over Arrow batches; nothing
one row holds can fail the batch: undecodable bytes, text the tokenizer or the template rejects,
bad sampling values and a constraint that does not compile all end as that row's error.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from orthrus import SamplingParams
from pipeline.config import ModelConfig, StorageConfig
from pipeline.requests.errors import ERROR, RowError, row_error
from pipeline.requests.grouping import group_rows
from pipeline.requests.prompts import ChatTemplate, InvalidText, format_prompt
from pipeline.requests.request import REQUEST, to_arrow
from pipeline.requests.request_keys import check_keys
from pipeline.requests.sampling_fields import (BY_ENGINE, FIELDS, VLLM_KEYS, Settings, as_int, build, frozen, parse,
                                              reseed, stop_with_structured)
from pipeline.requests.structured import SAMPLING_PARAMS_KEYS, STRUCTURED_FIELD, compile_error, from_sampling_params
from pipeline.schema import PROCESSOR_INPUTS
from pipeline.storage.model_files import load_tokenizer, resolve_model_dir

SAMPLING_KEYS = (*VLLM_KEYS, *SAMPLING_PARAMS_KEYS)   # the last: structured output (``structured.py``)
# Missing keys take the engine's defaults (SamplingParams): greedy, 64 new tokens, a random seed.
PREPARED = ("num_input_tokens", "seed", ERROR, REQUEST, STRUCTURED_FIELD)


@dataclass(frozen=True)
class PreparePlan:
    """What the prepare tasks need (shipped once per operator by Ray Data)."""

    model: ModelConfig
    storage: StorageConfig
    template: ChatTemplate
    tokenize: bool = True
    keep_inputs: bool = True   # False (the job): drop prompt/messages/sampling_params once they are a request
    group: bool = False        # True: the window's rows leave in prefix-grouping order (``grouping.py``)


def _as_dict(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if isinstance(value, InvalidText):
        value.raise_row_error()
    if isinstance(value, list):          # an Arrow map column reads back as [(key, value), ...]
        if not all(isinstance(p, tuple) and len(p) == 2 for p in value):
            raise RowError("sampling_params must be a struct or map, got a list")
        value = dict(value)
    if not isinstance(value, dict):
        raise RowError(f"sampling_params must be a struct or map, got {type(value).__name__}")
    check_keys(value, SAMPLING_KEYS, "sampling_params")
    return {k: v for k, v in value.items() if v is not None and k in SAMPLING_KEYS}


def sampling_params_of(value: Any) -> SamplingParams:
    """A row's ``sampling_params`` (vLLM names) as engine SamplingParams; :class:`RowError` if invalid."""
    return sampling_and_field(value)[0]


def _name(engine: str) -> str:
    return f"sampling_params.{BY_ENGINE[engine].vllm}" if engine in BY_ENGINE else f"sampling_params.{engine}"


def sampling_and_field(value: Any, settings: Settings | None = None) -> tuple[SamplingParams, str | None]:
    """:func:`sampling_params_of`, and the key its structured-output constraint came from (or None).
    ``settings``: the batch's built settings, so a value seen before is not built again."""
    d = _as_dict(value)
    seed = d.pop("seed", None)
    seed = secrets.randbits(63) if seed is None else parse(BY_ENGINE["seed"], seed, _name("seed"), vllm=True)
    # unseeded: random, like vLLM; reported in the seed column
    built, where = (settings or Settings()).get(frozen(d), lambda: _settings(d))
    return reseed(built, seed, _name), where


def _settings(d: dict[str, Any]) -> tuple[SamplingParams, str | None]:
    """``sampling_params`` (less its seed) as SamplingParams, and where its constraint came from."""
    kw = {f.engine: parse(f, d[f.vllm], _name(f.engine), vllm=True) for f in FIELDS
          if f.kind != "structured" and f.vllm in d}
    kw["structured"], where = from_sampling_params(d)
    if kw["structured"] is not None:
        which = "stop" if kw.get("stop") else "stop_token_ids" if kw.get("stop_token_ids") else None
        if which:
            raise stop_with_structured(where, f"sampling_params.{which}")
    return build(kw, lambda engine: where if engine == "structured" and where else _name(engine)), where


@dataclass(frozen=True)
class RowSampling:
    """A batch's sampling as the prepare stage takes it, row by row: the SamplingParams (None where
    the row has an error), its error (None: none so far) and the field its constraint came from
    (which a compile error names). The job builds it from its config and columns
    (``inputs/preprocess.py``), the processor from its rows' ``sampling_params``
    (:func:`read_sampling`): either way each row's SamplingParams is built once."""

    params: list[SamplingParams | None]
    errors: list[str | None]
    fields: list[str | None]


def read_sampling(batch: pa.Table) -> RowSampling:
    """The processor's rows: their ``sampling_params`` (one build per distinct value; each row with
    its own seed) and the ``error`` a user's stage may have set upstream."""
    errors = upstream_errors(batch)
    params: list[SamplingParams | None] = [None] * batch.num_rows
    fields: list[str | None] = [None] * batch.num_rows
    settings = Settings()
    for i, value in enumerate(values(batch, "sampling_params")):
        if errors[i] is not None:
            continue
        try:
            params[i], fields[i] = sampling_and_field(value, settings)
        except RowError as e:
            errors[i] = str(e)
        except Exception as e:  # noqa: BLE001 - a value of a type no check foresaw: the row's error
            errors[i] = row_error("sampling_params cannot be used", e)
    return RowSampling(params, errors, fields)


def values(batch: pa.Table, name: str) -> list:
    """A column as Python values; all None when the batch lacks it.

    Parquet readers do not validate UTF-8, so one corrupt cell would make ``to_pylist`` fail the
    whole batch; such cells become :class:`InvalidText` (their row's error) instead.
    """
    if name not in batch.column_names:
        return [None] * batch.num_rows
    col = batch[name]
    try:
        return col.to_pylist()
    except UnicodeDecodeError:
        pass
    except Exception as e:  # noqa: BLE001 - a type Python cannot hold: every row's error, never the batch's
        why = f"has type {col.type}, which cannot be read ({type(e).__name__})"
        return [InvalidText(name, why, utf8=False)] * batch.num_rows
    out = []
    for i in range(len(col)):
        try:
            out.append(col[i].as_py())
        except UnicodeDecodeError as e:
            out.append(InvalidText(name, f"byte {e.start}: {e.reason}"))
    return out


def upstream_errors(batch: pa.Table) -> list[str | None]:
    """The ``error`` column a user's own stages may have set: a row with a non-null one is not
    generated and keeps it, as text whatever its type (an int, a struct: stringified), so no
    upstream type can fail the batch."""
    out: list[str | None] = []
    for e in values(batch, ERROR):
        if e is None or isinstance(e, str):
            out.append(e)
        elif isinstance(e, InvalidText):
            out.append(e.message())
        else:
            out.append(row_error(str(e)))
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
            out.append(row_error("tokenization failed", e))
    return out


def _pretokenized(value: Any) -> list[int]:
    if isinstance(value, InvalidText) or not isinstance(value, list) or not value:
        raise RowError("tokenized_prompt must be a non-empty list of token ids (tokenize=False)")
    return [as_int("tokenized_prompt", t) for t in value]


def _tokens(batch: pa.Table, todo: list[int], plan: PreparePlan, tokenizer) -> dict[int, list[int] | str]:
    """Prompt token ids of the rows ``todo``, or each row's error message."""
    out: dict[int, list[int] | str] = {}
    if not plan.tokenize:
        ids = values(batch, "tokenized_prompt")
        for i in todo:
            try:
                out[i] = _pretokenized(ids[i])
            except RowError as e:
                out[i] = str(e)
        return out
    prompts, messages = values(batch, "prompt"), values(batch, "messages")
    texts: dict[int, str] = {}
    add_special = True
    for i in todo:
        try:
            texts[i], add_special = format_prompt(prompts[i], messages[i], plan.template, tokenizer)
        except RowError as e:
            out[i] = str(e)
        except Exception as e:  # noqa: BLE001 - nothing one row holds may fail the batch (or loop on retry)
            out[i] = row_error("formatting the prompt failed (columns 'prompt', 'messages')", e)
    if texts:
        for i, ids in zip(texts, _encode(tokenizer, list(texts.values()), add_special)):
            out[i] = ids if ids else "prompt is empty after tokenization"
    return out


def prepare_batch(batch: pa.Table, plan: PreparePlan) -> pa.Table:
    """The processor's rows -> the same rows with ``__request``, ``num_input_tokens``, ``seed`` and ``error``."""
    return prepare_rows(batch, plan, read_sampling(batch))


def prepare_rows(batch: pa.Table, plan: PreparePlan, sampling: RowSampling) -> pa.Table:
    """Rows whose sampling is already built -> the same rows with ``__request``,
    ``num_input_tokens``, ``seed`` and ``error``: constraints compiled, prompts formatted and tokenized
    (and, with ``plan.group``, reordered by prompt tokens)."""
    params, errors = sampling.params, list(sampling.errors)
    tokenizer = load_tokenizer(resolve_model_dir(plan.model, plan.storage, weights=False))
    for i, p in enumerate(params):    # a constraint that does not compile: the row's error, before an actor
        if errors[i] is None and p is not None and p.structured is not None:
            errors[i] = compile_error(tokenizer, p.structured, sampling.fields[i])
    todo = [i for i in range(batch.num_rows) if errors[i] is None]
    tokens = _tokens(batch, todo, plan, tokenizer)
    requests: list[tuple[list[int], SamplingParams] | None] = [None] * batch.num_rows
    for i in todo:
        if isinstance(tokens[i], str):
            errors[i] = tokens[i]
        else:
            requests[i] = (tokens[i], params[i])
    cols = {"num_input_tokens": pa.array([len(r[0]) if r else None for r in requests], pa.int64()),
            "seed": pa.array([p.seed if p else None for p in params], pa.int64()),
            ERROR: pa.array(errors, pa.string()), REQUEST: to_arrow(requests)}
    drop = PREPARED if plan.keep_inputs else PREPARED + PROCESSOR_INPUTS
    table = batch.drop_columns([c for c in drop if c in batch.column_names])
    for name, column in cols.items():
        table = table.append_column(name, column)
    return group_rows(table) if plan.group else table
