"""Qwen3's released tokenizer and 151,936-row vocabulary through the engine and the job's row
stages, without Ray.

The model (``qwen3_orthrus_dir``, built by ``jobs/make_qwen3_test_model.py``) is random except for
its chains: a prompt ending in a chain's first token continues with the chain and its EOS at any
temperature, which drives EOS ids, special tokens and characters split across byte-level tokens
deterministically through generation. The same features run through ``ray job submit`` in
``tests/e2e/test_qwen3_vocab_ray.py``.
"""
from __future__ import annotations

import asyncio
import json

import pyarrow as pa
import pytest
import torch
from transformers import AutoTokenizer

from jobs.make_qwen3_test_model import ENDOFTEXT, IM_END, MASK_TOKEN_ID, VOCAB_SIZE, chain_ids
from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from pipeline.actor.stage import GenerationStage, StagePlan
from pipeline.config import AuditConfig
from pipeline.inputs.preprocess import PreprocessPlan, preprocess_batch
from pipeline.requests.request import from_arrow
from pipeline.inputs.source import read_file
from pipeline.run.job import preflight
from support.job_inputs import job_config, write_shard
from support.oracles import OracleProposer
from support.qwen3_chat import (ASSISTANT, END_THINK, ENDOFTEXT_PROMPT, ENDOFTEXT_TEXT, IM_END_PROMPT, IM_END_TEXT,
                                 IM_START, NL, NL2, THINK, USER)
from support.tiny_models import hf_greedy, hf_twin

MAX_NEW = 24
# Slow as a module: its session fixture builds a model over Qwen3's 151,936-row vocabulary.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok(qwen3_orthrus_dir):
    return AutoTokenizer.from_pretrained(str(qwen3_orthrus_dir))


@pytest.fixture(scope="module")
def model(qwen3_orthrus_dir):
    return OrthrusForCausalLM.from_pretrained(str(qwen3_orthrus_dir), dtype=torch.float32)


def _generated(tok, name: str) -> list[int]:
    """The tokens a chain's prompt makes the model generate (its EOS last)."""
    return chain_ids(tok, name)[1:]


# ---------------------------------------------------------------- the tokenizer and the checkpoint

def test_the_released_qwen3_tokenizer(qwen3_tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    assert type(tok).__name__.startswith("Qwen2Tokenizer") and len(tok) == 151_669
    assert tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]) == \
        [ENDOFTEXT, IM_START, IM_END, THINK, END_THINK]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.convert_tokens_to_ids(["user", "assistant", "\u010a", "\u010a\u010a"]) == [USER, ASSISTANT, NL, NL2]
    assert "enable_thinking" in tok.chat_template


def test_checkpoint_has_qwen3_vocabulary_and_both_eos_ids(qwen3_orthrus_dir, model):
    cfg = json.loads((qwen3_orthrus_dir / "config.json").read_text())
    gen = json.loads((qwen3_orthrus_dir / "generation_config.json").read_text())
    assert (cfg["vocab_size"], cfg["mask_token_id"], cfg["eos_token_id"]) == (VOCAB_SIZE, MASK_TOKEN_ID, IM_END)
    assert sorted(gen["eos_token_id"]) == [ENDOFTEXT, IM_END]
    assert model.lm_head.weight.shape[0] == VOCAB_SIZE == model.model.embed_tokens.weight.shape[0]
    # <|endoftext|> is an EOS only through generation_config.json, as in the released checkpoints
    assert OrthrusEngine(model, max_batch_size=1).eos_token_ids == (ENDOFTEXT, IM_END)
    assert OrthrusForCausalLM(model.config).eos_token_ids == (IM_END,)


# ---------------------------------------------------------------- the chat template, as the job applies it

def _prepared(tmp_path, model_dir, **prompt) -> list[list[int]]:
    """Prompt token ids the job's preprocess stage hands the engine, per row."""
    cfg = job_config(tmp_path, model_dir, prompt=prompt)
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, cfg.sampling.n),
                             PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    return [r[0] for r in from_arrow(batch["__request"])]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_prompt_tokens_with_and_without_thinking(tmp_path, qwen3_orthrus_dir, tok, thinking):
    msgs = pa.array([None, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好"}]],
                    pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    write_shard(tmp_path, "a.parquet", id=["p", "m"], prompt=["Hello, world!", None], messages=msgs)
    prompts = _prepared(tmp_path, qwen3_orthrus_dir, enable_thinking=thinking)
    system = tok("system\nBe brief.", add_special_tokens=False)["input_ids"]
    # thinking off: the template closes an empty thinking block before the answer
    tail = [IM_START, ASSISTANT, NL] + ([] if thinking else [THINK, NL2, END_THINK, NL2])
    hello = [9707, 11, 1879, 0]
    assert prompts[0] == [IM_START, USER, NL, *hello, IM_END, NL, *tail]
    assert prompts[1] == [IM_START, *system, IM_END, NL, IM_START, USER, NL,
                          *tok("你好", add_special_tokens=False)["input_ids"], IM_END, NL, *tail]


def test_raw_prompts_keep_special_tokens_whole(tmp_path, qwen3_orthrus_dir, tok):
    write_shard(tmp_path, "a.parquet", id=["a", "b"], prompt=[IM_END_PROMPT, ENDOFTEXT_PROMPT])
    prompts = _prepared(tmp_path, qwen3_orthrus_dir, chat_template="off")
    assert [p[-1] for p in prompts] == [chain_ids(tok, "im_end")[0], chain_ids(tok, "endoftext")[0]]


# ---------------------------------------------------------------- EOS ids, stop strings, special tokens

@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_either_eos_id_ends_a_row(model, tok, speculative, temperature):
    engine = OrthrusEngine(model, max_batch_size=3, speculative=speculative, tokenizer=tok)
    prompts = [tok(p)["input_ids"] for p in (IM_END_PROMPT, ENDOFTEXT_PROMPT, "Hello, world!")]
    outs = engine.generate(prompts, [SamplingParams(temperature=temperature, max_new_tokens=MAX_NEW, seed=i)
                                     for i in range(3)])
    for out, name, eos in ((outs[0], "im_end", IM_END), (outs[1], "endoftext", ENDOFTEXT)):
        assert out.token_ids == _generated(tok, name)
        assert (out.finish_reason, out.stop_reason, out.token_ids[-1]) == ("stop", eos, eos)
    assert tok.decode(outs[0].token_ids, skip_special_tokens=True) == IM_END_TEXT
    assert tok.decode(outs[1].token_ids, skip_special_tokens=True) == ENDOFTEXT_TEXT
    # the random model, away from the chains: no EOS in MAX_NEW tokens
    assert outs[2].finish_reason == "length" and len(outs[2].token_ids) == MAX_NEW


def test_the_stop_characters_split_across_byte_level_tokens(tok):
    """龘 and 🦜 are each one character in two tokens; alone, neither token decodes to text."""
    for ch in ("龘", "🦜"):
        ids = tok(ch, add_special_tokens=False)["input_ids"]
        assert len(ids) == 2 and tok.decode(ids) == ch
        assert all("\ufffd" in tok.decode([i]) for i in ids)


# (stop, completion text before it, tokens kept): a stop completed by the second half of a split
# character; one that starts inside a two-character token; one spanning a skipped special token.
STOPS = [("龘", "你好", 1), ("好龘", "你", 0), ("龘🦜", "你好", 1), ("🦜世", "你好龘", 4)]


@pytest.mark.parametrize("oracle", [False, True])
@pytest.mark.parametrize("stop, before, keep", STOPS)
def test_stop_string_across_multibyte_tokens(model, tok, stop, before, keep, oracle):
    prompt = tok(IM_END_PROMPT)["input_ids"]
    gen = _generated(tok, "im_end")
    # the oracle proposes the chain itself: whole blocks are accepted, so the stop lands mid-block
    proposer = OracleProposer(prompt + gen, model.config.vocab_size) if oracle else None
    engine = OrthrusEngine(model, max_batch_size=2, tokenizer=tok, proposer=proposer)
    outs = engine.generate([prompt, prompt], [SamplingParams(max_new_tokens=MAX_NEW, stop=(stop, "never")),
                                              SamplingParams(max_new_tokens=MAX_NEW)])
    out = outs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", stop, before)
    assert out.token_ids == gen[:keep]
    assert before.startswith(tok.decode(out.token_ids, skip_special_tokens=True))
    assert outs[1].token_ids == gen                                     # the row without stops runs on
    assert outs[1].text == tok.decode(gen[:-1], skip_special_tokens=True)   # to its EOS, not in the text
    if oracle:
        assert out.stats.num_accepted_draft_tokens > 0


def test_detokenization_skips_special_tokens_only(model, tok):
    ids = _generated(tok, "im_end")
    assert "<|box_start|>" in tok.decode(ids) and "<|im_end|>" in tok.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == IM_END_TEXT
    assert tok.decode(_generated(tok, "endoftext"), skip_special_tokens=True) == ENDOFTEXT_TEXT


# ---------------------------------------------------------------- lossless over the 151,936-row vocabulary

def test_greedy_rows_equal_transformers_qwen3(model, tok):
    """Orthrus, speculative and plain AR, against transformers' own Qwen3 ``generate``: token for
    token, chain rows (ending in either EOS) and random rows alike, templated prompts included."""
    texts = [tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True,
                                     enable_thinking=False) for c in ("Hello, world!", "写一首诗")]
    prompts = [tok(t)["input_ids"] for t in (*texts, IM_END_PROMPT, ENDOFTEXT_PROMPT)]
    eos = (IM_END, ENDOFTEXT)
    hf = hf_twin(model)
    expected = [hf_greedy(hf, p, MAX_NEW, eos) for p in prompts]
    for speculative in (True, False):
        outs = OrthrusEngine(model, max_batch_size=4, speculative=speculative).generate(
            prompts, SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.token_ids for o in outs] == expected
    assert expected[2][-1] == IM_END and expected[3][-1] == ENDOFTEXT


def test_the_job_stage_detokenizes_and_audits(tmp_path, qwen3_orthrus_dir):
    """The generation actor's code in-process: completions without the EOS or skipped special
    tokens, every greedy row audited equal to plain AR."""
    write_shard(tmp_path, "a.parquet", id=["e", "t", "r"], prompt=[IM_END_PROMPT, ENDOFTEXT_PROMPT, "Hello, world!"])
    cfg = job_config(tmp_path, qwen3_orthrus_dir, prompt={"chat_template": "off"},
                  sampling={"max_new_tokens": MAX_NEW}, engine={"max_batch_size": 3, "dtype": "float32"})
    inputs = preflight(cfg).inputs
    batch = preprocess_batch(read_file(inputs, 0, 1), PreprocessPlan(inputs, cfg.model, cfg.prompt, cfg.sampling))
    stage = GenerationStage(StagePlan(model=cfg.model, engine=cfg.engine, use_gpu=False,
                                      audit=AuditConfig(fraction=1.0, max_batch_size=3)))
    rows = {r["id"]: r for r in asyncio.run(stage(batch)).to_pylist()}
    assert (rows["e"]["generated_text"], rows["e"]["finish_reason"]) == (IM_END_TEXT, "stop")
    assert (rows["t"]["generated_text"], rows["t"]["finish_reason"]) == (ENDOFTEXT_TEXT, "stop")
    assert rows["r"]["finish_reason"] == "length" and rows["r"]["num_generated_tokens"] == MAX_NEW
    assert all(r["audit_match"] is True for r in rows.values())


@pytest.mark.parametrize("structured, check", [
    ({"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer",
      "minimum": 0, "maximum": 9}}, "required": ["ok", "n"], "additionalProperties": False}},
     lambda t: set(json.loads(t)) == {"ok", "n"}),
    ({"choice": ["是", "否", "🦜"]}, lambda t: t in ("是", "否", "🦜"))])
def test_structured_output_over_qwen3s_vocabulary(model, tok, structured, check):
    """Grammar masks over 151,936 tokens (multi-byte characters split across byte-level tokens among
    them): speculative equals AR for greedy rows, and every row that stops is valid."""
    prompts = [tok(p)["input_ids"] for p in ("Answer:", IM_END_PROMPT, ENDOFTEXT_PROMPT)]
    params = [SamplingParams(max_new_tokens=MAX_NEW, structured=structured, temperature=t, seed=1) for t in (0.0, 1.0)]
    engine = OrthrusEngine(model, max_batch_size=4, tokenizer=tok)
    outs = {s: engine.generate(prompts * 2, [p for p in params for _ in prompts], speculative=s) for s in (True, False)}
    assert [o.token_ids for o in outs[True][:3]] == [o.token_ids for o in outs[False][:3]]   # greedy rows
    stopped = [o for rows in outs.values() for o in rows if o.finish_reason == "stop"]
    assert stopped and all(check(tok.decode(o.token_ids, skip_special_tokens=True)) for o in stopped)
