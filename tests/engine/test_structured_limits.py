"""A constraint's limits are its own request's problem (issue 32): what can be known before any token
is refused at ``add_request`` naming the field and the limit; a grammar that still fails mid-decode
ends only its row (finish reason "error"), and every other row decodes token for token as it does
without it; a constraint whose language is empty (or only the empty text) is refused."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from orthrus import ConstraintError, OrthrusEngine, SamplingParams
from orthrus.engine.host.grammar_limits import MAX_CHOICES, MAX_OPTIONAL_PROPERTIES, admits_a_value
from support.constraints import EXPLODES, EXPLODES_AT_ONCE, PERSON, PROMPTS
from support.paths import TOKENIZER_DIR
from support.tiny_models import tiny_model


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=5, vocab=4097, eos=[4095, 4093], block_size=4, diff_noise=0.5, scale=20.0)


def _rows(bad: dict | None) -> list[tuple[list[int], SamplingParams]]:
    """Neighbours of every kind (unconstrained greedy and seeded-sampled, constrained JSON, choice,
    regex) around an optional bad row in the middle."""
    p = lambda s=None, **kw: SamplingParams(max_new_tokens=20, structured=s, **kw)  # noqa: E731
    rows = [(PROMPTS[0], p()), (PROMPTS[1], p({"json_schema": PERSON})),
            (PROMPTS[2], p(temperature=0.8, seed=7)), (PROMPTS[3], p({"choice": ["yes", "no", "maybe"]})),
            (PROMPTS[1], p({"regex": "[a-z]{1,5}( [a-z]{1,5}){0,2}\\."}))]
    if bad is not None:
        rows.insert(2, (PROMPTS[0], p(bad)))
    return rows


@pytest.mark.parametrize("speculative", [True, False, "auto"])
@pytest.mark.parametrize("bad", [EXPLODES, EXPLODES_AT_ONCE], ids=["mid-decode", "first-token"])
def test_a_grammar_failing_mid_decode_ends_only_its_row(model, tok, speculative, bad):
    def run(rows):
        engine = OrthrusEngine(model, max_batch_size=4, tokenizer=tok, speculative=speculative)  # refills
        ids = [engine.add_request(prompt, params) for prompt, params in rows]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step())   # never EngineStepError
        return [done[i] for i in ids], engine

    alone, _ = run(_rows(None))
    outs, engine = run(_rows(bad))
    assert len(outs) == len(alone) + 1                                  # rows in == rows out
    failed = outs.pop(2)
    assert failed.finish_reason == "error" and failed.error.startswith(
        "SamplingParams.structured.grammar: the grammar engine failed after ")
    assert "items" in failed.error
    rows = _rows(None)
    for (_, params), got, want in zip(rows, outs, alone):               # neighbours: bit-identical
        assert got.error is None
        if speculative == "auto" and not params.greedy:
            # "auto" picks block sizes by occupancy, and the failed row changed it: a seeded sampled
            # row follows the switching pattern (same distribution, not the same bits; docs/engine.md)
            continue
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    assert engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=3))[0].finish_reason == "length"


def test_a_failed_row_adds_no_host_read_for_the_others(model, tok):
    from orthrus.testing.host_syncs import count_host_reads

    def reads(rows):
        engine = OrthrusEngine(model, max_batch_size=8, tokenizer=tok)
        with count_host_reads() as counted:
            engine.generate([r[0] for r in rows], [r[1] for r in rows])
        return counted["cpu"] - engine.stats.iterations, counted["d2h"] - engine.stats.iterations

    # per iteration: one read, and one more (the drafts) while a row is constrained; no extra for a failure
    assert reads(_rows(EXPLODES)) == reads(_rows(None))


@pytest.mark.parametrize("structured, field, says", [
    ({"choice": [f"c{i}" for i in range(5001)]}, "choice", f"has 5001 choices; the limit is {MAX_CHOICES}"),
    ({"json_schema": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(3000)}}},
     "json_schema", f"3000 optional properties at #; the limit is {MAX_OPTIONAL_PROPERTIES}"),
    ({"json_schema": {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}},
     "json_schema", "admits no JSON value"),
    ({"json_schema": {"$ref": "#"}}, "json_schema", "admits no JSON value"),
    ({"json_schema": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "json_schema", "admits no JSON value"),
    ({"regex": "a{0}"}, "regex", "admits no text but the empty one"),
], ids=["choices", "optional-properties", "required-recursion", "self-ref", "mutual-refs", "empty-regex"])
def test_limits_and_empty_languages_are_refused_at_add_request(model, tok, structured, field, says):
    engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok)
    with pytest.raises(ConstraintError, match=rf"^SamplingParams\.structured\.{field} ") as err:
        engine.add_request(PROMPTS[0], SamplingParams(structured=structured))
    assert says in str(err.value) and err.value.field == f"structured.{field}"
    assert not engine.has_unfinished_requests()


def test_limits_leave_room_for_what_fits(model, tok):
    """Just under each limit is accepted and generates (the limits are not set absurdly low)."""
    engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok)
    props = {f"p{i}": {"type": "integer"} for i in range(MAX_OPTIONAL_PROPERTIES)}
    ok = [{"choice": [f"c{i}" for i in range(MAX_CHOICES)]}, {"json_schema": {"type": "object", "properties": props}},
          {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#"}}}}]     # optional recursion: fine
    outs = engine.generate([PROMPTS[0]] * 3, [SamplingParams(max_new_tokens=12, structured=s) for s in ok])
    assert all(o.finish_reason in ("stop", "length") and o.error is None for o in outs)


@pytest.mark.parametrize("schema, has_value", [
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
    ({"type": "object", "properties": {"a": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["a"]}, True),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": "array", "items": {"$ref": "#"}}, True),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"}, True),
    ({"allOf": [{"type": "string"}, False]}, False),
    ({"type": ["object", "string"], "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, True),
    (True, True), (False, False),
])
def test_the_emptiness_check_refuses_only_schemas_without_a_finite_value(schema, has_value):
    assert admits_a_value(schema) is has_value
