"""Checkpoint layout, loading plain Qwen3 checkpoints, and clear errors for bad arguments."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import Qwen3ForCausalLM

from orthrus import OrthrusEngine, OrthrusForCausalLM, SamplingParams
from support.tiny_models import hf_twin, tiny_config, tiny_model

DIFF = ["q_proj_diff", "k_proj_diff", "v_proj_diff", "o_proj_diff", "q_norm_diff", "k_norm_diff"]


def test_save_load_round_trip_keeps_outputs_and_released_layout(tmp_path):
    model = tiny_model(seed=5, diff_noise=0.3, dtype=torch.float32)
    model.save_pretrained(str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["OrthrusLM"]
    assert cfg["block_size"] == 4 and cfg["mask_token_id"] == 63
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    for layer in range(2):
        for name in DIFF:
            assert f"model.layers.{layer}.self_attn.{name}.weight" in keys
        assert f"model.layers.{layer}.self_attn.q_proj.weight" in keys
    loaded = OrthrusForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    prompts, params = [[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=16)
    a = OrthrusEngine(model, max_batch_size=2).generate(prompts, params)
    b = OrthrusEngine(loaded, max_batch_size=2).generate(prompts, params)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.stats.accept_length_histogram for r in a] == [r.stats.accept_length_histogram for r in b]


def test_plain_qwen3_checkpoint_loads_with_twins_copied(tmp_path):
    cfg = tiny_config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(6)
    Qwen3ForCausalLM(cfg).save_pretrained(str(tmp_path))
    model = OrthrusForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64)
    for layer in model.model.layers:
        for name in DIFF:
            twin, ar = getattr(layer.self_attn, name), getattr(layer.self_attn, name.removesuffix("_diff"))
            assert torch.equal(twin.weight, ar.weight)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    hf = Qwen3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float64)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    torch.testing.assert_close(model(ids), hf(ids).logits)
    torch.testing.assert_close(hf_twin(model)(ids).logits, hf(ids).logits)


def test_checkpoint_code_is_never_executed(tmp_path):
    tiny_model(seed=7, dtype=torch.float32).save_pretrained(str(tmp_path))
    marker = tmp_path / "PWNED"
    (tmp_path / "modeling_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.Evil"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    OrthrusForCausalLM.from_pretrained(str(tmp_path))
    assert not marker.exists()


def test_bad_checkpoint_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        OrthrusForCausalLM.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type"):
        OrthrusForCausalLM.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("prompts, params, message", [
    ([], SamplingParams(), "prompts is empty"),
    ([[1, 2], []], SamplingParams(), "prompt 1: prompt is empty"),
    ([[1] * 300], SamplingParams(), "prompt 0: prompt has 300 tokens; the context limit max_seq_len=256"),
    ([[1, 64]], SamplingParams(), r"token ids must be ints in \[0, 64\)"),
    ([[1], [2]], [SamplingParams()], "got 1 SamplingParams for 2 prompts"),
])
def test_bad_generate_arguments(prompts, params, message):
    engine = OrthrusEngine(tiny_model(seed=8), max_batch_size=2)
    with pytest.raises(ValueError, match=message):
        engine.generate(prompts, params)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(max_new_tokens=10**9), "max_new_tokens"),
    (dict(seed=-1), "seed"), (dict(stop_token_ids=(-3,)), "stop_token_ids"),
])
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_invalid_engine_arguments():
    model = tiny_model(seed=9)
    with pytest.raises(ValueError, match="max_batch_size"):
        OrthrusEngine(model, max_batch_size=0)
    with pytest.raises(ValueError, match="block_size"):
        OrthrusEngine(model, block_size=1)


def test_base_training_job_writes_through_the_one_checkpoint_writer(tmp_path):
    import argparse

    from jobs.train_base import save_final

    cfg = tiny_config()
    cfg.tie_word_embeddings, cfg.bos_token_id, cfg.pad_token_id = True, 1, 0
    torch.manual_seed(3)
    base = Qwen3ForCausalLM(cfg).eval()
    save_final(base, None, argparse.Namespace(out=str(tmp_path), no_twins=False), {"steps": 0})
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["OrthrusLM"]
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == 0o644
    model = OrthrusForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert model.block_size == 4 and model.mask_token_id == 63
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(model(ids), base.to(torch.bfloat16).float()(ids).logits)   # bf16 weights
