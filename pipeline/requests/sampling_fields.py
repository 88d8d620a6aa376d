"""The sampling fields: one table, and every place a row's sampling settings are read derives from it.

Per field: its name in ``orthrus.SamplingParams`` (the engine), in the processor's ``sampling_params``
(vLLM's names; also the request struct's), as the job's per-row override column, in an OpenAI batch
``body``, its Arrow type, how a value is checked, and the job config's default (``sampling.<name>``).
Derived here: the request struct (``request.py``), the job's override columns (``inputs/plan.py``),
the processor's keys (``prepare.py``), the OpenAI body keys and staged columns
(``inputs/openai_batch.py``). A new sampling field is one row of :data:`FIELDS` (and its config field).

One validation: :func:`parse` checks a value's type, :func:`build` makes the ``SamplingParams``
(whose own checks are the engine's rules). Either raises :class:`RowError` naming the field as the
row's source names it (``body.max_tokens``, ``column 'top_p'``, ``sampling_params.top_k``).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal

import pyarrow as pa

from orthrus import SamplingParams
from pipeline.requests.errors import RowError

Kind = Literal["number", "int", "strings", "ints", "structured", "bias", "bool"]


@dataclass(frozen=True)
class SamplingField:
    """One sampling setting under each source's name (None: that source does not set it)."""

    engine: str              # the ``orthrus.SamplingParams`` field
    vllm: str                # the processor's ``sampling_params`` key and the request struct's field
    column: str | None       # the job's per-row override column
    openai: str | None       # the OpenAI batch ``body`` key
    arrow: pa.DataType       # in the request struct, ``sampling_params`` and the staged OpenAI rows
    kind: Kind               # how :func:`parse` checks a value
    config: str              # ``SamplingConfig``'s field: the job's default


# A logit bias in Arrow: token id -> bias (a Parquet map column; JSON objects in OpenAI bodies).
BIAS_TYPE = pa.map_(pa.int64(), pa.float64())

FIELDS: tuple[SamplingField, ...] = (
    SamplingField("temperature", "temperature", "temperature", "temperature", pa.float64(), "number", "temperature"),
    SamplingField("top_p", "top_p", "top_p", "top_p", pa.float64(), "number", "top_p"),
    SamplingField("top_k", "top_k", "top_k", "top_k", pa.int64(), "int", "top_k"),
    SamplingField("max_new_tokens", "max_tokens", "max_new_tokens", "max_tokens", pa.int64(), "int",
                  "max_new_tokens"),
    SamplingField("min_tokens", "min_tokens", "min_tokens", "min_tokens", pa.int64(), "int", "min_tokens"),
    SamplingField("max_thinking_tokens", "max_thinking_tokens", "max_thinking_tokens", "max_thinking_tokens",
                  pa.int64(), "int", "max_thinking_tokens"),
    SamplingField("seed", "seed", "seed", "seed", pa.int64(), "int", "seed"),
    SamplingField("stop", "stop", "stop", "stop", pa.list_(pa.string()), "strings", "stop"),
    SamplingField("stop_token_ids", "stop_token_ids", None, None, pa.list_(pa.int64()), "ints", "stop_token_ids"),
    SamplingField("logprobs", "logprobs", "logprobs", "logprobs", pa.int64(), "int", "logprobs"),
    SamplingField("structured", "structured", "structured", None, pa.string(), "structured", "structured"),
    SamplingField("repetition_penalty", "repetition_penalty", "repetition_penalty", "repetition_penalty",
                  pa.float64(), "number", "repetition_penalty"),
    SamplingField("presence_penalty", "presence_penalty", "presence_penalty", "presence_penalty", pa.float64(),
                  "number", "presence_penalty"),
    SamplingField("frequency_penalty", "frequency_penalty", "frequency_penalty", "frequency_penalty", pa.float64(),
                  "number", "frequency_penalty"),
    SamplingField("min_p", "min_p", "min_p", "min_p", pa.float64(), "number", "min_p"),
    SamplingField("logit_bias", "logit_bias", "logit_bias", "logit_bias", BIAS_TYPE, "bias", "logit_bias"),
    SamplingField("ignore_eos", "ignore_eos", "ignore_eos", "ignore_eos", pa.bool_(), "bool", "ignore_eos"),
)
BY_ENGINE = {f.engine: f for f in FIELDS}
# The job's per-row override columns (consumed, never passed through).
OVERRIDE_COLUMNS: tuple[str, ...] = tuple(f.column for f in FIELDS if f.column is not None)
# The processor's ``sampling_params`` keys for plain fields (structured output has its own, ``structured.py``).
VLLM_KEYS: tuple[str, ...] = tuple(f.vllm for f in FIELDS if f.kind != "structured")
# Settings under the request struct's names (the struct adds the prompt's token ids).
SAMPLING_TYPE = pa.struct([pa.field(f.vllm, f.arrow) for f in FIELDS])
VLLM_TOP_K_OFF = -1      # vLLM's (and its OpenAI server's) "no top-k"; the engine's is 0


def as_int(what: str, value: Any) -> int:
    """``value`` as an int64, else :class:`RowError` naming ``what``. Parquet and JSON may carry
    integers as floats: 40.0 is accepted; 0.5, text and anything outside int64 are not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RowError(f"{what} must be an integer, got {value!r}"[:300])
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        raise RowError(f"{what} must be an integer, got {value!r}")
    out = int(value)
    if not -2 ** 63 <= out < 2 ** 63:
        raise RowError(f"{what} holds {value!r}, outside the 64-bit integer range")
    return out


def parse(field: SamplingField, value: Any, where: str, vllm: bool = False) -> Any:
    """A non-null value of ``field`` as the engine takes it; :class:`RowError` naming ``where``.
    ``vllm``: the source follows vLLM, whose ``top_k = -1`` means off."""
    if field.kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise RowError(f"{where} must be a number, got {value!r}"[:300])
        return float(value)
    if field.kind == "int":
        out = as_int(where, value)
        return 0 if vllm and field.engine == "top_k" and out == VLLM_TOP_K_OFF else out
    if field.kind == "strings":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, (list, tuple)) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise RowError(f"{where} must be a string or a list of strings, got {value!r}"[:300])
    if field.kind == "ints":
        if not isinstance(value, (list, tuple)):
            raise RowError(f"{where} must be a list of integers, got {value!r}"[:300])
        return tuple(as_int(where, t) for t in value)
    if field.kind == "bool":
        if not isinstance(value, bool):
            raise RowError(f"{where} must be true or false, got {value!r}"[:300])
        return value
    if field.kind == "bias":
        return _bias(value, where)
    return value      # structured: parsed by ``structured.py``, which names its own fields


def _bias(value: Any, where: str) -> tuple[tuple[int, float], ...]:
    """A logit bias as (token id, bias) pairs: an object (OpenAI's, keys are token ids as strings), a
    map column's pairs, or an object's JSON text. Ranges are the engine's checks (``build``)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"{where} must be an object of token id -> bias, got {value!r}"[:300]) from None
    try:
        pairs = list(value.items()) if isinstance(value, dict) else [tuple(p) for p in value]
        if not all(len(p) == 2 for p in pairs):
            raise TypeError
    except TypeError:
        raise RowError(f"{where} must be an object of token id -> bias, got {value!r}"[:300]) from None
    out = []
    for token, bias in pairs:
        if isinstance(token, str) and token.strip().isdigit():
            token = int(token)
        token = as_int(f"{where} key", token)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise RowError(f"{where}[{token}] must be a number, got {bias!r}"[:300])
        out.append((token, float(bias)))
    return tuple(out)


def build(settings: dict[str, Any], name: Callable[[str], str]) -> SamplingParams:
    """``SamplingParams(**settings)`` (engine names); a value the engine refuses is
    :class:`RowError` naming the field as ``name(engine field)`` calls it."""
    try:
        return SamplingParams(**settings)
    except (ValueError, TypeError) as e:
        raise named(e, name) from None


def reseed(settings: SamplingParams, seed: int | None, name: Callable[[str], str]) -> SamplingParams:
    """``settings`` with a row's own ``seed`` (only the seed is checked: the rest was when
    ``settings`` was built); a bad seed is :class:`RowError` naming it as ``name("seed")`` does."""
    try:
        return settings.with_seed(seed)
    except ValueError as e:
        raise named(e, name) from None


def named(e: Exception, name: Callable[[str], str]) -> RowError:
    """The engine's ``SamplingParams.<field> ...`` message as a :class:`RowError` under the source's name."""
    text = str(e)
    if not text.startswith("SamplingParams."):
        return RowError(text[:500])
    field, rest = text.removeprefix("SamplingParams.").split(" ", 1)
    rest = rest.replace("with structured", f"with {name('structured')}")
    return RowError(f"{name(field)} {rest}"[:500])


class Settings:
    """Built sampling settings per distinct source value, so each distinct setting is parsed, built
    and validated once per batch and each row takes it with its own seed (:func:`reseed`): rows of
    a batch job share their settings (config defaults, a few override values), and a per-row
    build was most of the prepare stage's time. A value that fails is remembered as its error.
    Bounded by the batch's distinct settings (at most its rows)."""

    def __init__(self) -> None:
        self._built: dict[Any, tuple[SamplingParams, str | None] | RowError] = {}

    def get(self, key: Any, make: Callable[[], tuple[SamplingParams, str | None]]) -> tuple[SamplingParams, str | None]:
        """``make()``'s (settings, where the constraint came from) for ``key``, built on first use;
        a :class:`RowError` it raised is raised again for the same key."""
        try:
            out = self._built[key]
        except TypeError:            # an unhashable value no freezing foresaw: build it unshared
            return make()
        except KeyError:
            try:
                out = self._built[key] = make()
            except RowError as e:
                self._built[key] = e
                raise
        if isinstance(out, RowError):
            raise RowError(str(out))
        return out


def frozen(value: Any) -> Any:
    """A hashable key for a source value: lists and dicts as tuples (dict order kept: a schema's
    property order matters), each scalar with its type (``True`` and ``1`` build differently)."""
    if isinstance(value, (list, tuple)):
        return ("list", tuple(frozen(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, frozen(v)) for k, v in value.items()))
    return (type(value).__name__, value)


def stop_with_structured(structured: str, stop: str) -> RowError:
    """The error of a row asking for a constraint (named ``structured``) and a stop (``stop``)."""
    return RowError(f"{structured} cannot be combined with {stop}: a constrained row ends where its grammar is "
                    "complete (a stop could cut it mid-record)")


def to_vllm(p: SamplingParams, structured_json: str | None) -> dict[str, Any]:
    """``p`` under the request struct's (vLLM's) names; ``structured_json``: its constraint as JSON text."""
    out = {f.vllm: getattr(p, f.engine) for f in FIELDS if f.kind != "structured"}
    out.update(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), structured=structured_json,
               logit_bias=list(p.logit_bias))
    return out
