"""Reasoning rows through the job: Qwen3's released tokenizer and chat template with thinking on, the
Qwen3-vocabulary test model, a Parquet input and an OpenAI batch file (``python -m jobs.generate`` on
the module's Ray head: one head start, not one embedded Ray per job).

Each row's ``reasoning`` / ``completion`` / ``num_reasoning_tokens`` is what the engine makes of the
templated prompt, split at its think end; thinking budgets come from the per-row column, the config,
``body.max_thinking_tokens`` and ``body.reasoning_effort``.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from support.paths import REPO
from support.qwen3_chat import END_THINK, NL2, THINK
from support.hang import HANG_S
from support.ray_head import base_env

MAX_NEW = 12
PROMPTS = {"free": "Hello, world!", "budget": "Tell me a story.", "zero": "写一首诗"}
BUDGETS = {"free": None, "budget": 3, "zero": 0}


def _run(d: Path, model_dir: Path, head: dict, **sections) -> None:
    cfg = {"output": {"path": str(d / "out")}, "model": {"path": str(model_dir)},
           "engine": {"max_batch_size": 4, "dtype": "float32"}, "prompt": {"enable_thinking": True},
           **sections}
    (d / "job.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    proc = subprocess.run([sys.executable, "-m", "jobs.generate", "--config", str(d / "job.yaml")], cwd=REPO,
                          env={**base_env(), "RAY_ADDRESS": head["gcs"]}, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@functools.lru_cache(maxsize=1)
def _engine(model_dir: str) -> tuple:
    """The tokenizer and one engine for the module's expectations (idle between calls: reusable)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    return tok, OrthrusEngine(OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32), tokenizer=tok)


def _expected(model_dir: Path, text: str, budget: int | None, structured: dict | None = None,
              max_new: int = MAX_NEW) -> tuple[str, str, int, str]:
    """(reasoning, completion, num_reasoning_tokens, finish_reason) from the engine on the templated prompt."""
    tok, engine = _engine(str(model_dir))
    chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True)
    out = engine.generate([tok(chat, add_special_tokens=False)["input_ids"]],
                          SamplingParams(max_new_tokens=max_new, max_thinking_tokens=budget, structured=structured))[0]
    n, ids = out.num_reasoning_tokens, out.token_ids
    assert n is not None
    if budget is not None:     # forced: the think end, then "\n\n" unless a grammar decides
        assert n == budget + 1 and ids[budget: budget + 2 - (structured is not None)] == [END_THINK, NL2][: 2 - (structured is not None)]
    thought = tok.decode([t for t in ids[:n] if t not in (THINK, END_THINK)], skip_special_tokens=True).strip()
    answer = ids[n:-1] if out.finish_reason == "stop" else ids[n:]
    return thought, tok.decode(answer, skip_special_tokens=True).lstrip("\n"), n, out.finish_reason


@pytest.mark.parametrize("where", ["column", "config"])
def test_parquet_rows_split_reasoning_from_the_answer(head, qwen3_orthrus_dir, tmp_path, where):
    (tmp_path / "in").mkdir()
    rows = {"id": list(PROMPTS), "prompt": list(PROMPTS.values())}
    sampling = {"max_new_tokens": MAX_NEW}
    if where == "column":
        rows["max_thinking_tokens"] = pa.array(list(BUDGETS.values()), pa.int64())
        budgets = BUDGETS
    else:
        sampling["max_thinking_tokens"] = 3
        budgets = {rid: 3 for rid in PROMPTS}
    pq.write_table(pa.table(rows), tmp_path / "in" / "rows.parquet")
    _run(tmp_path, qwen3_orthrus_dir, head, input={"paths": [str(tmp_path / "in")]}, sampling=sampling)
    got = {r["id"]: r for r in pq.read_table(tmp_path / "out" / "data").to_pylist()}
    for rid, text in PROMPTS.items():
        thought, answer, n, reason = _expected(qwen3_orthrus_dir, text, budgets[rid])
        r = got[rid]
        assert (r["reasoning"], r["completion"], r["num_reasoning_tokens"], r["finish_reason"]) == \
            (thought, answer, n, reason), r
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tokens"]["reasoning"] == sum(r["num_reasoning_tokens"] for r in got.values())
    assert summary["tokens"]["answer"] == summary["tokens"]["completion"] - summary["tokens"]["reasoning"]
    assert summary["speculation"]["tokens_per_cycle"]["reasoning_pooled"] >= 1.0
    assert all(0 <= r["num_reasoning_cycles"] <= r["num_cycles"] for r in got.values())
    assert got["free"]["num_reasoning_cycles"] > 0
    if where == "column":      # never closed: all of it is reasoning, the answer is empty
        assert got["free"]["completion"] == "" and got["free"]["num_reasoning_tokens"] == got["free"]["num_completion_tokens"]


def test_openai_batch_reports_reasoning_content_and_tokens(head, qwen3_orthrus_dir, tmp_path):
    (tmp_path / "in").mkdir()
    bodies = {"budget": {"max_thinking_tokens": 3}, "zero": {"reasoning_effort": "none"}, "free": {}}
    lines = [json.dumps({"custom_id": rid, "method": "POST", "url": "/v1/chat/completions",
                         "body": {"model": "m", "messages": [{"role": "user", "content": PROMPTS[rid]}],
                                  "max_tokens": MAX_NEW, **extra}}) for rid, extra in bodies.items()]
    (tmp_path / "in" / "requests.jsonl").write_text("\n".join(lines) + "\n")
    _run(tmp_path, qwen3_orthrus_dir, head, input={"paths": [str(tmp_path / "in")], "format": "openai_batch"})
    results = {json.loads(x)["custom_id"]: json.loads(x) for x in (tmp_path / "out" / "results.jsonl").read_text().splitlines()}
    for rid in bodies:
        thought, answer, n, reason = _expected(qwen3_orthrus_dir, PROMPTS[rid], BUDGETS[rid])
        body = results[rid]["response"]["body"]
        message = body["choices"][0]["message"]
        assert (message["reasoning_content"], message["content"], body["choices"][0]["finish_reason"]) == \
            (thought, answer, reason)
        assert body["usage"]["completion_tokens_details"] == {"reasoning_tokens": n}


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def test_json_schema_after_thinking_through_the_job(head, qwen3_orthrus_dir, tmp_path):
    """Thinking on with a JSON schema: the answer after the think end is valid JSON, as the engine makes it."""
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"id": ["json"], "prompt": [PROMPTS["budget"]]}), tmp_path / "in" / "rows.parquet")
    _run(tmp_path, qwen3_orthrus_dir, head, input={"paths": [str(tmp_path / "in")]},
         sampling={"max_new_tokens": 24, "max_thinking_tokens": 4, "structured": {"json_schema": SCHEMA}})
    (r,) = pq.read_table(tmp_path / "out" / "data").to_pylist()
    thought, answer, n, reason = _expected(qwen3_orthrus_dir, PROMPTS["budget"], 4, {"json_schema": SCHEMA}, 24)
    assert (r["reasoning"], r["completion"], r["num_reasoning_tokens"], r["finish_reason"]) == (thought, answer, n, reason)
    assert reason == "stop" and json.loads(answer) in ({"ok": True}, {"ok": False})
