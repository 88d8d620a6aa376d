"""Bad rows never take a neighbour down (issue 32), through the processor on a real local Ray head:
an upstream ``error`` column of another type, a ``sampling_params`` key we do not support, a
constraint over the grammar engine's limits or with no value, and one that compiles and fails only
mid-decode each end as their own row's error; rows in == rows out, and every other row's tokens
equal a run without the bad rows."""
from __future__ import annotations

import pytest

from test_structured_limits import EXPLODES

pytestmark = pytest.mark.slow

GOOD = [
    {"id": "g0", "prompt": "def add(a, b):", "sp": {"max_tokens": 12}},
    {"id": "g1", "prompt": "class Stack:", "sp": {"max_tokens": 12, "temperature": 0.8, "seed": 5}},
    {"id": "g2", "prompt": "Answer:", "sp": {"max_tokens": 12, "guided_choice": ["yes", "no", "maybe"]}},
    {"id": "g3", "prompt": "def fib(n):", "sp": {"max_tokens": 12, "presence_penalty": 0.0, "n": 1}},   # defaults
]
BAD = [
    {"id": "upstream", "prompt": "x", "error": 7, "sp": {"max_tokens": 12}},
    {"id": "penalty", "prompt": "x", "sp": {"max_tokens": 12, "presence_penalty": 0.5}},
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
    assert errors["penalty"] == "sampling_params.presence_penalty: not supported (got 0.5)"
    assert errors["choices"].startswith("sampling_params.guided_choice: choice has 5001 choices; the limit is ")
    assert errors["selfref"].startswith("sampling_params.guided_json: json_schema admits no JSON value")
    assert errors["explodes"].startswith("decoding failed: SamplingParams.structured.grammar: the grammar engine "
                                         "failed after ")
