"""python -m jobs.bench (jobs/bench/) runs end to end on a small setting and reports every field docs/performance.md quotes.

Speed itself is never asserted (machines are shared and noisy); this guards the benchmark's shape.
"""
from __future__ import annotations

import json

from jobs import bench
from support.paths import REPO

MODEL, SHARDS = str(REPO / "models" / "tiny-orthrus-py"), str(REPO / "examples" / "shards")


def test_bench_reports_ratios_split_and_plot(tmp_path):
    out = tmp_path / "speed.json"
    bench.main(["--batch-sizes", "1,2", "--reps", "1", "--max-new-tokens", "8", "--min-rows", "3",
                "--no-job", "--threads", "1", "--out", str(out), "--model", MODEL, "--prompts", SHARDS])
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"1", "2"} and out.with_suffix(".png").stat().st_size > 0
    assert set(report["forward_ms"]) == {"1", "2"} and all(ms > 0 for ms in report["forward_ms"]["2"].values())
    for cells in report["results"].values():
        assert set(cells) >= {"orthrus", "auto", "ar", "hf", "cycle_over_ar_step", "engine"}
        assert cells["engine"]["attention"] == "sdpa" and not cells["engine"]["cuda_graphs"]
        assert cells["engine"]["kv_cache_mib"] > 0
        assert cells["host_reads_per_iteration"] == 1
        orthrus = cells["orthrus"]
        assert orthrus["tokens"] > 0 and orthrus["vs_ar"] > 0 and orthrus["vs_hf"] > 0
        assert orthrus["draft_s"] > 0 and orthrus["verify_s"] > 0 and orthrus["tpf"] == orthrus["tokens_per_cycle"] / 2
        assert cells["ar"]["draft_s"] == 0 and cells["ar"]["tokens_per_cycle"] == 1.0
        # every mode generated the same number of tokens from the same prompts (greedy, same stops)
        assert orthrus["tokens"] == cells["ar"]["tokens"] == cells["hf"]["tokens"]


def test_bench_shared_prefill_counts_each_prompt_once():
    import torch

    from jobs.bench.job import shared_prefill
    from orthrus import OrthrusForCausalLM

    model = OrthrusForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    report = shared_prefill(model, [[5, 6, 7, 8], [9, 10, 11]], slots=4, n=4, max_new_tokens=6)
    assert report["prefill_tokens"] == report["prompt_tokens_once"] == 7


def test_bench_audit_overhead_reports_every_fraction():
    from jobs.bench.job import audit_overhead

    report = audit_overhead(MODEL, SHARDS, rows=6, max_new_tokens=8, reps=1, fractions=(0.0, 1.0), slots=2)
    assert set(report["by_fraction"]) == {"0.0", "1.0"} and report["by_fraction"]["0.0"]["x_no_audit"] == 1.0
    full = report["by_fraction"]["1.0"]
    assert full["rows_audited"] == full["exact_matches"] == 6        # float32: every audited row matches


def test_bench_prefix_reports_cache_and_short_outputs(tmp_path):
    out = tmp_path / "prefix.json"
    bench.main(["prefix", "--rows", "4", "--prefix-tokens", "120", "--slots", "2", "--max-new-tokens", "4", "--reps", "1",
                       "--short-rows", "24", "--short-slots", "8", "--short-reps", "1", "--no-job",
                       "--model", MODEL, "--prompts", SHARDS, "--out", str(out)])
    report = json.loads(out.read_text())
    engine = report["prefix_engine"]
    assert engine["rows"] == 4 and 0 < engine["shared_prefix_tokens"] <= 120
    assert 20 <= engine["row_tokens"]["min"] <= engine["row_tokens"]["max"] <= 80
    assert engine["completions_identical"] is True                       # the cache never changes a token
    on, off = engine["cache_on"], engine["cache_off"]
    assert on["prefill_tokens_per_row"] <= off["prefill_tokens_per_row"]
    assert on["rows_per_s"] > 0 and engine["rows_per_s_on_over_off"] > 0 and engine["prefill_per_row_over_row_part"] > 0
    short = report["short_outputs"]
    assert short["rows"] == 24 and short["prompt_tokens"] == 3 and set(short["by_max_new_tokens"]) == {"1", "4"}
    for cell in short["by_max_new_tokens"].values():
        assert cell["tokens_identical"] is True and cell["speculative_over_ar"] > 0



def test_bench_prefix_grouping_reports_arms_against_the_ideal(tmp_path):
    out = tmp_path / "prefix_grouping.json"
    bench.main(["prefix_grouping", "--templates", "1,4", "--rows", "16", "--window", "8", "--template-tokens", "120",
                "--slots", "2", "--max-new-tokens", "4", "--sort-rows", "32", "--no-job",
                "--model", MODEL, "--prompts", SHARDS, "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["by_templates"]) == {"1", "4"} and report["window"] == 8 < report["rows"] == 16
    for cell in report["by_templates"].values():
        assert cell["rows"] == 16 and cell["completions_identical"] is True     # else main raised
        assert 0 < cell["template_tokens_mean"] <= 120 and cell["template_prefix_intact"] == 1.0
        arms = cell["arms"]
        assert set(arms) == {"unsorted", "window", "global", "cache_off"}
        assert arms["cache_off"]["computed_tokens"] == cell["prompt_tokens"] and arms["cache_off"]["hit_tokens"] == 0
        # sorting never computes more; the whole-page ideal is beaten only by partial pages copied from running rows
        assert arms["global"]["computed_tokens"] <= arms["unsorted"]["computed_tokens"] <= cell["prompt_tokens"]
        assert arms["global"]["computed_tokens"] <= 1.1 * cell["ideal_computed_tokens"]
        assert all(a["rows_per_s"] > 0 and a["computed_over_ideal"] > 0 for a in arms.values())
    one = report["by_templates"]["1"]
    assert one["ideal_computed_tokens"] < one["prompt_tokens"] / 2                  # one template: mostly shared
    assert report["sort_cost"]["rows"] == 32 and report["sort_cost"]["median_ms"] > 0

def test_bench_ab_loads_the_engine_at_a_ref_next_to_the_working_tree(tmp_path):
    import subprocess

    import pytest

    if subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "ab.json"
    bench.main(["ab", "--before", "HEAD", "--batch-sizes", "2", "--reps", "1", "--max-new-tokens", "4", "--min-rows", "3",
                   "--model", MODEL, "--prompts", SHARDS, "--out", str(out)])
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"B=2 orthrus", "B=2 ar"} and len(report["before_commit"]) == 40
    for cell in report["results"].values():
        assert cell["tokens_identical"] is True and cell["old_tok_s"] > 0 and cell["ratio_of_medians"] > 0


def test_bench_structured_reports_costs_checks_and_suite_validity(tmp_path, monkeypatch):
    from jobs.bench import common, structured
    from jobs.structured_suite import SUITE

    out = tmp_path / "structured.json"
    bench.main(["structured", "--batch-sizes", "2", "--rows", "4", "--reps", "1", "--max-new-tokens", "6",
                           "--mixed-batch-size", "2", "--validate-prompts", "1", "--validate-max-new-tokens", "12",
                           "--validate-batch-size", "4", "--model", MODEL, "--prompts", SHARDS, "--out", str(out)])
    report = json.loads(out.read_text())       # main raises on a failed check: they all passed
    cells = report["results"]["2"]
    assert set(cells["modes"]) == set(structured.MODES)
    assert all(c["tokens_per_s"] > 0 and c["tokens_per_cycle"] >= 1 for c in cells["modes"].values())
    assert cells["ratios"]["constrained_over_free tokens_per_s"]["ratio_of_medians"] > 0
    assert cells["ratios"]["constrained_speculative_over_ar tokens_per_s"]["median_of_pair_ratios"] > 0
    assert cells["ratios"]["mixed_over_free tokens_per_s"]["ratio_of_medians"] > 0
    assert cells["checks"]["constrained greedy tokens: speculative == AR"] is True
    assert cells["checks"]["mixed batch: free rows == all-free run"] is True
    assert cells["host_reads_per_iteration"]["free"] == 1 and cells["host_reads_per_iteration"]["constrained"] > 1
    assert set(cells["time_split"]) == {"free", "constrained", "mixed"}
    assert cells["time_split"]["constrained"]["ms_per_iteration"]["host_masks_along_drafts"] > 0
    assert cells["time_split"]["free"]["ms_per_iteration"]["host_masks_along_drafts"] == 0
    assert report["checks"] and all(report["checks"].values())
    v = report["validation"]
    assert set(v["by_kind"]) == {"json_schema", "regex", "choice", "grammar", "all"} and set(v["by_case"]) == {
        c.name for c in SUITE}
    every = v["by_kind"]["all"]["all"]
    assert every["rows"] == 2 * len(SUITE) == every["stop"] + every["length"] and every["stop"] > 0
    assert every["stop_valid"] == every["stop"] and v["invalid"] == []

    # python -m jobs.bench --only structured hands its parsed settings to this module and names the output
    seen = []
    monkeypatch.setattr(structured, "main", seen.append)
    bench.main(["--only", "structured", "--batch-sizes", "1", "--reps", "3", "--results-dir", str(tmp_path)])
    (args,) = seen
    assert common.results_path(args) == tmp_path / "structured.json"
    assert args.batch_sizes == "1" and args.reps == 3
    assert args.threads == 1


def test_bench_reasoning_reports_phases_ratios_and_checks(tmp_path):
    out = tmp_path / "reasoning.json"
    bench.main(["reasoning", "--batch-sizes", "2", "--reps", "1", "--max-new-tokens", "24", "--min-rows", "3",
                "--thinking-budget", "4", "--out", str(out)])
    report = json.loads(out.read_text())
    cell, checks = report["results"]["B=2"], report["checks"]["B=2"]
    assert checks["spec_equals_ar"] and checks["json_answers_valid"] == checks["json_answers_stopped"]
    assert cell["json_spec"]["reasoning_tokens"] == 3 * 5        # budget 4, then the forced think end
    for key in ("free_spec_over_ar", "json_spec_over_ar", "json_over_free_spec", "json_over_free_ar"):
        assert cell[key]["medians"] > 0 and cell[key]["pairs"] > 0


def test_bench_paged_reports_rows_in_flight_against_the_static_layout(tmp_path):
    out = tmp_path / "paged.json"
    bench.main(["paged", "--rows", "12", "--min-len", "16", "--max-len", "192", "--reps", "1", "--static-slots", "2",
                "--paged-slots", "12", "--out", str(out), "--model", MODEL])
    report = json.loads(out.read_text())
    static, paged = report["arms"]["static"], report["arms"]["paged"]
    assert report["completions_identical"] and static["rows_in_flight_median"] == 2 and static["preemptions"] == 0
    assert paged["rows_in_flight_median"] > 2 and report["rows_in_flight_paged_over_static"] > 1
    assert report["pool_tokens"] == 2 * 208 and 0 < report["paged_pages_per_row_over_tokens"] <= 1.5
    assert set(report["tokens_per_s_paged_over_static"]) == {"medians", "pairs"}
