"""OpenAI Batch API request lines as rows of one fixed schema.

Each line is ``{"custom_id", "method": "POST", "url", "body": {...}}``. ``url`` says what ``body``
is: ``/v1/chat/completions`` (``body.messages``) or ``/v1/completions`` (``body.prompt``). The
row's id is ``custom_id``; body's sampling fields become the per-row override columns
(``requests/sampling_fields.py``) under this job's names, and ``response_format`` (or vLLM's
``guided_*`` extras) the row's structured-output constraint, staged with the field it came from
(``requests/structured.py``; whether it compiles is checked with the tokenizer, in the prepare stage,
and reported naming that field). Keys this job does not read follow ``request_keys.py``'s one rule:
bookkeeping (``model``, ``user``, ``metadata`` ...) is ignored, an option we do not implement is
accepted only at its default, anything else is the row's error naming ``body.<key>``. A line
that breaks a rule becomes an error row (id and ``INPUT_ERROR`` only) naming its line; the
preprocessing turns that into the row's error.
"""
from __future__ import annotations

import json
import posixpath
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.fs as pafs

from pipeline.inputs.plan import INPUT_ERROR
from pipeline.inputs.json_lines import Tally, kind, parsed_chunks
from pipeline.requests.errors import RowError
from pipeline.requests.request_keys import check_keys
from pipeline.requests.sampling_fields import BY_ENGINE, FIELDS, SamplingField, build, parse, stop_with_structured
from pipeline.requests.structured import (GUIDED_KEYS, OFF, STAGED_STRUCTURED, STRUCTURED_FIELD, VLLM_KINDS, Off,
                                      constraint_json, parse_spec)

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
URL_COLUMN = "openai_url"       # passed through, so the output can be rendered back per endpoint
# The body's sampling fields (``sampling_fields.FIELDS`` with an OpenAI key), staged under the job's column names.
_BODY = tuple(f for f in FIELDS if f.openai is not None and f.column is not None)
SCHEMA = pa.schema([
    pa.field("id", pa.string()), pa.field("messages", pa.string()), pa.field("prompt", pa.string()),
    pa.field(URL_COLUMN, pa.string()), *(pa.field(f.column, f.arrow) for f in _BODY),
    pa.field(STAGED_STRUCTURED, pa.string()), pa.field(STRUCTURED_FIELD, pa.string()),
    pa.field(INPUT_ERROR, pa.string()),
])
# Body keys this job reads (the prompt's key by url); the rest follow ``request_keys``' one rule.
BODY_KEYS = (*(f.openai for f in _BODY), "max_completion_tokens", "top_logprobs", "n", "response_format",
             "reasoning_effort", *GUIDED_KEYS)
# OpenAI's ``reasoning_effort`` as a thinking budget (``max_thinking_tokens``, which wins when both are
# given): "none" closes the think block at once; the others are budgets in tokens.
REASONING_EFFORT = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": 16384}
_PART_SEPARATOR = "\n"          # text parts of one message joined as vLLM's OpenAI server joins them


class _Bad(ValueError):
    """What is wrong with one request line."""


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _key(body: dict, f: SamplingField) -> str:
    """The body key a field was read from (OpenAI's newer names win where both are given)."""
    if f.engine == "max_new_tokens" and body.get("max_completion_tokens") is not None:
        return "max_completion_tokens"
    return f.openai


def _effort(value: Any) -> int:
    """``body.reasoning_effort`` → its thinking budget (``REASONING_EFFORT``)."""
    if value not in REASONING_EFFORT:
        raise _Bad(f"body.reasoning_effort must be one of {', '.join(REASONING_EFFORT)}, got {_show(value)}")
    return REASONING_EFFORT[value]


def _chat_logprobs(body: dict) -> Any:
    """Chat's ``logprobs: true`` + ``top_logprobs: k`` as this job's one ``logprobs`` count."""
    wanted = body.get("logprobs")
    if wanted is None or wanted is False:
        return None            # top_logprobs alone asks for nothing (OpenAI refuses it)
    if wanted is not True:
        raise _Bad(f"body.logprobs must be true or false for {CHAT}, got {_show(wanted)}")
    top = body.get("top_logprobs")
    return 0 if top is None else top


def _sampling(body: dict, chat: bool) -> dict[str, Any]:
    """Body's sampling fields under the job's override column names (null: the config's default),
    each checked now by the one validation (``sampling_fields``), so a bad one names the body's key."""
    n = body.get("n")
    if n is not None and n != 1:
        raise _Bad("body.n must be 1 (n > 1 per request is not supported; set sampling.n)" if isinstance(n, int) and n > 1
                   else f"body.n must be 1, got {_show(n)}")

    def name(engine: str) -> str:
        f = BY_ENGINE.get(engine)
        if f is None or f.openai is None:
            return engine
        if engine == "logprobs" and chat and body.get("top_logprobs") is not None:
            return "body.top_logprobs"
        return f"body.{_key(body, f)}"

    raw = {f.engine: (_chat_logprobs(body) if chat and f.engine == "logprobs" else body.get(_key(body, f)))
           for f in _BODY}
    if raw["max_thinking_tokens"] is None and body.get("reasoning_effort") is not None:
        raw["max_thinking_tokens"] = _effort(body["reasoning_effort"])
    try:
        given = {e: parse(BY_ENGINE[e], v, name(e), vllm=True) for e, v in raw.items() if v is not None}
        check = {k: v for k, v in given.items() if k != "stop"}
        if "min_tokens" in check:    # without max_tokens the job's default decides; checked against it later
            check.setdefault("max_new_tokens", max(1, check["min_tokens"]))
        build(check, name)           # the engine's rules, now
    except RowError as e:
        raise _Bad(str(e)) from None
    return {f.column: (list(given[f.engine]) if f.kind == "strings" else given[f.engine])
            if f.engine in given else None for f in _BODY}


def _response_format(value: Any) -> tuple[dict[str, Any] | Off, str]:
    """OpenAI's ``response_format`` → ({kind: value} or OFF for plain text, the field it names)."""
    where = "body.response_format"
    kind_ = value.get("type") if isinstance(value, dict) else None
    if kind_ == "text":
        return OFF, where
    if kind_ == "json_object":            # any JSON object
        return {"json_schema": {"type": "object"}}, where
    if kind_ != "json_schema":
        raise _Bad(f"{where}.type must be 'text', 'json_object' or 'json_schema', got {_show(kind_)}"
                   if isinstance(value, dict) else f"{where} must be an object, got {kind(value)}")
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _Bad(f"{where}.json_schema must be an object with a 'schema', got {_show(spec)}")
    if "schema" not in spec:              # name, description and strict need nothing: always strict here
        raise _Bad(f"{where}.json_schema.schema is missing")
    return {"json_schema": spec["schema"]}, f"{where}.json_schema.schema"


def _structured(body: dict) -> dict[str, Any]:
    """``response_format`` or vLLM's ``guided_*`` extras as the staged constraint (JSON text, "null"
    for plain text) and the field a later error names; one way at most."""
    given = [k for k in ("response_format", *GUIDED_KEYS) if body.get(k) is not None]
    if not given:
        return {}
    asked = [(k, _response_format(body[k]) if k == "response_format" else
              ({VLLM_KINDS[k.removeprefix("guided_")]: body[k]}, f"body.{k}")) for k in given]
    asked = [a for a in asked if not isinstance(a[1][0], Off)] or asked[:1]   # vLLM: type text + guided_* is fine
    if len(asked) > 1:
        raise _Bad(f"body.{asked[0][0]} and body.{asked[1][0]} both ask for structured output; give one")
    spec, where = asked[0][1]
    if not isinstance(spec, Off) and body.get("stop"):
        raise _Bad(str(stop_with_structured(where, "body.stop")))
    try:   # the shape now; whether it compiles, in the prepare stage (it has the tokenizer)
        c = spec if isinstance(spec, Off) else parse_spec(spec, where)   # JSON is exact: nothing to prune
    except RowError as e:
        raise _Bad(str(e)) from None
    return {STAGED_STRUCTURED: constraint_json(c), STRUCTURED_FIELD: where}


def _text(content: list, index: int) -> str:
    """OpenAI content parts ``[{"type": "text", "text": ...}, ...]`` as one string."""
    texts = []
    for j, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            what = part.get("type") if isinstance(part, dict) else kind(part)
            raise _Bad(f"body.messages[{index}].content[{j}] is a {what!r} part; only text parts are supported")
        texts.append(part["text"])
    return _PART_SEPARATOR.join(texts)


def _messages(value: Any) -> str:
    """``body.messages`` as the JSON text of a list of messages with string content."""
    if not isinstance(value, list) or not value:
        raise _Bad(f"body.messages must be a non-empty list of messages, got {_show(value)}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise _Bad(f"body.messages[{i}] must be an object, got {kind(message)}")
        content = message.get("content")
        out.append({**message, "content": _text(content, i)} if isinstance(content, list) else message)
    return json.dumps(out, ensure_ascii=False)


def _request(obj: dict) -> dict[str, Any]:
    """A well-formed request's columns (all but id); raises :class:`_Bad` naming the first problem."""
    if obj.get("method") != "POST":
        raise _Bad(f"method must be 'POST', got {_show(obj.get('method'))}")
    url, body = obj.get("url"), obj.get("body")
    if url not in (CHAT, COMPLETIONS):
        raise _Bad(f"url must be {CHAT!r} or {COMPLETIONS!r}, got {_show(url)}")
    if not isinstance(body, dict):
        raise _Bad(f"body must be an object, not {kind(body)}")
    try:
        check_keys(body, (*BODY_KEYS, "messages" if url == CHAT else "prompt"), "body")
    except RowError as e:
        raise _Bad(str(e)) from None
    row = {URL_COLUMN: url, **_sampling(body, chat=url == CHAT), **_structured(body)}
    if url == CHAT:
        row["messages"] = _messages(body.get("messages"))
    elif isinstance(body.get("prompt"), str):
        row["prompt"] = body["prompt"]
    else:
        raise _Bad(f"body.prompt must be a string (a list of prompts or token ids is not supported), "
                   f"got {_show(body.get('prompt'))}")
    return row


def request_row(obj: dict | None, error: str | None, number: int, name: str) -> tuple[dict[str, Any], bool]:
    """One parsed line → (its row, whether its id is made up as '<file name>:<line>')."""
    custom_id = None if obj is None else obj.get("custom_id")
    good_id = isinstance(custom_id, str) and custom_id != ""
    row_id = custom_id if good_id else f"{name}:{number}"
    if obj is None:
        return {"id": row_id, INPUT_ERROR: error}, True
    try:
        if not good_id:
            raise _Bad("custom_id must be a non-empty string" if "custom_id" in obj else "custom_id is missing")
        return {"id": row_id, **_request(obj)}, False
    except _Bad as e:
        return {"id": row_id, INPUT_ERROR: f"line {number} of {name}: {e}"}, not good_id


def openai_tables(path: str, fs: pafs.FileSystem | None, tally: Tally) -> tuple[pa.Schema, Iterator[pa.Table]]:
    """An OpenAI batch file as (:data:`SCHEMA`, its tables of up to ``json_lines.ROW_GROUP`` rows)."""
    name = posixpath.basename(path)

    def tables() -> Iterator[pa.Table]:
        """Lazily, so the caller writes each chunk before the next is read."""
        for chunk in parsed_chunks(path, fs, name):
            rows = []
            for number, obj, error in chunk:
                row, synthetic = request_row(obj, error, number, name)
                tally.synthetic |= synthetic
                rows.append(row)
            tally.rows += len(rows)
            yield pa.Table.from_pylist(rows, schema=SCHEMA)

    return SCHEMA, tables()
