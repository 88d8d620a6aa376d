"""The one table of output columns (``pipeline/columns.py``) and what derives from it: the job's
Parquet schema, the processor's columns, the row builder, the footers' sums and ``summary.json``,
the actor's counters. Each check runs over every row of the table, so a new row is checked too."""
from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from orthrus import RequestOutput, SamplingParams
from orthrus.params import RowStats
from pipeline import columns as C
from pipeline import schema as S
from pipeline.actor.results import result_columns
from pipeline.output import stats as St
from pipeline.report.summary import statistics

# The job's Parquet columns as outputs hold them (2026-12): existing outputs and --resume rely on
# each keeping its name, type and place relative to the others. A new column may go anywhere.
WRITTEN = (("id", pa.string()), ("sample_index", pa.int64()), ("completion", pa.string()),
           ("reasoning", pa.string()), ("finish_reason", pa.string()), ("error", pa.string()),
           ("num_prompt_tokens", pa.int64()), ("num_completion_tokens", pa.int64()),
           ("num_reasoning_tokens", pa.int64()), ("num_cycles", pa.int64()), ("num_forward_passes", pa.int64()),
           ("num_draft_tokens", pa.int64()), ("num_accepted_draft_tokens", pa.int64()),
           ("num_verified_draft_tokens", pa.int64()), ("tokens_per_cycle", pa.float64()),
           ("accept_length_histogram", pa.list_(pa.int64())), ("num_tokens_after_stop", pa.int64()),
           ("num_reasoning_cycles", pa.int64()), ("num_reasoning_accepted_draft_tokens", pa.int64()),
           ("token_logprobs", pa.list_(pa.float32())), ("generated_token_ids", pa.list_(pa.int32())),
           ("top_logprobs", pa.list_(pa.list_(C.TOP_LOGPROB))), ("cumulative_logprob", pa.float64()),
           ("time_waiting_s", pa.float64()), ("time_in_engine_s", pa.float64()),
           ("batch_wall_seconds", pa.float64()), ("audit_match", pa.bool_()), ("audit_first_divergence", pa.int64()),
           ("seed", pa.int64()), ("model", pa.string()))


def _full_row() -> tuple[RequestOutput, SamplingParams]:
    """A result with every field set: a reasoning row with logprobs, ended by a stop token."""
    stats = RowStats(**{name: 3 for name in RowStats.__dataclass_fields__ if name != "accept_length_histogram"},
                     accept_length_histogram=[1, 2])
    out = RequestOutput("r", [5, 6, 9], "stop", "x", stats, 7, text="hi", queue_seconds=0.5, engine_seconds=1.5,
                        token_logprobs=[-1.0] * 3, top_logprobs=[[(1, -0.5)]] * 3, cumulative_logprob=-3.0,
                        num_reasoning_tokens=2)
    return out, SamplingParams(logprobs=1, stop_token_ids=[9])


def test_the_parquet_schema_is_the_tables_job_columns_and_keeps_what_outputs_hold():
    job = [c for c in C.COLUMNS if c.job is not None]
    assert [(f.name, f.type) for f in S.OUTPUT_FIELDS] == [(c.job, c.arrow) for c in job]
    assert S.output_schema([]) == pa.schema([pa.field(c.job, c.arrow) for c in job])
    fields = [(f.name, f.type) for f in S.OUTPUT_FIELDS]
    kept = [f for f in fields if f[0] in dict(WRITTEN)]
    assert kept == list(WRITTEN)                     # none renamed, retyped, dropped or moved
    for names in ([c.name for c in C.COLUMNS], [c.job for c in job]):
        assert len(names) == len(set(names))


def test_the_processors_columns_and_the_job_names_derive_from_the_table():
    assert [(f.name, f.type) for f in S.GENERATED_FIELDS] == [(c.name, c.arrow) for c in C.COLUMNS if c.processor]
    assert {"generated_text", "generated_tokens", "num_input_tokens", "num_generated_tokens"} <= \
        {f.name for f in S.GENERATED_FIELDS}                    # Ray Data LLM's names
    assert S.JOB_NAMES["completion"] == "generated_text" and S.JOB_NAMES["num_prompt_tokens"] == "num_input_tokens"
    internal = [c for c in C.COLUMNS if c.job is None]
    assert {c.name for c in internal} == {S.TEXT_IDS, S.ENGINE_TEXT} and not any(c.processor for c in internal)
    # the actor appends the engine's and its own columns, in the table's order
    assert C.ASSEMBLED == tuple(c.name for c in C.COLUMNS if c.source in ("engine", "actor"))


def test_the_row_builder_fills_every_engine_column():
    out, params = _full_row()
    cols = result_columns([out, None], [None, "decoding failed: x"], [params, None], frozenset({0}))
    assert set(cols) == {c.name for c in C.ENGINE} | {"error"}
    assert all(len(v) == 2 for v in cols.values())
    assert [name for name, v in cols.items() if name != "error" and v[0] is None] == []     # every one taken
    assert [name for name, v in cols.items() if name != "error" and v[1] is not None] == []  # no result: null
    assert cols["error"] == [None, "decoding failed: x"]
    for c in C.ENGINE:           # the value fits the column's type
        pa.array(cols[c.name], c.arrow)
    assert cols["num_generated_tokens"] == [3, None] and cols[S.TEXT_IDS][0] == [5, 6]    # the stop token cut
    assert cols["num_verified_draft_tokens"][0] == out.stats.num_verified_draft_tokens


def test_stats_columns_are_summed_in_the_footers_and_the_summary():
    summed = [c for c in C.COLUMNS if c.stat == "sum"]
    assert St.SUMS == tuple(c.job for c in summed) and "num_verified_draft_tokens" in St.SUMS
    assert St.TIME_COLUMNS == tuple(c.job for c in C.COLUMNS if c.stat == "sketch")
    table = pa.table({**{f.name: pa.nulls(3, f.type) for f in S.OUTPUT_FIELDS}, "tokens_per_cycle": [1.0] * 3,
                      "id": ["a", "b", "c"], "finish_reason": ["stop", "length", "error"],
                      **{c.job: pa.array([i + 1, 10 * (i + 1), 1000], c.arrow) for i, c in enumerate(summed)}})
    sums = statistics(St.of_table(table), 0, 0.0)["column_sums"]
    assert sums == {c.job: 11 * (i + 1) for i, c in enumerate(summed)}     # ok rows only
    # footers written before a column existed sum it as 0
    old = St.of_table(table.drop_columns(["num_verified_draft_tokens"]))
    del old["sums"]["num_verified_draft_tokens"]
    assert statistics(old, 0, 0.0)["column_sums"]["num_verified_draft_tokens"] == 0


@pytest.mark.parametrize("bad", [dict(source="engine"), dict(source="actor", take="stats.num_cycles"),
                                 dict(source="actor", stat="sum", arrow=pa.float64()),
                                 dict(source="actor", stat="sketch")])
def test_a_row_that_cannot_be_derived_is_refused(bad):
    with pytest.raises(ValueError):
        C.OutputColumn(**{"name": "x", "arrow": pa.int64(), "doc": "x", **bad})


class _Counter:
    """Stands in for ray.util.metrics' Counter and Gauge (no Ray)."""

    def __init__(self, name, description="", tag_keys=()):
        self.name, self.value = name, 0

    def set_default_tags(self, tags):
        pass

    def inc(self, value, tags=None):
        self.value += value

    def set(self, value, tags=None):
        self.value = value


def test_the_processor_stage_makes_every_column_and_the_job_and_metrics_read_them(tiny_orthrus_dir, monkeypatch):
    """Through the processor's stages: the actor returns every processor column of the table with
    its type; the job's writer turns them into exactly the Parquet schema; the actor's counters sum
    the metric columns."""
    import ray.util.metrics

    from pipeline import OrthrusProcessorConfig
    from pipeline.actor.metrics import ActorMetrics
    from pipeline.actor.stage import GenerationStage
    from pipeline.processor.build import StageOptions, prepare_plan, stage_plan
    from pipeline.requests.prepare import prepare_batch

    monkeypatch.setattr(ray.util.metrics, "Counter", _Counter)
    monkeypatch.setattr(ray.util.metrics, "Gauge", _Counter)
    cfg = OrthrusProcessorConfig(model_source=str(tiny_orthrus_dir), apply_chat_template=False,
                                 engine_kwargs={"max_batch_size": 2, "dtype": "float32"})
    batch = pa.table({"prompt": ["def f(x):", "def g():", None],
                      "sampling_params": [{"max_tokens": 4, "logprobs": 1}, {"max_tokens": 3}, {"max_tokens": 3}]})
    stage = GenerationStage(stage_plan(cfg, StageOptions()))
    out = asyncio.run(stage(prepare_batch(batch, prepare_plan(cfg))))
    made = {f.name: f.type for f in out.schema}
    assert {f.name: f.type for f in S.GENERATED_FIELDS}.items() <= made.items()
    assert not [name for name in made if name.startswith(S.INTERNAL_PREFIX)]
    keyed = out.append_column("id", pa.array(["a", "b", "c"])).append_column("sample_index", pa.array([0, 0, 0]))
    written = S.to_output_table(keyed, S.output_schema([]))
    assert written.schema == S.output_schema([]) and written["num_completion_tokens"][0].as_py() > 0
    metrics = ActorMetrics("test")
    metrics.record(out, stage.loop.occupancy(), stage.reported)
    ok = out.filter(pa.compute.not_equal(out["finish_reason"], "error"))
    assert {c.metric: metrics.sums[c.name].value for c in C.COLUMNS if c.metric} == \
        {c.metric: St.column_sum(ok[c.name]) for c in C.COLUMNS if c.metric}
