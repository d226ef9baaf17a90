"""The cost model on hand-computed cases."""

from __future__ import annotations

import pytest

from policies.cost import (
    StepCosts,
    best_draft_len,
    expected_tokens,
    predicted_speedup,
    prefix_acceptance,
)

# a verify curve shaped like the measured one (docs/benchmarks.md): 1.0, 1.1, 1.2, ... x plain
COSTS = StepCosts(plain_s=0.04, draft_s_per_token=0.0, verify_s=[0.04 * (1 + 0.1 * k) for k in range(17)])


def test_prefix_acceptance_is_the_running_product() -> None:
    assert prefix_acceptance([0.5, 0.5, 1.0, 0.0]) == pytest.approx([0.5, 0.25, 0.25, 0.0])
    assert prefix_acceptance([]) == []


def test_expected_tokens() -> None:
    prefix = [0.8, 0.6, 0.3]
    assert expected_tokens(prefix, 0) == 1.0
    assert expected_tokens(prefix, 2) == pytest.approx(2.4)
    assert expected_tokens(prefix, 5) == pytest.approx(2.7)  # unseen positions earn nothing
    with pytest.raises(ValueError, match="k must be >= 0"):
        expected_tokens(prefix, -1)


def test_predicted_speedup_matches_the_formula() -> None:
    prefix = [0.9, 0.8]
    # E(2) = 2.7 tokens for 1.2 plain steps of cost
    assert predicted_speedup(prefix, 2, COSTS) == pytest.approx(2.7 / 1.2)
    assert predicted_speedup(prefix, 0, COSTS) == 1.0
    costly = StepCosts(plain_s=0.04, draft_s_per_token=0.02, verify_s=COSTS.verify_s)
    assert predicted_speedup(prefix, 2, costly) == pytest.approx(2.7 * 0.04 / (0.04 + 0.048))


def test_best_draft_len_picks_the_peak_and_falls_back_to_plain() -> None:
    high = [0.9] * 16
    best = best_draft_len(prefix_acceptance(high), COSTS, 1, 16)
    speedups = [predicted_speedup(prefix_acceptance(high), k, COSTS) for k in range(1, 17)]
    assert best.draft_len == 1 + speedups.index(max(speedups))
    assert best.speedup == pytest.approx(max(speedups)) and best.speedup > 1

    # acceptance too low for any k to pay for its verification: plain
    assert best_draft_len(prefix_acceptance([0.05] * 16), COSTS, 1, 16).draft_len == 0
    # the bounds are respected
    assert best_draft_len(prefix_acceptance(high), COSTS, 2, 3).draft_len in (2, 3)


def test_unknown_verify_cost_is_an_error() -> None:
    with pytest.raises(ValueError, match="no verify cost for k = 20"):
        COSTS.step_s(20)


def test_a_tree_step_costs_the_tokens_it_verifies() -> None:
    """A depth-2 tree of 12 nodes pays T(13), not T(3); past the measured curve, its last slope."""
    tree = StepCosts(plain_s=0.04, draft_s_per_token=0.0, verify_s=COSTS.verify_s, verified=[0, 4, 12, 12])
    assert tree.step_s(2) == pytest.approx(COSTS.verify_s[12]) and tree.max_k == 3
    assert StepCosts(0.04, 0.0, COSTS.verify_s, verified=[0, 4, 30]).step_s(2) == pytest.approx(0.04 * 4.0)
    prefix = prefix_acceptance([0.6, 0.5, 0.2])
    assert predicted_speedup(prefix, 2, tree) == pytest.approx(expected_tokens(prefix, 2) / 2.2)
    # the same acceptance as a chain would pay; priced as a tree, depth 1 (T(5) = 1.4) wins
    assert best_draft_len(prefix, COSTS, 1, 3).draft_len == 2
    assert best_draft_len(prefix, tree, 1, 8).draft_len == 1
    with pytest.raises(ValueError, match="no verify cost for k = 4"):
        tree.step_s(4)


def test_a_drafter_that_often_proposes_nothing_costs_less_per_step() -> None:
    """Prompt lookup without a match leaves the step plain: its cost is a plain step's, so a
    low proposal rate must not be charged the full verify cost."""
    verify = [1.0 + 0.1 * k for k in range(9)]
    always = StepCosts(1.0, 0.0, verify)
    half = StepCosts(1.0, 0.0, verify, propose_rate=0.5)
    assert always.step_s(4) == pytest.approx(1.4) and half.step_s(4) == pytest.approx(1.2)
    # the same expected tokens (prefix probabilities already count the silent steps as rejected)
    prefix = [0.25, 0.2, 0.15, 0.1]
    steep = StepCosts(1.0, 0.0, [1.0 + 0.3 * k for k in range(9)])
    assert predicted_speedup(prefix, 4, half) > 1.0 > predicted_speedup(prefix, 4, steep)
    assert best_draft_len(prefix, half, 1, 4).draft_len > 0


def test_a_drafter_that_proposes_short_is_priced_by_the_positions_it_proposes() -> None:
    """Prompt lookup asked for k verifies position i only on the steps it proposes that far."""
    t = COSTS.verify_s
    short = StepCosts(plain_s=0.04, draft_s_per_token=0.0, verify_s=t, propose_rates=[1.0, 0.5, 0.25, 0.0])
    assert short.step_s(2) == pytest.approx(t[0] + (t[1] - t[0]) + 0.5 * (t[2] - t[1]))
    assert short.step_s(6) == pytest.approx(0.04 * (1 + 0.1 * 1.75)) == pytest.approx(short.step_s(3))
    # rates that rise are read as non-increasing: a position needs the ones before it
    assert StepCosts(0.04, 0.0, t, propose_rates=[0.5, 1.0]).step_s(2) == pytest.approx(0.04 * (1 + 0.1 * 1.0))
    # all k or nothing, as a trained drafter proposes: the same as one propose rate
    m = 0.4
    assert StepCosts(0.04, 0.0, t, propose_rates=[m] * 16).step_s(5) == pytest.approx(
        StepCosts(0.04, 0.0, t, propose_rate=m).step_s(5)) == pytest.approx(m * t[5] + (1 - m) * t[0])
