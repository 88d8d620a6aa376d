"""jobs/gpu_check.py is the one script a lent GPU runs, once, on an image without pydantic, Ray or
flash-attn: it must import there, run its steps within a budget, and leave its JSON however it ends.

The device run itself cannot happen here; the CPU smoke run (``--device cpu``) goes through every
step's code path at tiny sizes, with the device image's missing packages made unimportable.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jobs import gpu_check
from support.hang import HANG_S
from support.paths import REPO

MODEL, SHARDS = str(REPO / "models" / "tiny-orthrus-py"), str(REPO / "examples" / "shards")
# Absent from the GPU image (pydantic, Ray, flash-attn, the S3 test stack) or never needed there (pipeline).
BLOCKED = ("pipeline", "pydantic", "ray", "flash_attn", "moto", "boto3", "botocore", "s3fs")

# Run in a fresh interpreter whose import system finds none of the blocked top-level names (nor
# their submodules): each finder is wrapped to answer None for them, so ``import pydantic`` raises
# ModuleNotFoundError and ``importlib.util.find_spec`` returns None (transformers probes flash_attn
# that way), exactly as where the package is not installed.
BOOT = """
import sys

BLOCKED = set({blocked!r})
assert not set(sys.modules) & set(BLOCKED)


class Hidden:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            return None
        return self.finder.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.finder, attr)


sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]
try:
    import pydantic
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("the block failed: pydantic imported")
import jobs.gpu_check

jobs.gpu_check.main({argv!r})
print("IMPORTED_BLOCKED", sorted({{m.partition(".")[0] for m in sys.modules}} & BLOCKED))
try:                       # the control: the job's bench modules do need the blocked stack
    import jobs.bench.scale
except ModuleNotFoundError:
    print("JOB_STACK_BLOCKED")
"""


@pytest.mark.slow
def test_gpu_check_imports_and_runs_without_the_job_stack(tmp_path):
    out = tmp_path / "out"
    argv = ["--device", "cpu", "--out", str(out), "--model", MODEL, "--prompts", SHARDS]
    proc = subprocess.run([sys.executable, "-c", BOOT.format(blocked=BLOCKED, argv=argv)], cwd=REPO,
                          capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "IMPORTED_BLOCKED []" in proc.stdout and "JOB_STACK_BLOCKED" in proc.stdout
    report = json.loads((out / "gpu-check.json").read_text())
    steps = report["steps"]
    assert report["finished"] and report["device"] == "cpu" and list(steps) == _step_names(tmp_path / "names")
    compiled = {"fp32_compiled_vs_eager", "costs_compiled"}     # their code: test_compiled_step.py
    assert {n for n, s in steps.items() if s["status"] != "ok"} == {"bf16_flash_graphs_vs_eager", *compiled}
    assert "flash_attn" in steps["bf16_flash_graphs_vs_eager"]["reason"]
    assert all("test_compiled_step.py" in steps[n]["reason"] for n in compiled)
    fp32 = steps["fp32_graphs_vs_eager"]["result"]
    for case in ("greedy", "sampled"):
        assert fp32[f"fp32_{case}_graphs_vs_eager"] == {"rows_equal": 1.0, "first_divergence_at_token": None}
        assert fp32["cuda_graphs"][case]["capture_failures"] == []
    paged = steps["paged_preemption"]["result"]
    for case in ("greedy", "sampled"):       # a pool of about one row: rows preempted, tokens unchanged
        assert paged[f"fp32_{case}_tight_vs_roomy"] == {"rows_equal": 1.0, "first_divergence_at_token": None}
        assert paged[f"{case}_preemptions"] > 0 and paged[f"{case}_recomputed_tokens"] > 0
    assert 0.0 <= steps["bf16_speculative_vs_ar"]["result"]["bf16_greedy_speculative_vs_ar"]["rows_equal"] <= 1.0
    sdpa = steps["sdpa_backends"]["result"]
    assert set(sdpa) >= {"flash_sdp_enabled", "math_sdp_enabled", "priority_order", "engine_shapes"}
    assert "choice" in sdpa["engine_shapes"]["cycle_b8"]
    for view in ("eager", "graphs"):   # one iteration: one device→host read; the sync mode is CUDA's
        sync = steps["sync_debug"]["result"][view]
        assert sync["host_transfers"].get("cpu") == 1 and sync["sync_debug_mode"] == "skipped: needs CUDA"
    assert set(steps["bench_b1"]["result"]) >= {"orthrus", "ar"} and "hf" not in steps["bench_b1"]["result"]
    assert "auto" not in steps["bench_b1"]["result"] and set(steps["bench_b2"]["result"]) >= set(
        gpu_check.bench.MODES)
    bench = json.loads((out / "bench-cpu.json").read_text())
    assert set(bench["results"]) == {"1", "2"}
    for mode in ("graphs", "eager"):                   # the cost grid, also on disk
        costs = steps[f"costs_{mode}"]["result"]
        assert set(costs) == {"B=1", "B=2"} and json.loads((out / f"costs-{mode}.json").read_text())["cells"] == costs
        for cell in costs.values():
            assert cell["ar_ms"] > 0 and cell["ar_tokens_per_s"] > 0 and {"K=2", "K=4"} <= set(cell)
            assert all(cell[k]["R"] > 0 and cell[k]["cycle_ms"] > 0 for k in ("K=2", "K=4"))
    profile = steps["profile_ar_step"]["result"]
    assert profile["eager"]["kernels_per_step"] > 0 and len(profile["eager"]["top"]) == 10
    assert (out / profile["eager"]["trace"]).stat().st_size > 0 and profile["weight_read_floor_ms"] is None
    sampling = steps["sampling_cost"]["result"]
    assert sampling["vocab"] == 4097 and sampling["B=2"]["sampled_over_greedy"] > 0
    verify = steps["bench_verify"]["result"]["B=2"]      # a cycle's cost at every draft vs pinned budgets
    assert set(verify) == {"full", "eighths_3", "eighths_2", "ar"} and bench["verify_budget"]["B=2"] == verify
    assert verify["eighths_2"]["forward_positions_per_iteration"] < verify["full"]["forward_positions_per_iteration"]
    assert report["commit"] == gpu_check.commit() and len(report["commit"].split("+")[0]) == 40
    assert not list(out.glob("*.tmp"))


def _step_names(out: Path) -> list[str]:
    check = gpu_check.Check(gpu_check.parse_args(["--device", "cpu", "--out", str(out)]))
    return [s.name for s in gpu_check.steps(check)]


@pytest.mark.slow
def test_steps_are_skipped_recorded_and_interrupted_within_the_budget(tmp_path, monkeypatch):
    for name, seconds in (("ok", 0), ("saw", 0), ("fails", 0), ("big", 1000), ("slow", 0), ("after", 0)):
        monkeypatch.setitem(gpu_check.ESTIMATE_S, name, seconds)
    check = gpu_check.Check(gpu_check.parse_args(["--device", "cpu", "--out", str(tmp_path), "--budget-s", "2"]))

    def fails():
        raise RuntimeError("CUDA graph capture failed: boom")
    plan = [gpu_check.Step("ok", lambda: {"x": 1}),
            gpu_check.Step("saw", lambda: json.loads((tmp_path / "gpu-check.json").read_text())["steps"]),
            gpu_check.Step("fails", fails), gpu_check.Step("big", lambda: {}),
            gpu_check.Step("slow", lambda: time.sleep(30)), gpu_check.Step("after", lambda: {})]
    for step in plan:
        check.run(step)
    steps = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert steps["ok"] == {"estimate_s": 0, "status": "ok", "result": {"x": 1}, "seconds": steps["ok"]["seconds"]}
    assert steps["saw"]["result"]["ok"]["status"] == "ok"  # written after the step before it
    assert steps["fails"]["status"] == "error" and "boom" in steps["fails"]["error"]
    assert steps["big"]["status"] == "skipped" and "estimated at 1000 s" in steps["big"]["reason"]
    # "interrupted" only comes from the budget's timer: it cut the 30 s step (no bound on the wall time:
    # a loaded machine may take long over the rest, and the test must not race the clock)
    assert steps["slow"]["status"] == "interrupted"
    assert steps["after"]["status"] == "skipped"
    assert "budget ran out" in steps["after"]["reason"]


def test_only_runs_the_named_steps_and_refuses_unknown_ones(tmp_path):
    check = gpu_check.Check(gpu_check.parse_args(["--device", "cpu", "--out", str(tmp_path)]))
    chosen = gpu_check.selected(gpu_check.steps(check), "sdpa_backends, sync_debug")
    assert [s.name for s in chosen] == _step_names(tmp_path / "names")
    assert {s.name for s in chosen if s.why_not() is None} <= {"sdpa_backends", "sync_debug"}
    assert chosen[-1].why_not() in ("not in --only", "no bench results")
    try:
        gpu_check.selected(chosen, "sync_debgu")
    except SystemExit as err:
        assert "sync_debgu" in str(err)
    else:
        raise AssertionError("an unknown step name must be refused")


def test_dry_run_prints_the_plan_and_stamps_the_commit(tmp_path, capsys):
    stamp = tmp_path / "GPU_CHECK_COMMIT"
    gpu_check.dry_run(gpu_check.parse_args(["--dry-run", "--only", "sync_debug,bench_verify"]), stamp)
    plan = json.loads(capsys.readouterr().out)
    assert plan["steps"] == [{"name": "sync_debug", "estimate_s": 8}, {"name": "bench_verify", "estimate_s": 40}]
    assert plan["total_s"] == 48 and plan["budget_s"] == 480 and plan["out"].startswith("gpu-check/20")
    assert stamp.read_text().strip() == gpu_check.commit() == plan["commit"]
    gpu_check.dry_run(gpu_check.parse_args(["--dry-run"]), tmp_path / "full")
    plan = json.loads(capsys.readouterr().out)
    names = [s["name"] for s in plan["steps"]]     # every step at CUDA's sizes, in budget
    assert plan["total_s"] == sum(s["estimate_s"] for s in plan["steps"]) == sum(gpu_check.ESTIMATE_S.values()) <= 480
    assert set(names) == set(gpu_check.ESTIMATE_S) and {"profile_ar_step", "costs_compiled", "bench_b64"} <= set(names)
    assert 256 in gpu_check.SIZES["cuda"]["cost_batch_sizes"] and gpu_check.SIZES["cuda"]["cost_blocks"] == (8, 16, 32)
