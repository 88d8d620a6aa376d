"""The compiled step (``OrthrusEngine(compile=True)``, ``model/compiled.py``): inductor's kernels give
the eager engine's tokens, token for token, in float64 and float32, in every mode, on the static
path (what CUDA graphs capture) and the eager one, and keep the static path's host-sync budget.

The compiled pieces are shape-generic (four graphs per dtype, shared by every engine in the process),
so the first test pays the compile (tens of seconds cold on a loaded 2-core CPU; seconds with
inductor's disk cache) and the rest reuse it. Marked slow.
"""
from __future__ import annotations

import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from orthrus.model import compiled
from orthrus.testing.host_syncs import count_host_reads
from support.tiny_models import tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10)
SAMPLED = [SamplingParams(temperature=0.9, top_k=20, top_p=0.95, max_new_tokens=10, seed=i) for i in range(3)]


def _engine(model, compile: bool, static: bool = True) -> OrthrusEngine:
    # adaptive_verify off: its budget follows wall time (the tokens are the same either way)
    return OrthrusEngine(model, max_batch_size=2, static_shapes=static, compile=compile, adaptive_verify=False)


def _tokens(engine: OrthrusEngine, params, speculative) -> list[list[int]]:
    return [r.token_ids for r in engine.generate(PROMPTS, params, speculative=speculative)]


@pytest.fixture(scope="module")
def model64():
    return tiny_model(seed=3, diff_noise=0.3, scale=4.0)


@pytest.mark.parametrize("speculative", [True, False, "auto"], ids=["spec", "ar", "auto"])
def test_compiled_equals_eager_greedy_float64(model64, speculative):
    engine = _engine(model64, compile=True)
    got = _tokens(engine, GREEDY, speculative)
    assert got == _tokens(_engine(model64, compile=False, static=False), GREEDY, speculative)
    # ... and plain AR's tokens: speculation with compile on is lossless too
    assert got == _tokens(_engine(model64, compile=True, static=False), GREEDY, False)
    assert engine.compile and engine.runner.layer_fns is compiled.layer_fns(torch.float64)


def test_compile_time_is_counted_and_graphs_are_few(model64):
    model = tiny_model(seed=5, diff_noise=0.3, dtype=torch.float64)
    before = compiled.graphs_compiled()
    engine = _engine(model, compile=True)
    for speculative in (True, False):
        _tokens(engine, GREEDY, speculative)
    # the four pieces (before/after attention x the two views), compiled once in this process
    assert compiled.graphs_compiled() - before <= 4
    assert (engine.stats.compile_ms > 0) == (compiled.graphs_compiled() > before)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "ar"])
def test_compiled_equals_eager_greedy_float32(speculative):
    model = tiny_model(seed=3, diff_noise=0.3, scale=4.0, dtype=torch.float32)
    got = _tokens(_engine(model, compile=True), GREEDY, speculative)
    assert got == _tokens(_engine(model, compile=False), GREEDY, speculative)
    assert got == _tokens(_engine(model, compile=False), GREEDY, False)


@pytest.mark.parametrize("speculative", [True, False], ids=["spec", "ar"])
def test_compiled_equals_eager_seeded_sampling(model64, speculative):
    got = _tokens(_engine(model64, compile=True), SAMPLED, speculative)
    assert got == _tokens(_engine(model64, compile=False), SAMPLED, speculative)
    assert len({tuple(t) for t in got}) > 1            # the seeds differ, so do the samples


def test_compiled_path_keeps_one_host_read_per_step(model64):
    engine = _engine(model64, compile=True)
    engine.generate(PROMPTS, GREEDY)                  # compiles (the compiler reads values; steps do not)
    first = engine.stats
    with count_host_reads() as reads:
        engine.generate(PROMPTS, GREEDY)
    stats = engine.stats - first
    assert stats.compile_ms == 0                      # nothing new compiled
    assert stats.iterations > 3
    # the budget of test_host_syncs: one read per step that reads, one copy per such step and admission
    assert dict(reads) == {"cpu": stats.read_steps, "h2d_async": stats.read_steps + stats.admitting_steps}


def test_compile_setting_resolves_per_device(model64, tmp_path, monkeypatch):
    assert not OrthrusEngine(model64).compile and OrthrusEngine(model64).settings.compile is False
    assert OrthrusEngine(model64, compile=True).compile and not OrthrusEngine(model64, compile=True).static_shapes
    with pytest.raises(ValueError, match="compile must be"):
        OrthrusEngine(model64, compile="yes")
    monkeypatch.setenv(compiled.CACHE_ENV, "")       # unset (restored after the test)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compiled.use_local_cache() == str(tmp_path / "orthrus" / "inductor")


def test_the_gpu_checks_compiled_steps_run_here():
    """``jobs.gpu_check``'s compiled steps, whose code its CPU smoke run skips (a cold compile): the
    exactness step reports every case equal, and the cost grid measures a compiled AR step and cycle."""
    from jobs import gpu_costs, gpu_exactness
    from orthrus import OrthrusForCausalLM
    from support.paths import REPO

    model_dir, shards = str(REPO / "models" / "tiny-orthrus-py"), str(REPO / "examples" / "shards")
    prompts = gpu_exactness.load_prompts(model_dir, shards, 3)
    report = gpu_exactness.fp32_compiled_vs_eager(model_dir, prompts, "cpu", 6)
    for key in ("fp32_greedy_compiled_vs_eager", "fp32_greedy_ar_compiled_vs_eager", "fp32_sampled_compiled_vs_eager",
                "fp32_greedy_compiled_speculative_vs_ar"):
        assert report[key] == {"rows_equal": 1.0, "first_divergence_at_token": None}, (key, report)
    model = OrthrusForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    cell = gpu_costs.step_costs(model, prompts, (2,), (4,), "compiled", 1)["B=2"]
    assert cell["ar_ms"] > 0 and cell["ar_tokens_per_s"] > 0 and cell["K=4"]["R"] > 0
