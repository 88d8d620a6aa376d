"""What the lossless audit costs (part of ``jobs/bench.py``, CPU only).

The generation actor's stage runs in this process (no Ray) over one batch of held-out prompts,
greedy, with ``audit.fraction`` 0, 0.05 and 1; the three are interleaved ``reps`` times and the
median batch time of each is compared with fraction 0 measured in the same run. Reported: the
audited rows and the slowdown. The audited rows also must all match (float32).
"""
from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pipeline.config import AuditConfig, load_config
from pipeline.run.job import preflight
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.inputs.source import read_file
from pipeline.actor.stage import GenerationStage, StagePlan


def audit_overhead(model_dir: str, prompts_dir: str, rows: int = 64, max_new_tokens: int = 64, reps: int = 3,
                   fractions: tuple[float, ...] = (0.0, 0.05, 1.0), slots: int = 8) -> dict:
    """Median batch seconds per audit fraction, and each one's ratio to no audit."""
    texts = pads.dataset(prompts_dir, format="parquet").to_table(columns=["prompt"]).column("prompt").to_pylist()
    tmp = Path(tempfile.mkdtemp(prefix="orthrus-bench-audit-"))
    (tmp / "in").mkdir()
    pq.write_table(pa.table({"id": [f"a{i}" for i in range(rows)], "prompt": [texts[i % len(texts)] for i in range(rows)]}),
                   tmp / "in" / "rows.parquet")
    cfg = load_config(None, data={"input": {"paths": [str(tmp / "in")]}, "output": {"path": str(tmp / "out")},
                                  "model": {"path": model_dir}, "prompt": {"chat_template": "off"},
                                  "sampling": {"max_new_tokens": max_new_tokens},
                                  "engine": {"max_batch_size": slots, "dtype": "float32"}})
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, cfg.sampling.n), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    stages = {f: GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False,
                                           audit=AuditConfig(fraction=f, max_batch_size=max(1, slots // 2))))
              for f in fractions}
    seconds: dict[float, list[float]] = {f: [] for f in fractions}
    audited: dict[float, tuple[int, int]] = {}
    for _ in range(reps):
        for f, stage in stages.items():
            start = time.perf_counter()
            out = asyncio.run(stage(batch)).to_pylist()
            seconds[f].append(time.perf_counter() - start)
            flags = [r["audit_match"] for r in out if r["audit_match"] is not None]
            audited[f] = (len(flags), sum(flags))
    base = statistics.median(seconds[fractions[0]])
    return {"rows": rows, "max_new_tokens": max_new_tokens, "slots": slots, "reps": reps,
            "by_fraction": {str(f): {"median_batch_s": round(statistics.median(s), 3),
                                     "x_no_audit": round(statistics.median(s) / base, 3),
                                     "rows_audited": audited[f][0], "exact_matches": audited[f][1]}
                            for f, s in seconds.items()}}
