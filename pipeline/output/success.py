"""The completion marker ``<output>/_SUCCESS``: what a scheduler's file sensor waits for.

Spark, Hadoop and most schedulers' sensors take a directory as finished when ``_SUCCESS`` appears
in it. This job writes one only when every input row x sample is committed in ``data/`` exactly
once (``summary.json["run"]["complete"]``), and only as the very last write of the run -- after
``summary.json``, ``summary.png`` and any ``output.format`` rendering -- in one atomic step (a
rename locally, one PUT on an object store), so a reader that sees it sees a finished directory.
Every run start removes it first (``OutputDir.prepare``): a resume, a repair (``--retry-errors``,
``--dedupe``) or an overwrite changes the directory, and a sensor must not read it meanwhile.

The marker holds JSON: the run id, the row counts and the summary's key figures, so a sensor can
log what it got without parsing ``summary.json``.
"""
from __future__ import annotations

import json
import time

from pipeline.output.directory import SUCCESS, OutputDir


def success_record(summary: dict, root: str) -> dict:
    """The marker's content: the run, its row counts and key figures (from ``summary``)."""
    rows, tokens, run = summary["rows"], summary["tokens"], summary["run"]
    cost = run.get("cost") or {}
    tpc = summary["speculation"]["tokens_per_cycle"]
    return {
        "run_id": run["run_id"],
        "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "output": root,
        "rows": {"input_rows": run.get("input_rows"), "samples_per_row": run.get("samples_per_row"),
                 "expected": run["rows_expected"], "in_output": rows["total"], "ok": rows["ok"],
                 "error": rows["error"], "finish_reason": rows["finish_reason"],
                 "generated_by_this_run": run["rows_generated"],
                 "skipped_as_finished": run["rows_skipped_as_finished"]},
        "tokens": {"prompt": tokens["prompt"], "completion": tokens["completion"]},
        "this_run": {"wall_seconds": run["wall_seconds"], "tokens_per_second": run["tokens_per_second"],
                     "steady_tokens_per_second": run.get("steady_tokens_per_second")},
        "tokens_per_cycle_pooled": tpc["pooled"],
        "cost": {"device": cost.get("device"),
                 "device_days_per_billion_output_tokens": cost.get("device_days_per_billion_output_tokens")},
    }


def mark_complete(out: OutputDir, summary: dict) -> bool:
    """Write ``_SUCCESS`` if the run left the output complete → whether it did.

    Call it last. The lease is checked first: a job that lost its directory to another writer must
    not declare that writer's output finished.
    """
    if not summary["run"]["complete"]:
        return False
    out.check_lease()
    out.write_atomic(SUCCESS, json.dumps(success_record(summary, str(out.root)), indent=2).encode())
    return True
