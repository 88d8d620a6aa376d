"""Render the committed parts as JSONL (``output.format``): ``results.jsonl`` and, for
``openai_batch``, ``errors.jsonl`` at the top of the output directory.

``data/`` stays the exactly-once ledger; these files are a view of it, rendered again whenever it
changes (after the last commit, a resume, --retry-errors or --dedupe). One Ray task (inline without
Ray) reads the parts in name order, one part at a time, and streams the lines into the store's sink;
each file becomes visible whole (temp + rename locally, one PUT on an object store), so a reader
sees the previous rendering or the new one, never half of one.

- ``jsonl``: one object per output row, every column (non-finite floats as null).
- ``openai_batch``: one line per row in the OpenAI Batch output format; rows with
  ``finish_reason == "error"`` go to ``errors.jsonl``. Ids are hashes of (id, sample_index), so two
  renderings of the same rows are identical but for ``created`` (the export's time).
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import math
import time

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.config import ConfigError
from pipeline.output.directory import ERRORS_JSONL, RESULTS_JSONL, OutputDir
from pipeline.tasks import map_tasks  # the shared task runner (Ray tasks, or inline without Ray)
from pipeline.storage.uris import STORE_ERRORS

JSONL, OPENAI_BATCH, PARQUET = "jsonl", "openai_batch", "parquet"
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
GENERATED_IDS = "generated_token_ids"   # optional output column: the row's generated token ids
UNLIKELY = -9999.0                      # OpenAI's logprob for "practically impossible" (JSON has no -inf)
BATCH_ROWS = 4096                       # rows turned into Python objects at a time, within one part

# What an openai_batch line needs; the optional ones may be missing from older parts.
_OPENAI_COLUMNS = ("id", "sample_index", "completion", "finish_reason", "error", "num_prompt_tokens",
                   "num_completion_tokens", "token_logprobs", "top_logprobs", "model", "openai_url",
                   GENERATED_IDS, "reasoning", "num_reasoning_tokens")


def check_openai_batch_n(n: int) -> None:
    """Preflight: the OpenAI Batch output has one line per custom_id, so one sample per id."""
    if n > 1:
        raise ConfigError(f"output.format 'openai_batch' writes one result line per custom_id, but sampling.n = "
                          f"{n} gives every id {n} samples; set sampling.n to 1, or choose output.format "
                          "'jsonl' or 'parquet'")


# ---------------------------------------------------------------- values

def _swap_float32(t: pa.DataType, to: pa.DataType) -> pa.DataType:
    """``t`` with every float32 (at any depth of lists and structs) replaced by ``to``."""
    if t == pa.float32():
        return to
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        field = t.value_field.with_type(_swap_float32(t.value_type, to))
        return pa.list_(field) if pa.types.is_list(t) else pa.large_list(field)
    if pa.types.is_struct(t):
        return pa.struct([f.with_type(_swap_float32(f.type, to)) for f in t])
    return t


def shortest_floats(table: pa.Table) -> pa.Table:
    """float32 values (logprobs) as the float64 of their shortest decimal form: a float32 read as a
    double prints 17 digits ("-0.10000000149011612" for -0.1); through a string cast it prints as few
    as round-trip ("-0.1"), and reading it back as float32 gives the same value."""
    for i, field in enumerate(table.schema):
        wide = _swap_float32(field.type, pa.float64())
        if wide != field.type:
            col = table.column(i).cast(_swap_float32(field.type, pa.string())).cast(wide)
            table = table.set_column(i, field.with_type(wide), col)
    return table


def _finite(value):
    """``value`` with NaN and infinities as None (JSON has no such numbers)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _json_default(value):
    """Pass-through column types JSON lacks: times as ISO 8601, durations in seconds, bytes as
    base64; anything else (decimals: exact) as its string."""
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode()
    return str(value)


def dumps(obj) -> str:
    """One JSON line. The walk that nulls non-finite floats runs only for the rare object that has one."""
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_json_default)
    except ValueError:
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, default=_json_default)


def _logprob(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else UNLIKELY


def _hex(kind: str, row: dict, digits: int) -> str:
    """A hex id that depends only on the row's key (and what it names), so re-exports agree."""
    key = json.dumps([kind, row["id"], row.get("sample_index")], ensure_ascii=False)
    return hashlib.sha256(key.encode()).hexdigest()[:digits]


# ---------------------------------------------------------------- tokens

def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in character for each byte → the byte: printable Latin-1
    bytes stand for themselves, the others for 256, 257, ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    for extra, b in enumerate(b for b in range(256) if b not in chars):
        chars[b] = chr(256 + extra)
    return {c: b for b, c in chars.items()}


class TokenText:
    """Token id → (text, UTF-8 bytes), decoded once per id.

    The bytes are the token's own: for a byte-level BPE token that holds part of a character the
    text is "\\ufffd", but the bytes are the real ones, so consecutive tokens' bytes join into the
    character (what OpenAI's ``bytes`` field is for)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, list[int]]] = {}
        self.alphabet = _byte_level_alphabet()

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self.cache.get(token_id)
        if hit is None:
            # No clean-up: it would rewrite a lone token such as " ." into ".".
            text = self.tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
            hit = self.cache[token_id] = (text, self._bytes(token_id, text))
        return hit

    def _bytes(self, token_id: int, text: str) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and piece and all(c in self.alphabet for c in piece):
            raw = bytes(self.alphabet[c] for c in piece)
            # The same text both ways: a byte-level token (not, say, a SentencePiece "▁word").
            if raw.decode("utf-8", errors="replace") == text:
                return list(raw)
        return list(text.encode("utf-8"))


# ---------------------------------------------------------------- lines

def jsonl_lines(batch: pa.RecordBatch | pa.Table) -> list[str]:
    """One JSON object per row, every column."""
    return [dumps(row) for row in batch.to_pylist()]


def _positions(row: dict, tokens: TokenText | None) -> list[tuple]:
    """Per generated position: (token text or None, its bytes or None, logprob, [(text, bytes, logprob)])."""
    if tokens is None:
        raise ValueError(f"row {row['id']!r} has token_logprobs: rendering them as openai_batch needs the "
                         "tokenizer (the model)")
    ids, tops = row.get(GENERATED_IDS) or [], row.get("top_logprobs") or []
    out = []
    for i, lp in enumerate(row["token_logprobs"]):
        # The generated token itself is known only from generated_token_ids; never guessed.
        text, raw = tokens(ids[i]) if i < len(ids) and ids[i] is not None else (None, None)
        alts = [(*tokens(c["id"]), _logprob(c["logprob"])) for c in (tops[i] if i < len(tops) else None) or []]
        out.append((text, raw, _logprob(lp), alts))
    return out


def chat_logprobs(row: dict, tokens: TokenText | None) -> dict | None:
    """``choices[0].logprobs`` of a chat completion (None when the row has no logprobs)."""
    if row.get("token_logprobs") is None:
        return None
    return {"content": [{"token": text, "logprob": lp, "bytes": raw,
                         "top_logprobs": [{"token": t, "logprob": l, "bytes": b} for t, b, l in alts]}
                        for text, raw, lp, alts in _positions(row, tokens)]}


def text_logprobs(row: dict, tokens: TokenText | None) -> dict | None:
    """``choices[0].logprobs`` of a text completion: offsets count characters of the completion's
    token texts (null where the generated tokens are not known)."""
    if row.get("token_logprobs") is None:
        return None
    positions = _positions(row, tokens)
    offsets, at = [], 0
    for text, *_ in positions:
        offsets.append(None if text is None else at)
        at += len(text or "")
    tops = None
    if row.get("top_logprobs") is not None:
        # Two ids may decode to the same text: the first (most likely) one keeps the key.
        tops = [{} for _ in positions]
        for top, (*_, alts) in zip(tops, positions):
            for t, _, lp in alts:
                top.setdefault(t, lp)
    return {"tokens": [p[0] for p in positions], "token_logprobs": [p[2] for p in positions],
            "top_logprobs": tops, "text_offset": offsets}


def completion_body(row: dict, tokens: TokenText | None, created: int) -> dict:
    """The response body: a chat completion, or a text completion for ``/v1/completions`` rows."""
    prompt, generated = row.get("num_prompt_tokens") or 0, row.get("num_completion_tokens") or 0
    usage = {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated}
    if row.get("num_reasoning_tokens") is not None:       # a reasoning row (vLLM's and OpenAI's fields)
        usage["completion_tokens_details"] = {"reasoning_tokens": row["num_reasoning_tokens"]}
    if (row.get("openai_url") or CHAT_URL) == COMPLETIONS_URL:
        choice = {"index": 0, "text": row["completion"], "logprobs": text_logprobs(row, tokens),
                  "finish_reason": row["finish_reason"]}
        return {"id": "cmpl-" + _hex("completion", row, 24), "object": "text_completion", "created": created,
                "model": row.get("model"), "choices": [choice], "usage": usage}
    message = {"role": "assistant", "content": row["completion"]}
    if row.get("reasoning") is not None:
        message["reasoning_content"] = row["reasoning"]
    choice = {"index": 0, "message": message,
              "logprobs": chat_logprobs(row, tokens), "finish_reason": row["finish_reason"]}
    return {"id": "chatcmpl-" + _hex("completion", row, 24), "object": "chat.completion", "created": created,
            "model": row.get("model"), "choices": [choice], "usage": usage}


def openai_line(row: dict, tokens: TokenText | None, created: int) -> tuple[bool, str]:
    """(is it an error line, the line) of one output row."""
    head = {"id": "batch_req_" + _hex("batch_req", row, 24), "custom_id": row["id"]}
    if row.get("finish_reason") == "error":
        message = row.get("error") or "generation failed (no message recorded)"
        return True, dumps({**head, "response": None, "error": {"code": "row_error", "message": message}})
    response = {"status_code": 200, "request_id": _hex("request", row, 32),
                "body": completion_body(row, tokens, created)}
    return False, dumps({**head, "response": response, "error": None})


def openai_lines(batch: pa.RecordBatch | pa.Table, tokens: TokenText | None,
                 created: int) -> tuple[list[str], list[str]]:
    """(results lines, errors lines) of ``batch``, in row order."""
    results, errors = [], []
    for row in batch.to_pylist():
        failed, line = openai_line(row, tokens, created)
        (errors if failed else results).append(line)
    return results, errors


# ---------------------------------------------------------------- files

class _AtomicFile:
    """A top-level file streamed into the store's sink and made visible whole by :meth:`finish`."""

    def __init__(self, out: OutputDir, name: str) -> None:
        self.out, self.name, self.dest, self.lines = out, name, out.store.path(name), 0
        if out.store.local:
            out.store.tmp.mkdir(parents=True, exist_ok=True)   # an export outside a run may find no _tmp
        try:
            self.stream, self.tmp = out.store.sink(self.dest)
        except STORE_ERRORS as e:
            raise out.failed(name, e) from e

    def write(self, lines: list[str]) -> None:
        if not lines:
            return
        try:
            self.stream.write(("\n".join(lines) + "\n").encode("utf-8"))
        except STORE_ERRORS as e:
            raise self.out.failed(self.name, e) from e
        self.lines += len(lines)

    def finish(self) -> None:
        try:
            self.out.store.finish(self.stream, self.tmp, self.dest)
        except STORE_ERRORS as e:
            raise self.out.failed(self.name, e) from e
        self.stream = None

    def abort(self) -> None:
        if self.stream is not None:       # finished files stay: each one is whole on its own
            self.out.store.abort(self.stream, self.tmp)
            self.stream = None


def _batches(out: OutputDir, part: str, columns: tuple[str, ...] | None):
    """The part's rows, ``BATCH_ROWS`` at a time (only ``columns`` that it has, if given)."""
    if columns is None:
        table = out.read_part(part)
    else:
        names = set(pq.read_schema(part, filesystem=out.fs).names)
        table = pq.read_table(part, columns=[c for c in columns if c in names], filesystem=out.fs)
    yield from shortest_floats(table).to_batches(max_chunksize=BATCH_ROWS)


def _render(out: OutputDir, fmt: str, model, storage, created: int) -> dict:
    """The export task: every part, in name order, into the files, each made visible whole."""
    tokens = None
    if fmt == OPENAI_BATCH and model is not None:
        from pipeline.storage.model_files import load_tokenizer, resolve_model_dir

        # Resolved here, on the task's node (an object-store model's tokenizer is fetched into its cache).
        tokens = TokenText(load_tokenizer(resolve_model_dir(model, storage, weights=False)))
    files: list[_AtomicFile] = []
    try:
        files.append(_AtomicFile(out, RESULTS_JSONL))
        if fmt == OPENAI_BATCH:
            files.append(_AtomicFile(out, ERRORS_JSONL))
        for part in out.part_files():
            for batch in _batches(out, part, _OPENAI_COLUMNS if fmt == OPENAI_BATCH else None):
                if fmt == OPENAI_BATCH:
                    results, errors = openai_lines(batch, tokens, created)
                    files[1].write(errors)
                else:
                    results = jsonl_lines(batch)
                files[0].write(results)
        for f in files:
            f.finish()
    except BaseException:
        for f in files:
            f.abort()
        raise
    if fmt == JSONL:
        _drop_stale(out, ERRORS_JSONL)
    errors = files[1] if len(files) > 1 else None
    return {"results": files[0].dest, "errors": errors.dest if errors else None,
            "results_lines": files[0].lines, "error_lines": errors.lines if errors else 0}


def _drop_stale(out: OutputDir, name: str) -> None:
    """Remove ``name`` left by an export in another format (it would describe other rows' fate)."""
    path = out.store.path(name)
    try:
        if out.store.is_file(path):
            out.store.delete(path)
    except STORE_ERRORS as e:
        raise out.failed(name, e) from e


def export(out: OutputDir, fmt: str, model=None, storage=None) -> dict:
    """Render ``data/`` as ``fmt`` ("jsonl" | "openai_batch"; "parquet": nothing to do → {}) →
    {"results", "errors" (None for jsonl), "results_lines", "error_lines"}.

    Runs as one Ray task (inline without Ray), memory bounded by one part. ``model`` (a ``ModelConfig``;
    ``storage`` for an object-store one) names the tokenizer openai_batch needs when rows have logprobs.
    Idempotent: every call rewrites the files from what ``data/`` holds now."""
    if fmt == PARQUET:
        return {}
    if fmt not in (JSONL, OPENAI_BATCH):
        raise ValueError(f"unknown export format {fmt!r} (expected 'jsonl', 'openai_batch' or 'parquet')")
    out.check_lease()
    from pipeline.config import StorageConfig

    return map_tasks(_render, [(out, fmt, model, storage or StorageConfig(), int(time.time()))])[0]
