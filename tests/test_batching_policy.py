"""The batch's goodput rule (policies/batching.py): pure arithmetic, hand-checked cases."""

from __future__ import annotations

import pytest

from policies.batching import BatchCost, DraftOption, allocate
from policies.cost import StepCosts, best_draft_len, prefix_acceptance


def test_batch_cost_interpolates_and_extends_along_the_last_slope() -> None:
    cost = BatchCost((1, 2, 8), (1.0, 1.2, 2.4))
    assert cost.step_s(1) == 1.0 and cost.step_s(0) == 1.0
    assert cost.step_s(5) == pytest.approx(1.8)
    assert cost.step_s(14) == pytest.approx(3.6)  # 0.2 a row past the last point
    assert cost.scaled(2.0).step_s(2) == pytest.approx(2.4)
    with pytest.raises(ValueError):
        BatchCost((2, 1), (1.0, 1.0))


@pytest.mark.parametrize("rate", [0.9, 0.6, 0.3])
def test_alone_the_rule_picks_the_requests_own_best_k(rate: float) -> None:
    """One sequence, no prompt chunk: the k of the single-request cost model (policies/cost.py)."""
    verify = tuple(1.0 + 0.1 * k for k in range(9))
    prefix = tuple(prefix_acceptance([rate] * 8))
    cost = BatchCost(tuple(range(1, 10)), verify)
    (k,) = allocate([DraftOption(prefix, 8)], cost)
    assert k == best_draft_len(prefix, StepCosts(1.0, 0.0, verify), 1, 8).draft_len


def test_a_batch_whose_rows_cost_full_price_drafts_nothing() -> None:
    """Past the knee every row costs what a plain step's row does: a draft token that is accepted
    with probability < 1 lowers the batch's tokens per second, for every sequence."""
    cost = BatchCost((1, 8, 64), (1.0, 1.4, 8.0))  # ~0.13 a row past 8 rows: a full token's share
    options = [DraftOption(tuple(prefix_acceptance([0.7] * 6)), 6) for _ in range(16)]
    assert allocate(options, cost) == [0] * 16
    # the same sequences alone on a flat curve draft
    assert allocate(options[:1], cost) != [0]


def test_draft_positions_go_to_the_sequences_likeliest_to_accept_them() -> None:
    cost = BatchCost((1, 4, 6, 40), (1.0, 1.1, 1.3, 5.0))
    good = DraftOption(tuple(prefix_acceptance([0.95] * 4)), 4)
    poor = DraftOption(tuple(prefix_acceptance([0.2] * 4)), 4)
    ks = allocate([poor, good, None], cost)
    assert ks[1] > 0 and ks[0] == 0 and ks[2] == 0
    assert ks[1] <= 4  # never past the sequence's own cap


def test_draft_cost_and_propose_rate_are_priced() -> None:
    cost = BatchCost((1, 16), (1.0, 1.0))  # rows free: only drafting costs
    prefix = tuple(prefix_acceptance([0.5] * 4))
    assert allocate([DraftOption(prefix, 4)], cost) == [4]
    assert allocate([DraftOption(prefix, 4, draft_s_per_token=0.6)], cost) == [0]
    # a drafter that rarely proposes adds few rows: on a steep curve it still pays where a chain would not
    steep = BatchCost((1, 2), (1.0, 1.45))
    assert allocate([DraftOption(prefix, 1)], steep) == [1]
    assert allocate([DraftOption(tuple(p * 0.2 for p in prefix), 1, propose_rate=0.2)], steep) == [1]
