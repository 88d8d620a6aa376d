"""The decode loop reads the device exactly once per iteration (the packed result), in every mode."""
from __future__ import annotations

import pytest
import torch

from orthrus import OrthrusEngine, SamplingParams
from orthrus.testing.host_syncs import count_host_reads
from support.tiny_models import tiny_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13], [14, 15, 16, 17]]


def test_counter_sees_hidden_reads_and_restores_torch():
    t = torch.arange(4)
    with count_host_reads() as reads:
        t.sum().item()
        if t.any():
            t.tolist()
        int(t[0])
        t[torch.arange(2)] = -1                      # a Python number staged on the host (CUDA: a copy)
        t.index_fill_(0, torch.arange(2), -1)        # the same write with the scalar as a kernel argument
        t[torch.arange(2)] = torch.zeros(2, dtype=t.dtype)
    assert reads == {"item": 1, "__bool__": 1, "tolist": 1, "__int__": 1, "h2d_scalar": 1}
    assert "item" not in torch.Tensor.__dict__ and "__bool__" not in torch.Tensor.__dict__
    assert "__setitem__" not in torch.Tensor.__dict__


@pytest.mark.parametrize("speculative", [True, False, "auto"])
@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
def test_one_host_read_per_iteration(speculative, static, temperature):
    engine = OrthrusEngine(tiny_model(seed=2, diff_noise=0.3), max_batch_size=3, static_shapes=static)
    params = SamplingParams(temperature=temperature, top_k=10, max_new_tokens=16, seed=1)
    with count_host_reads() as reads:
        engine.generate(PROMPTS, params, speculative=speculative)
    assert engine.stats.iterations > 5
    # One read per step that reads (every iteration, and steps that only sample completed prompts'
    # first tokens: at most one per admitting step); one host→device copy per such step (its indices
    # and prompt chunks) and one per admitting step (every admitted request's settings), none from
    # pageable memory.
    stats = engine.stats
    assert stats.iterations <= stats.read_steps <= stats.iterations + stats.admitting_steps
    assert dict(reads) == {"cpu": stats.read_steps, "h2d_async": stats.read_steps + stats.admitting_steps}


def test_an_admitting_step_makes_one_host_to_device_copy():
    engine = OrthrusEngine(tiny_model(seed=2, diff_noise=0.3), max_batch_size=4, static_shapes=False)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=12, stop_token_ids=(1, 2, 3)))
    engine.step()
    for i, prompt in enumerate(PROMPTS[1:3]):          # admitted mid-flight, one per step
        engine.add_request(prompt, SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=12, seed=i))
        with count_host_reads() as reads:
            engine.step()
        assert dict(reads) == {"cpu": 1, "h2d_async": 2}     # the iteration's indices + the admission
    with count_host_reads() as reads:
        engine.step()
    assert dict(reads) == {"cpu": 1, "h2d_async": 1}
    assert engine.stats.admitting_steps == 3
