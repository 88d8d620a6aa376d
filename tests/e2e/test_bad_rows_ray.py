"""Bad rows never take a neighbour down (issue 32), through the processor on a real local Ray head:
an upstream ``error`` column of another type, a ``sampling_params`` key we do not support, a
constraint over the grammar engine's limits or with no value, and one that compiles and fails only
mid-decode each end as their own row's error; rows in == rows out, and every other row's tokens
equal a run without the bad rows. Then the job (``jobs.generate``) on JSON Lines: broken lines (the
first included) and constraints that fail are error rows, the other rows' tokens unchanged; and a
refusal found inside a Ray task (a truncated .gz) is one line on stderr."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from support.constraints import EXPLODES
from support.paths import REPO
from support.hang import HANG_S
from support.ray_head import base_env


GOOD = [
    {"id": "g0", "prompt": "def add(a, b):", "sp": {"max_tokens": 12}},
    {"id": "g1", "prompt": "class Stack:", "sp": {"max_tokens": 12, "temperature": 0.8, "seed": 5}},
    {"id": "g2", "prompt": "Answer:", "sp": {"max_tokens": 12, "guided_choice": ["yes", "no", "maybe"]}},
    {"id": "g3", "prompt": "def fib(n):", "sp": {"max_tokens": 12, "presence_penalty": 0.0, "n": 1}},   # defaults
]
BAD = [
    {"id": "upstream", "prompt": "x", "error": 7, "sp": {"max_tokens": 12}},
    {"id": "penalty", "prompt": "x", "sp": {"max_tokens": 12, "presence_penalty": 5}},
    {"id": "choices", "prompt": "x", "sp": {"max_tokens": 12, "guided_choice": [f"c{i}" for i in range(5001)]}},
    {"id": "selfref", "prompt": "x", "sp": {"max_tokens": 12, "guided_json": '{"$ref": "#"}'}},
    {"id": "explodes", "prompt": "x", "sp": {"max_tokens": 12, "guided_grammar": EXPLODES["grammar"]}},
]


def _run(model: str, rows: list[dict]) -> dict[str, dict]:
    import ray.data
    from pipeline import OrthrusProcessorConfig, build_orthrus_processor

    config = OrthrusProcessorConfig(model_source=model, batch_size=16, concurrency=1, apply_chat_template=False,
                                    engine_kwargs={"max_batch_size": 4, "dtype": "float32"})
    processor = build_orthrus_processor(
        config,
        preprocess=lambda row: {"id": row["id"], "prompt": row["prompt"], "error": row.get("error"),
                                "sampling_params": row["sp"]},
        postprocess=lambda row: {"id": row["id"], "error": row["error"], "finish_reason": row["finish_reason"],
                                 "tokens": row["generated_tokens"]})
    items = [{"error": None, **r} for r in rows]
    out = processor(ray.data.from_items(items)).take_all()
    assert len(out) == len(rows)                                          # rows in == rows out
    return {r["id"]: r for r in out}


def test_bad_rows_are_their_own_errors_and_neighbours_are_unchanged(ray_local, tiny_orthrus_dir):
    alone = _run(str(tiny_orthrus_dir), GOOD)
    mixed = _run(str(tiny_orthrus_dir), GOOD[:2] + BAD + GOOD[2:])
    for row in GOOD:
        got, want = mixed[row["id"]], alone[row["id"]]
        assert want["error"] is None and want["tokens"]
        assert (got["tokens"], got["finish_reason"], got["error"]) == (want["tokens"], want["finish_reason"], None)
    errors = {r["id"]: mixed[r["id"]]["error"] for r in BAD}
    assert all(mixed[r["id"]]["finish_reason"] == "error" for r in BAD)
    assert errors["upstream"] == "7"                                      # kept, as text
    assert errors["penalty"] == "sampling_params.presence_penalty must be a number in [-2, 2] (0 = off), got 5.0"
    assert errors["choices"].startswith("sampling_params.guided_choice: choice has 5001 choices; the limit is ")
    assert errors["selfref"].startswith("sampling_params.guided_json: json_schema admits no JSON value")
    assert errors["explodes"].startswith("decoding failed: SamplingParams.structured.grammar: the grammar engine "
                                         "failed after ")


# ---------------------------------------------------------------- the job (jobs.generate), JSON Lines input

GOOD_LINES = [{"id": f"g{i}", "prompt": p} for i, p in enumerate(["def add(a, b):", "class Stack:", "def fib(n):"])]
BAD_LINES = {
    "u": b'{"id": "u", "prompt": "caf\xe9"}',                                  # invalid UTF-8, as the first line
    "explodes": json.dumps({"id": "explodes", "prompt": "x", "structured": EXPLODES}).encode(),
    "selfref": json.dumps({"id": "selfref", "prompt": "x", "structured": {"json_schema": {"$ref": "#"}}}).encode(),
}
DEEP = b'{"id": "deep", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"            # the first line of a second file


def _job(model: str, tmp_path: Path, name: str, files: dict[str, bytes]) -> tuple[subprocess.CompletedProcess, Path]:
    (tmp_path / name / "in").mkdir(parents=True)
    for fname, data in files.items():
        (tmp_path / name / "in" / fname).write_bytes(data)
    out = tmp_path / name / "out"
    cfg = {"input": {"paths": [str(tmp_path / name / "in")], "format": "jsonl"}, "output": {"path": str(out)},
           "model": {"path": model}, "prompt": {"chat_template": "off"},
           "sampling": {"max_new_tokens": 10}, "engine": {"batch_size": 8, "max_batch_size": 4, "dtype": "float32"}}
    (tmp_path / name / "job.yaml").write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / name / "job.yaml")],
                          cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=HANG_S)
    return proc, out


def _lines(rows: list) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def test_the_job_keeps_every_bad_line_as_its_own_error_row(tiny_orthrus_dir, tmp_path):
    clean, clean_out = _job(str(tiny_orthrus_dir), tmp_path, "clean", {"a.jsonl": _lines(GOOD_LINES)})
    assert clean.returncode == 0, clean.stderr[-3000:]
    mixed_rows = [BAD_LINES["u"], GOOD_LINES[0], BAD_LINES["explodes"], GOOD_LINES[1], BAD_LINES["selfref"],
                  GOOD_LINES[2]]
    mixed, out = _job(str(tiny_orthrus_dir), tmp_path, "mixed", {"a.jsonl": _lines(mixed_rows),
                                                                 "b.jsonl": _lines([DEEP])})
    assert mixed.returncode == 0, mixed.stderr[-3000:]
    rows = {r["id"]: r for r in pq.read_table(out / "data").to_pylist()}
    assert len(rows) == len(mixed_rows) + 1                               # rows in == rows out
    errors = {i: r["error"] for i, r in rows.items() if r["error"]}
    assert errors["a.jsonl:1"].endswith("line 1 of a.jsonl: not valid UTF-8 (invalid continuation byte at byte 26)")
    assert "line 1 of b.jsonl: nested deeper than the JSON parser allows" in errors["b.jsonl:1"]
    assert errors["selfref"].startswith("column 'structured': json_schema admits no JSON value")
    assert errors["explodes"].startswith("decoding failed: SamplingParams.structured.grammar: the grammar engine")
    assert set(errors) == {"a.jsonl:1", "b.jsonl:1", "selfref", "explodes"}
    want = {r["id"]: r for r in pq.read_table(clean_out / "data").to_pylist()}
    keys = ("completion", "finish_reason", "num_completion_tokens", "cumulative_logprob")
    for g in GOOD_LINES:                                                  # neighbours: the same completions
        assert [rows[g["id"]][k] for k in keys] == [want[g["id"]][k] for k in keys]
        assert rows[g["id"]]["completion"]


def test_a_refusal_found_inside_a_ray_task_is_one_line(tiny_orthrus_dir, tmp_path):
    lines = _lines([{"id": f"r{i}", "prompt": f"{i:08d} " + "word " * 20} for i in range(60000)])
    packed = gzip.compress(lines)
    proc, out = _job(str(tiny_orthrus_dir), tmp_path, "cut", {"cut.jsonl.gz": packed[: len(packed) * 2 // 3]})
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "cut.jsonl.gz cannot be read" in errors[0], proc.stderr[-3000:]
    assert "ray::" not in proc.stderr and "Traceback" not in proc.stderr and 'File "' not in proc.stderr
