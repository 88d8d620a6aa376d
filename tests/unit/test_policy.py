"""speculative="auto": the policy picks the fastest block size (or AR) per occupancy from measurements.

Driven by a simulated device so the checks are deterministic: a cycle of block size k costs
``overhead + 2 * forward(k * b)`` and an AR step ``overhead + forward(b)``, where a forward over n
tokens is flat while memory bound and linear once compute bound; tokens per cycle follow a fixed
per-position acceptance. (The engine-level test in test_engine_greedy.py runs the real thing.)
"""
from __future__ import annotations

import pytest

from orthrus.engine.host.policy import AR, VERIFY_EIGHTHS, SpeculationPolicy, VerifyPolicy, halving_block_sizes
from orthrus.engine.step import verify_budget

ACCEPT = [0.83, 0.42, 0.37, 0.21, 0.35, 0.6, 1.0]          # the bundled model's per-position rates


def tokens_per_cycle(k: int) -> float:
    expected, alive = 1.0, 1.0
    for rate in ACCEPT[: k - 1]:
        alive *= rate
        expected += alive
    return expected


def seconds(arm: int, b: int, knee: int = 32) -> float:
    forward = lambda n: max(1.0, n / knee)                  # noqa: E731 - flat, then linear
    return 0.2 + (forward(b) if arm == AR else 2 * forward(arm * b))


def simulate(policy: SpeculationPolicy, b: int, iterations: int) -> float:
    """Tokens per simulated second over ``iterations`` decisions at occupancy ``b``."""
    time = tokens = 0.0
    for _ in range(iterations):
        arm = policy.choose(b)
        t = seconds(arm, b)
        got = b * (1.0 if arm == AR else tokens_per_cycle(arm))
        policy.observe(arm, b, t, round(got), b)
        time, tokens = time + t, tokens + got
    return tokens / time


def best_fixed(b: int) -> tuple[int, float]:
    rates = {a: (1.0 if a == AR else tokens_per_cycle(a)) * b / seconds(a, b) for a in (AR, 8, 4, 2)}
    arm = max(rates, key=rates.get)
    return arm, rates[arm]


def test_arms_are_halving_block_sizes():
    assert halving_block_sizes(8) == (8, 4, 2) and halving_block_sizes(32) == (32, 16, 8, 4, 2)
    assert halving_block_sizes(3) == (3,) and SpeculationPolicy((8, 4, 2)).arms == (AR, 8, 4, 2)
    with pytest.raises(ValueError):
        SpeculationPolicy((1,))


def test_explores_each_arm_then_exploits():
    # 1 warm-up run (not a cost sample) + min_samples=3 samples per arm before a ratio counts
    policy = SpeculationPolicy((8, 4, 2))
    first = []
    for _ in range(16):
        arm = policy.choose(1)
        first.append(arm)
        policy.observe(arm, 1, seconds(arm, 1), round(tokens_per_cycle(arm)) if arm else 0, 1)
    assert first == [8] * 4 + [AR] * 4 + [4] * 4 + [2] * 4
    assert policy.choose(1) == 8 and (8, 1) in policy.cost


@pytest.mark.parametrize("b", [1, 4, 8, 16, 64, 256])
def test_auto_tracks_the_best_arm_and_never_loses_to_ar(b):
    policy = SpeculationPolicy((8, 4, 2))
    rate = simulate(policy, b, 8000)    # one engine; exploration is a one-off cost
    arm, best = best_fixed(b)
    ar_rate = b / seconds(AR, b)
    assert max(policy.chosen, key=policy.chosen.get) == arm
    assert rate >= 0.95 * best and rate >= 0.97 * ar_rate, (rate, best, ar_rate)


def test_the_choice_moves_with_occupancy():
    # memory bound: the largest block; compute bound: plain AR; in between, a smaller block
    assert best_fixed(1)[0] == 8 and best_fixed(256)[0] == AR and best_fixed(8)[0] == 4
    policy = SpeculationPolicy((8, 4, 2))
    for b in (1, 8, 256):
        simulate(policy, b, 600)
    assert [policy.best(b) for b in (1, 8, 256)] == [8, 4, AR]


def test_a_new_occupancy_borrows_ratios_instead_of_probing():
    policy = SpeculationPolicy((8, 4, 2))
    simulate(policy, 1, 200)
    before = dict(policy.chosen)
    assert [policy.choose(2) for _ in range(20)] == [8] * 20   # bucket 2 unmeasured: bucket 1's ratios decide
    assert policy.chosen[AR] == before[AR] and (AR, 2) not in policy.cost


def test_falling_acceptance_moves_auto_to_ar():
    policy = SpeculationPolicy((8, 4, 2))
    simulate(policy, 1, 300)
    assert policy.best(1) == 8
    for _ in range(2000):                  # drafts stop being accepted: every cycle yields 1 token
        arm = policy.choose(1)
        policy.observe(arm, 1, seconds(arm, 1), 1, 1)
    assert policy.best(1) == AR


# A cycle's verify budget (VerifyPolicy): a K = 8 cycle drafts [b, 8] and verifies the b anchors and
# V of the b * 7 drafts; rows verify V / b drafts each, the most likely first (fractional: interpolated).
def verify_seconds(eighths: int, b: int, knee: int = 32) -> float:
    forward = lambda n: max(1.0, n / knee)                  # noqa: E731 - flat, then linear
    v = verify_budget(eighths, b, 8)
    return 0.2 + forward(8 * b) + forward(b + (7 * b if v is None else v))


def verify_tokens(eighths: int) -> float:
    width, expected, alive = 7 * eighths / 8, 1.0, 1.0
    for j, rate in enumerate(ACCEPT):
        alive *= rate
        expected += alive * min(1.0, max(0.0, width - j))
    return expected


@pytest.mark.parametrize("b", [1, 16, 256])
def test_the_verify_budget_follows_the_cost_of_verifying(b):
    """Memory bound (b = 1) a verify position costs nothing: every draft is verified; compute bound
    (b = 256) the policy verifies a fraction, and it runs within 5% of the best fixed budget."""
    rates = {e: b * verify_tokens(e) / verify_seconds(e, b) for e in VERIFY_EIGHTHS}
    best = max(rates, key=rates.get)
    policy, time, tokens = VerifyPolicy(), 0.0, 0.0
    for _ in range(4000):
        arm = policy.choose(b)
        t, got = verify_seconds(arm, b), b * verify_tokens(arm)
        policy.observe(arm, b, t, round(got), b)
        time, tokens = time + t, tokens + got
    assert max(policy.chosen, key=policy.chosen.get) == best
    assert tokens / time >= 0.95 * rates[best]
    assert (best == 8) == (b == 1)
