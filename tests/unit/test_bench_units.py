"""The benchmarks' shared helpers (jobs/bench/common.py, profile.py) and the engine's named ranges
(orthrus/ranges.py): medians and pair ratios, interleaved rounds, the command line (a workload first
or as ``--only``), where results go, and exclusive times read from a profile."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from jobs.bench import common
from jobs.bench.profile import exclusive_seconds, profiled
from orthrus.ranges import PREFIX, RangeTimer, named_range, ranged


def test_median_pair_ratio_and_median_cell():
    a = [{"x": 2.0, "n": None}, {"x": 6.0, "n": None}, {"x": 4.0, "n": None}]
    b = [{"x": 1.0}, {"x": 2.0}, {"x": 4.0}]
    assert common.med(a, "x") == 4.0
    assert common.pair_ratio(a, b, "x") == 2.0              # per round: 2, 3, 1 → median 2 (not 4 / 2)
    assert common.median_cell(a) == {"x": 4.0, "n": None}


def test_rounds_interleave_rotate_and_drop_the_warm_up():
    order: list[str] = []
    runs = {n: (lambda n=n: order.append(n) or {"i": len(order)}) for n in ("a", "b", "c")}
    samples, first, _ = common.rounds(runs, reps=2)
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert first == {"a": {"i": 1}, "b": {"i": 2}, "c": {"i": 3}}
    assert samples["a"] == [{"i": 6}, {"i": 8}] and samples["c"] == [{"i": 5}, {"i": 7}]
    order.clear()
    samples, first, _ = common.rounds(runs, reps=2, rotate=False, warmup=False)
    assert order == ["a", "b", "c"] * 2 and first == {} and len(samples["b"]) == 2
    assert common.rotated(("x", "y"), 3) == ["y", "x"]


def test_the_workload_comes_first_or_as_only_and_defaults_to_speed():
    assert common.workload_of([]) == common.workload_of(["--reps", "1"]) == "speed"
    assert common.workload_of(["vocab", "--reps", "1"]) == common.workload_of(["--reps", "1", "--only", "vocab"]) \
        == common.workload_of(["--only=vocab"]) == "vocab"
    assert common.parse_args([]).workload == "speed"
    for argv in (["structured", "--reps", "3"], ["--only", "structured", "--reps", "3"]):
        args = common.parse_args(argv)
        assert args.workload == "structured" and args.reps == 3
        assert args.threads == 1 and args.batch_sizes == "1,16"      # the workload's own defaults
        assert args.mixed_batch_size == 16                            # and its own arguments
    with pytest.raises(SystemExit):
        common.parse_args(["logprobs", "--mixed-batch-size", "2"])   # another workload's argument
    with pytest.raises(SystemExit):
        common.parse_args(["vocab", "--only", "ab"])
    with pytest.raises(SystemExit):
        common.parse_args(["nonsense"])
    assert common.parse_args(["scale", "--scale-sizes", "2k"]).sizes == "2k"   # speed's spelling works too
    assert common.parse_args(["short", "--config", "x.yaml"]).job_config == "x.yaml"
    assert common.batch_sizes(common.parse_args(["vocab"]), "9") == [1, 8, 32]
    assert common.batch_sizes(common.parse_args(["speed"]), "1,4") == [1, 4]


def test_results_go_to_one_folder_by_workload(tmp_path):
    args = common.parse_args(["logprobs"])
    assert common.results_path(args) == common.REPO / "bench-results" / "logprobs.json"
    speed = common.parse_args(["--results-dir", str(tmp_path)])
    assert common.results_path(speed, ".png") == tmp_path / "speed.png"
    out = common.parse_args(["ab", "--out", str(tmp_path / "x" / "old-vs-new.json")])
    assert common.write_report(out, {"a": 1}) == tmp_path / "x" / "old-vs-new.json"
    assert (tmp_path / "x" / "old-vs-new.json").read_text().strip().startswith("{")
    assert {p.stem for p in (common.REPO / "bench-results").glob("*.json")} <= set(common.WORKLOADS)


def _event(name: str, start: float, end: float, thread: int = 1) -> SimpleNamespace:
    return SimpleNamespace(name=PREFIX + name, thread=thread, time_range=SimpleNamespace(start=start, end=end),
                           device_type=torch.autograd.DeviceType.CPU)


def test_exclusive_seconds_subtract_nested_ranges_and_fold_the_prefills_forward():
    events = [_event("prefill", 0, 100), _event("verify_forward", 10, 60), _event("lm_head", 40, 50),
              _event("device_masking", 70, 80), _event("draft_forward", 200, 300), _event("lm_head", 280, 290),
              _event("host_matcher_advance", 250, 400, thread=2), SimpleNamespace(
                  name="aten::mm", thread=1, time_range=SimpleNamespace(start=0, end=1000), device_type=None)]
    got = {k: round(v * 1e6) for k, v in exclusive_seconds(events).items()}
    assert got == {"prefill": 90, "device_masking": 10, "draft_forward": 90, "lm_head": 10,
                   "host_matcher_advance": 150}


def test_ranges_cost_nothing_without_a_profiler_and_show_in_one():
    @named_range("device_masking")
    def head(x):
        return x + 1
    assert head.__name__ == "head" and head(1) == 2        # no profiler: the plain call
    with ranged("prefill"):
        pass

    def run():
        with ranged("prefill"):
            return head(torch.ones(3))
    out, seconds = profiled(run)
    assert out.tolist() == [2.0] * 3 and set(seconds) == {"prefill", "device_masking"}


def test_a_range_timer_times_ranges_inclusively_and_syncs_around_each():
    synced = []
    with ranged("outside"):
        pass
    with RangeTimer(lambda: synced.append(1)) as timer:
        with ranged("prefill"):
            with ranged("verify_forward"):
                pass
    with ranged("after"):
        pass
    assert set(timer.seconds) == {"prefill", "verify_forward"} and len(synced) == 4
    assert timer.seconds["prefill"] >= timer.seconds["verify_forward"] >= 0


def test_no_bench_result_file_is_left_at_the_repo_root():
    assert not list(Path(common.REPO).glob("bench*.json")) and not list(Path(common.REPO).glob("bench*.png"))
