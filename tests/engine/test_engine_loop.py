"""The actor's engine thread (pipeline/actor/engine_loop.py): several batches share one streaming engine.

No Ray here (the async actor runs on a real Ray head in tests/e2e/test_pipeline_ray.py and
tests/e2e/test_faults_ray.py); this drives the loop from asyncio the way Ray Data's async actor does.
"""
from __future__ import annotations

import asyncio

import pytest

from orthrus import OrthrusEngine, SamplingParams
from pipeline.actor.engine_loop import EngineLoop, GroupFailed
from support.tiny_models import tiny_model

POISON = 62


class PoisonEngine(OrthrusEngine):
    """A real engine whose decode step fails while a prompt holding ``POISON`` is in a slot (test-only)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        execute = self.runner.execute

        def poisoned(step):
            if any(POISON in self.scheduler.table.requests[s].prompt for s in step.rows.tolist()):
                raise RuntimeError("poison row in the batch")
            return execute(step)
        self.runner.execute = poisoned


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=4, diff_noise=0.2, scale=3.0)


def _batch(i: int, n: int = 5) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [[1 + i, 2 + j, 3, 4 + (i * j) % 7][: 1 + (i + j) % 4] for j in range(n)]
    return prompts, [SamplingParams(max_new_tokens=4 + 3 * ((i + j) % 5), temperature=0.7 * (j % 2), seed=i * 10 + j)
                     for j in range(n)]


def test_concurrent_batches_share_the_engine_and_equal_separate_runs(model):
    loop = EngineLoop(OrthrusEngine(model, max_batch_size=3))
    batches = [_batch(i) for i in range(4)]

    async def main():
        return await asyncio.gather(*(loop.run(p, sp) for p, sp in batches))

    results = asyncio.run(main())
    for (prompts, params), outs in zip(batches, results):
        ref = OrthrusEngine(model, max_batch_size=3).generate(prompts, params)
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    occ = loop.occupancy()
    assert occ.stats.busy_slot_iterations > 0.8 * occ.stats.iterations * occ.slots   # slots stayed busy across batches


def test_a_failure_is_pinned_on_its_rows_only_when_they_run_alone(model):
    loop = EngineLoop(PoisonEngine(model, max_batch_size=4))
    good, params = _batch(1)
    bad = [[5, POISON, 7]] + good[1:]

    async def main():
        shared = await asyncio.gather(loop.run(bad, params), loop.run(good, params), return_exceptions=True)
        alone_bad = await asyncio.gather(loop.run(bad, params, exclusive=True), loop.run(good, params, exclusive=True),
                                         return_exceptions=True)
        return shared, alone_bad

    shared, alone = asyncio.run(main())
    assert isinstance(shared[0], GroupFailed) and not shared[0].alone      # failed beside others: not conclusive
    assert isinstance(alone[0], GroupFailed) and alone[0].alone and "poison" in str(alone[0].cause)
    ref = OrthrusEngine(model, max_batch_size=4).generate(good, params)
    assert [o.token_ids for o in alone[1]] == [r.token_ids for r in ref]  # the good batch alone is untouched
    # the engine is usable after failures
    assert [o.token_ids for o in asyncio.run(loop.run(good, params))] == [r.token_ids for r in ref]


def test_a_cancelled_batch_frees_its_slots(model):
    engine = OrthrusEngine(model, max_batch_size=2)
    loop = EngineLoop(engine)
    prompts, params = _batch(2)
    long = [SamplingParams(max_new_tokens=200, seed=1)] * len(prompts)

    async def main():
        task = asyncio.create_task(loop.run(prompts, long))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return await loop.run(prompts, params)

    outs = asyncio.run(main())
    assert [o.token_ids for o in outs] == [r.token_ids for r in OrthrusEngine(model, max_batch_size=2)
                                           .generate(prompts, params)]
