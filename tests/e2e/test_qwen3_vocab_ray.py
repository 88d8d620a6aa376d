"""Qwen3's released tokenizer and vocabulary through the job, submitted with ``ray job submit`` to a
real local Ray head (``head`` and ``_submit`` of ``tests/e2e/test_pipeline_ray.py``).

Two jobs on the Qwen3-vocabulary model (``qwen3_orthrus_dir``): one applies the chat template with
``prompt.enable_thinking: false``; one feeds raw prompts ending in the model's chain tokens, so that
EOS ids, skipped special tokens and stop strings inside split characters happen deterministically.
Both ask ``sampling.n: 2`` and audit every greedy row (``audit.fraction: 1.0``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from transformers import AutoTokenizer

from jobs.make_qwen3_test_model import ENDOFTEXT, IM_END
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from support.qwen3_chat import (ASSISTANT, END_THINK, ENDOFTEXT_PROMPT, ENDOFTEXT_TEXT, IM_END_PROMPT, IM_END_TEXT,
                                 IM_START, NL, NL2, THINK)
from support.ray_head import WAIT_FOR_BOTH_ACTORS, submit

MSG_TYPE = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
MAX_NEW = 24


def _run_job(head, d: Path, model_dir: Path, rows: dict, **sections) -> dict[tuple[str, int], dict]:
    """Write one input shard, submit the job, → its output rows by (id, sample_index)."""
    (d / "in").mkdir(parents=True)
    pq.write_table(pa.table(rows), d / "in" / "rows.parquet")
    cfg = {"input": {"paths": [str(d / "in")]}, "output": {"path": str(d / "out")}, "model": {"path": str(model_dir)},
           "audit": {"fraction": 1.0}, "resources": {"replicas": 1},
           "engine": {"max_batch_size": 4, "batch_size": 16, "dtype": "float32"}, **sections}
    (d / "job.yaml").write_text(yaml.safe_dump(cfg, allow_unicode=True))
    proc = submit(head, d / "job.yaml", env_vars=WAIT_FOR_BOTH_ACTORS)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((d / "out" / "summary.json").read_text())
    assert summary["run"]["complete"] and summary["rows"]["error"] == 0
    return {(r["id"], r["sample_index"]): r for r in pq.read_table(d / "out" / "data").to_pylist()}


# ---------------------------------------------------------------- chat template, thinking off

CHAT_ROWS = {
    "id": ["greedy", "messages", "sampled", "derived"],
    "prompt": ["Hello, world!", None, "Tell me a story.", "写一首诗"],
    "messages": pa.array([None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}],
                          None, None], MSG_TYPE),
    "temperature": pa.array([None, None, 0.9, 0.7], pa.float64()),
    "top_p": pa.array([None, None, 0.9, None], pa.float64()),
    "top_k": pa.array([None, None, 40, None], pa.int64()),
    "max_new_tokens": pa.array([None, 3, None, 5], pa.int64()),
    "seed": pa.array([None, None, 11, None], pa.int64()),
}


@pytest.fixture(scope="module")
def chat_job(head, qwen3_orthrus_dir, tmp_path_factory):
    return _run_job(head, tmp_path_factory.mktemp("qwen3-chat"), qwen3_orthrus_dir, CHAT_ROWS,
                    prompt={"enable_thinking": False}, sampling={"n": 2, "max_new_tokens": 6, "seed": 5})


def _chat_prompt(tok, i: int) -> list[int]:
    msgs = CHAT_ROWS["messages"][i].as_py() or [{"role": "user", "content": CHAT_ROWS["prompt"][i]}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def _column(name: str, i: int, default):
    value = CHAT_ROWS[name][i]
    value = value.as_py() if hasattr(value, "as_py") else value
    return default if value is None else value


def test_chat_rows_equal_the_engine_fed_the_templated_prompt(chat_job, qwen3_orthrus_dir):
    """Each sample's completion is what the engine makes of the chat-templated prompt (with its
    empty thinking block) under the row's own sampling columns and seed."""
    tok = AutoTokenizer.from_pretrained(str(qwen3_orthrus_dir))
    engine = OrthrusEngine(OrthrusForCausalLM.from_pretrained(str(qwen3_orthrus_dir), dtype=torch.float32),
                           max_batch_size=4)
    for i, rid in enumerate(CHAT_ROWS["id"]):
        prompt = _chat_prompt(tok, i)
        assert prompt[-7:] == [IM_START, ASSISTANT, NL, THINK, NL2, END_THINK, NL2]   # + an empty thinking block
        rows = [chat_job[(rid, s)] for s in (0, 1)]
        params = [SamplingParams(temperature=_column("temperature", i, 0.0), top_p=_column("top_p", i, 1.0),
                                 top_k=_column("top_k", i, 0), max_new_tokens=_column("max_new_tokens", i, 6),
                                 seed=r["seed"]) for r in rows]
        outs = engine.generate([prompt, prompt], params)
        for r, out in zip(rows, outs):
            assert r["num_prompt_tokens"] == len(prompt)
            assert r["reasoning"] is None and r["num_reasoning_tokens"] is None     # thinking off: no phase
            assert (r["completion"], r["num_completion_tokens"], r["finish_reason"]) == \
                (tok.decode(out.token_ids, skip_special_tokens=True), len(out.token_ids), out.finish_reason)


def test_chat_rows_samples_seeds_and_audit(chat_job):
    assert len(chat_job) == 8 and {s for _, s in chat_job} == {0, 1}
    greedy, sampled = chat_job[("greedy", 0)], chat_job[("sampled", 0)]
    assert chat_job[("greedy", 1)]["completion"] == greedy["completion"]         # greedy: n copies
    assert chat_job[("sampled", 1)]["completion"] != sampled["completion"]       # sampled: n draws
    assert (sampled["seed"], chat_job[("sampled", 1)]["seed"]) == (11, 12)       # the row's seed + index
    assert chat_job[("derived", 0)]["seed"] != chat_job[("derived", 1)]["seed"]
    assert chat_job[("messages", 0)]["num_completion_tokens"] == 3               # per-row max_new_tokens
    for (rid, _), r in chat_job.items():
        audited = rid in ("greedy", "messages")
        assert r["audit_match"] is (True if audited else None), r


# ---------------------------------------------------------------- raw prompts: EOS ids, special tokens, stops

RAW_ROWS = {
    "id": ["im_end", "endoftext", "split", "inside", "special", "random"],
    "prompt": [IM_END_PROMPT, ENDOFTEXT_PROMPT, IM_END_PROMPT, IM_END_PROMPT, IM_END_PROMPT, "Hello, world!"],
    "temperature": pa.array([None, 1.0, None, 0.8, None, None], pa.float64()),
    "stop": pa.array([None, None, ["龘"], ["好龘"], ["龘🦜", "never"], None], pa.list_(pa.string())),
    "logprobs": pa.array([0, 0, None, None, None, None], pa.int64()),   # so the output holds the token ids
}
# (completion, finish_reason, the EOS that ended it or None, completion tokens) per id
RAW_EXPECTED = {"im_end": (IM_END_TEXT, "stop", IM_END, 8), "endoftext": (ENDOFTEXT_TEXT, "stop", ENDOFTEXT, 3),
                "split": ("你好", "stop", None, 1), "inside": ("你", "stop", None, 0),
                "special": ("你好", "stop", None, 1)}


@pytest.fixture(scope="module")
def raw_job(head, qwen3_orthrus_dir, tmp_path_factory):
    return _run_job(head, tmp_path_factory.mktemp("qwen3-raw"), qwen3_orthrus_dir, RAW_ROWS,
                    prompt={"chat_template": "off"}, sampling={"n": 2, "max_new_tokens": MAX_NEW})


def test_raw_rows_end_on_either_eos_and_at_split_stop_strings(raw_job):
    assert len(raw_job) == 12
    for rid, (text, reason, eos, n_tokens) in RAW_EXPECTED.items():
        for s in (0, 1):              # sampled or greedy, the chains are deterministic
            r = raw_job[(rid, s)]
            assert (r["completion"], r["finish_reason"], r["error"]) == (text, reason, None), r
            assert "<|im_end|>" not in r["completion"] and "<|box_start|>" not in r["completion"]
            assert r["num_completion_tokens"] == n_tokens, r     # an EOS counts, a stop string's tokens do not
            if eos is not None:                                  # the row's last token is its EOS
                assert r["generated_token_ids"][-1] == eos and len(r["token_logprobs"]) == n_tokens, r
    random = [raw_job[("random", s)] for s in (0, 1)]
    assert all(r["finish_reason"] == "length" and r["num_completion_tokens"] == MAX_NEW for r in random)
    assert all(r["audit_match"] is (None if RAW_ROWS["temperature"][i].as_py() else True)
               for i, rid in enumerate(RAW_ROWS["id"]) for r in (raw_job[(rid, 0)], raw_job[(rid, 1)]))
