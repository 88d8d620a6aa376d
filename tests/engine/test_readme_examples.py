"""The README's Python examples run as written (read from README.md, not copied), and every one of
them is run by some test; and ``RequestOutput.text`` is the decoded completion whenever the engine
has a tokenizer, as vLLM's is, not only for rows cut by a stop string.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from support.paths import REPO, TOKENIZER_DIR
from support.readme import python_blocks

# Each README section holding a Python block -> the test that runs that block.
RUN_BY = {"Use it in your own pipeline": "tests/e2e/test_processor_ray.py::test_user_pipeline_equals_the_job_on_the_same_rows",
          "Engine API": "tests/engine/test_readme_examples.py::test_the_engine_api_example_runs_as_written"}


def test_every_python_block_of_the_readme_is_run_by_a_test():
    assert set(python_blocks()) == set(RUN_BY), "a new README Python block needs a test that runs it (RUN_BY)"
    for section, test in RUN_BY.items():
        path, _, name = test.partition("::")
        source = (REPO / path).read_text()
        assert f"def {name}(" in source and f'python_blocks()["{section}"]' in source, test


def test_the_engine_api_example_runs_as_written(monkeypatch):
    monkeypatch.chdir(REPO)                       # its paths are relative to the repository, as the README says
    scope: dict = {}
    exec(compile(python_blocks()["Engine API"], "README.md (Engine API)", "exec"), scope)
    tok, results, out = scope["tok"], scope["results"], scope["out"]
    assert len(results) == 2 and all(r.finish_reason in ("stop", "length") for r in results)
    for r in (*results, out):       # every row's text is its completion, decoded (no stop string cut these)
        ids = r.token_ids[:-1] if r.finish_reason == "stop" and isinstance(r.stop_reason, int) else r.token_ids
        assert r.text is not None and r.text == tok.decode(ids, skip_special_tokens=True), r


@pytest.fixture(scope="module")
def engine():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    model = OrthrusForCausalLM.from_pretrained(str(TOKENIZER_DIR), dtype=torch.float32)
    return OrthrusEngine(model, max_batch_size=4, tokenizer=tok), tok


def test_text_leaves_out_the_stop_token_that_ended_the_row(engine):
    """A stop token id that is an ordinary token (not special, so decoding would keep it) ends the
    row and stays in ``token_ids``, but not in ``text``: the job's ``generated_text`` is this text."""
    engine, tok = engine
    prompt = tok("def add(a, b):")["input_ids"]
    free = engine.generate([prompt], SamplingParams(max_new_tokens=12))[0]
    stop_id = free.token_ids[3]
    assert stop_id not in tok.all_special_ids
    cut = engine.generate([prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_id,)))[0]
    first = free.token_ids.index(stop_id)
    assert (cut.finish_reason, cut.stop_reason, cut.token_ids) == ("stop", stop_id, free.token_ids[:first + 1])
    assert cut.text == tok.decode(free.token_ids[:first], skip_special_tokens=True)
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True)


def test_no_tokenizer_no_text():
    model = OrthrusForCausalLM.from_pretrained(str(TOKENIZER_DIR), dtype=torch.float32)
    out = OrthrusEngine(model, max_batch_size=2).generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0]
    assert out.text is None and len(out.token_ids) > 0
