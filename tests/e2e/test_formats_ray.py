"""OpenAI-batch files through the job on Ray: killed mid-run, resumed, errors retried.

300 request lines (a few malformed, a few invalid) go in, in 20 batches; the run is SIGKILLed after its first
commits and resumed; every custom_id must then be exactly once in results.jsonl or errors.jsonl,
and the lines must follow the OpenAI Batch output format.
"""
from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import yaml

from support.paths import REPO
from support.hang import HANG_S
from support.ray_head import base_env, killpg, wait_for

N, BATCH = 300, 15          # 20 batches: the kill lands between commits with most of them unfinished
BAD_LINES = {17: "{not json", 200: '["an array"]'}                # malformed: error rows naming the line
INVALID = {5: {"n": 2}, 150: {"max_tokens": -1}, N - 1: {"temperature": "hot"}}   # well-formed, refused


def _request(i: int) -> str:
    if i in BAD_LINES:
        return BAD_LINES[i]
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"def f{i}(x):"}], "max_tokens": 4,
            "temperature": 0.0 if i % 3 else 0.7, "seed": i, **({"logprobs": True, "top_logprobs": 2} if i % 7 == 0 else {}),
            **INVALID.get(i, {})}
    return json.dumps({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_openai_batch_killed_and_resumed_has_every_custom_id_once(tiny_orthrus_dir, tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "requests.jsonl").write_text("".join(_request(i) + "\n" for i in range(N)))
    out = tmp_path / "out"
    cfg = {"input": {"paths": [str(tmp_path / "in")], "format": "openai_batch"},
           "output": {"path": str(out), "part_bytes": 1},            # a part per batch: killed between commits
           "model": {"path": str(tiny_orthrus_dir)},
           "engine": {"batch_size": BATCH, "max_batch_size": 16, "dtype": "float32"}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "jobs.generate", "--config", str(tmp_path / "job.yaml")]
    # each actor runs 2 batches, then holds the rest at a barrier never released (hold_after): the kill
    # comes after a commit with most batches unfinished, however fast or loaded the machine (of the
    # two batches done, Ray Data may still hold one back from the driver: wait for one part)
    held = {**base_env(), "ORTHRUS_FAULT_INJECT": f"hold_after:2:{tmp_path / 'never'}"}
    with open(tmp_path / "killed.log", "wb") as log:   # embedded Ray in the driver's own process group
        driver = subprocess.Popen(cmd, cwd=REPO, env=held, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            wait_for(lambda: list((out / "data").glob("part-*.parquet")) or driver.poll() is not None,
                     "a committed part")
        finally:
            killpg(driver, grace=0)                       # SIGTERM then SIGKILL: the driver and its Ray
    committed = len(list((out / "data").glob("part-*.parquet")))
    assert driver.returncode != 0 and 0 < committed < N // BATCH, (tmp_path / "killed.log").read_text()[-3000:]
    assert not (out / "results.jsonl").exists()           # rendered only once every row is done

    proc = subprocess.run([*cmd, "--resume"], cwd=REPO, env=base_env(), capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    results, errors = _lines(out / "results.jsonl"), _lines(out / "errors.jsonl")
    ids = Counter(line["custom_id"] for line in results + errors)
    expected = {f"req-{i}" for i in range(N) if i not in BAD_LINES} | {f"requests.jsonl:{i + 1}" for i in BAD_LINES}
    assert set(ids) == expected and set(ids.values()) == {1}           # every custom_id exactly once
    assert {e["custom_id"] for e in errors} == {f"req-{i}" for i in INVALID} | {f"requests.jsonl:{i + 1}"
                                                                                for i in BAD_LINES}
    assert "line 18 of requests.jsonl" in next(e for e in errors if e["custom_id"] == "requests.jsonl:18")[
        "error"]["message"]
    ok = next(r for r in results if r["custom_id"] == "req-7")
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["response"]["status_code"] == 200
    body = ok["response"]["body"]
    assert body["object"] == "chat.completion" and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] == len(body["choices"][0]["logprobs"]["content"]) <= 4
    assert len(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2

    retried = subprocess.run([*cmd, "--retry-errors"], cwd=REPO, env=base_env(), capture_output=True, text=True,
                             timeout=HANG_S)
    assert retried.returncode == 0, retried.stdout[-4000:] + retried.stderr[-4000:]
    again = Counter(line["custom_id"] for line in _lines(out / "results.jsonl") + _lines(out / "errors.jsonl"))
    assert again == ids                                    # the bad requests fail again, still once each
