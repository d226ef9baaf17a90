"""The batch's goodput rule (policies/batching.py): pure arithmetic, hand-checked cases."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from policies.batching import (
    ROUTE_PROBE_EVERY,
    BatchCost,
    BatchFallback,
    DraftOption,
    allocate,
    cascade,
    forecast,
)
from policies.cost import StepCosts, best_draft_len, expected_tokens, prefix_acceptance


def test_batch_cost_interpolates_and_extends_along_the_last_slope() -> None:
    cost = BatchCost((1, 2, 8), (1.0, 1.2, 2.4))
    assert cost.step_s(1) == 1.0 and cost.step_s(0) == 1.0
    assert cost.step_s(5) == pytest.approx(1.8)
    assert cost.step_s(14) == pytest.approx(3.6)  # 0.2 a row past the last point
    assert cost.shifted(0.5).step_s(2) == pytest.approx(1.7)
    assert cost.shifted(-2.0).step_s(1) == pytest.approx(0.5)  # never below half the one-row step
    with pytest.raises(ValueError):
        BatchCost((2, 1), (1.0, 1.0))


def test_prompt_rows_are_priced_on_their_own_curve() -> None:
    """Prompt rows compute no logits (and may run on other weights): what they add to a step is
    measured apart; without that curve they are priced as scored rows."""
    cost = BatchCost((1, 2, 8), (1.0, 1.2, 2.4), prefill_rows=(1, 101), prefill_seconds=(0.5, 1.5))
    assert cost.prefill_s(0) == 0.0 and cost.step_s(2, 0) == pytest.approx(1.2)
    assert cost.step_s(2, 1) == pytest.approx(1.7)
    assert cost.step_s(2, 51) == pytest.approx(2.2)
    assert cost.step_s(2, 201) == pytest.approx(3.7)  # along the last slope
    assert BatchCost((1, 2, 8), (1.0, 1.2, 2.4)).step_s(2, 6) == pytest.approx(2.4)  # as 8 scored rows
    # the live corrections: a shift for the scored rows, a factor for the prompt rows
    assert cost.shifted(0.5, prefill_factor=2.0).step_s(2, 51) == pytest.approx(1.7 + 2.0)
    assert cost.scaled(2.0).step_s(2, 51) == pytest.approx(4.4)
    with pytest.raises(ValueError):
        BatchCost((1,), (1.0,), prefill_rows=(1, 2), prefill_seconds=(0.5,))


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


def test_draft_rows_in_a_batch_are_priced_by_a_factor_on_the_curve_past_the_pivot() -> None:
    cost = BatchCost((1, 4, 8), (1.0, 1.3, 2.5))
    scaled = cost.rows_scaled(4, 2.0)
    assert scaled.step_s(4) == pytest.approx(1.3)  # the batch's own rows keep their price
    assert scaled.step_s(6) == pytest.approx(1.3 + 2.0 * 0.6)
    assert scaled.step_s(10) == pytest.approx(1.3 + 2.0 * 1.8)  # past the last point too


def test_a_cascade_prices_each_try_by_the_chance_it_is_reached() -> None:
    """Prompt lookup first (proposes on half the steps), then suffix decoding (0.4 of steps), then
    nothing: suffix drafts only where lookup stayed silent."""
    lookup = DraftOption((0.45, 0.4, 0.3, 0.2), 4, propose_rate=0.5, propose_rates=(0.5, 0.45, 0.4, 0.3))
    suffix = DraftOption((0.3, 0.1), 2, draft_s_per_token=0.01, propose_rate=0.4)
    both = cascade([lookup, suffix])
    assert cascade([lookup]) is lookup
    assert both.max_k == 4 and both.propose_rate == pytest.approx(1 - 0.5 * 0.6)
    assert both.prefix == pytest.approx((0.45 + 0.5 * 0.3, 0.4 + 0.5 * 0.1, 0.3, 0.2))
    for k in range(5):
        expected = lookup.rows(k) - 1 + 0.5 * (suffix.rows(min(k, 2)) - 1)
        assert both.rows(k) == pytest.approx(1 + expected)
    assert both.draft_s_per_token == pytest.approx(0.5 * 0.01)
    # priced by its first try alone the step looks shorter and emptier than it is
    cost = BatchCost((1, 2, 8), (1.0, 1.2, 2.4))
    alone, priced = forecast([lookup], [2], cost), forecast([both], [2], cost)
    assert priced.tokens > alone.tokens and priced.step_s > alone.step_s


def test_a_step_carrying_a_prompt_chunk_drafts_where_a_decoding_step_would_not() -> None:
    """The chunk makes the step long, so a draft row costs a smaller share of it; the same rows
    priced as scored ones would make the step dearer still, but also every draft row at the
    curve's steepest."""
    cost = BatchCost((1, 8, 64), (1.0, 1.4, 8.0), prefill_rows=(1, 256), prefill_seconds=(2.0, 6.0))
    options: list[DraftOption | None] = [DraftOption(tuple(prefix_acceptance([0.7] * 6)), 6) for _ in range(16)]
    assert allocate(options, cost) == [0] * 16
    ks = allocate(options, cost, prefill_rows=200)
    assert sum(ks) > 0
    assert forecast(options, ks, cost, prefill_rows=200).gain > 0.0
    assert forecast(options, ks, cost).gain < 0.0  # the same drafts in a decoding step lose


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


def _staircase(block: int, block_s: float = 0.3, top: int = 64) -> BatchCost:
    """A kernel computing rows in blocks: a plain step costs 1, each block `block_s`, each row 0.02."""
    rows = tuple(range(1, top + 1))
    return BatchCost(rows, tuple(0.98 - block_s + block_s * math.ceil(n / block) + 0.02 * n for n in rows))


def _goodput(options: list[DraftOption | None], ks: list[int], cost: BatchCost) -> float:
    tokens = sum(expected_tokens(o.prefix, k) if o else 1.0 for o, k in zip(options, ks))
    rows = sum(o.rows(k) if o else 1.0 for o, k in zip(options, ks))
    draft_s = sum(k * o.draft_s_per_token for o, k in zip(options, ks) if o)
    return tokens / (cost.step_s(rows) + draft_s)


def test_on_a_staircase_the_rule_fills_the_block_it_pays_for() -> None:
    """Five sequences take one row of a second block of four: its other three rows are nearly free,
    and they earn the most as one draft token each (a 0.6 first token against a 0.36 second)."""
    cost = _staircase(4, block_s=0.6)
    options: list[DraftOption | None] = [DraftOption(tuple(prefix_acceptance([0.6] * 4)), 4) for _ in range(5)]
    ks = allocate(options, cost)
    assert sorted(ks) == [0, 0, 1, 1, 1]
    # the next block's first row would cost more than its tokens bring, and so would a third block
    assert _goodput(options, ks, cost) > _goodput(options, [1, 1, 1, 1, 0], cost)
    assert _goodput(options, ks, cost) > _goodput(options, [2, 2, 1, 1, 1], cost)


@pytest.mark.parametrize(("batch", "max_k"), [(3, 4), (4, 3), (5, 3), (6, 2)])
def test_the_rule_is_close_to_an_exhaustive_search_on_a_staircase(batch: int, max_k: int) -> None:
    cost = _staircase(4)
    rng = random.Random(batch * 100 + max_k)
    ratios = []
    for _ in range(40):
        options: list[DraftOption | None] = []
        for _ in range(batch):
            rate, propose = rng.uniform(0.3, 0.9), rng.choice([1.0, 0.8, 0.5])
            prefix = tuple(p * propose for p in prefix_acceptance([rate] * max_k))
            options.append(DraftOption(prefix, max_k, draft_s_per_token=rng.choice([0.0, 0.01]), propose_rate=propose))
        best = max(_goodput(options, list(ks), cost) for ks in itertools.product(range(max_k + 1), repeat=batch))
        ratios.append(_goodput(options, allocate(options, cost), cost) / best)
    # a rule that stops at the first extension that does not pay: 0.87-0.92 and 0.96-0.97 here
    assert min(ratios) >= 0.95
    assert statistics.mean(ratios) >= 0.99


def test_the_predicted_gain_is_the_allocations_goodput_over_plain_decodings() -> None:
    cost = BatchCost((1, 2, 8), (1.0, 1.2, 2.4))
    good, poor = DraftOption((0.9, 0.8), 2), DraftOption((0.1,), 1, draft_s_per_token=0.05)
    options = [good, poor, None]
    assert forecast(options, [0, 0, 0], cost).gain == 0.0
    # 3 + 1.7 + 0.1 tokens over a step of 6 rows (2.0 s) plus 0.05 s drafting, against 3 tokens in 1.4 s
    assert forecast(options, [2, 1, 0], cost).gain == pytest.approx((4.8 / 2.05) / (3 / 1.4) - 1)
    ks = allocate(options, cost)
    assert forecast(options, ks, cost).gain >= max(forecast(options, [a, b, 0], cost).gain
                                                    for a in range(3) for b in range(2)) - 1e-12


def test_a_batch_size_decodes_plainly_while_routing_it_costs_more_than_its_drafts_promise() -> None:
    fallback = BatchFallback()
    assert fallback.route(1) and fallback.route(16)  # alone, and a size not seen yet: routed
    fallback.observe(16, gain=0.02, overhead=0.05)
    fallback.observe(1, gain=0.0, overhead=0.5)
    assert fallback.route(1)  # a request alone re-plans itself
    plain_run = [fallback.route(16) for _ in range(2 * ROUTE_PROBE_EVERY)]
    assert plain_run == ([False] * (ROUTE_PROBE_EVERY - 1) + [True]) * 2  # a routed step now and then
    for _ in range(5):  # the probes find drafts that pay again
        fallback.observe(16, gain=0.30, overhead=0.05)
    assert fallback.route(16) and fallback.route(16)
    est = fallback.estimate(16)
    assert est is not None and est.gain > est.overhead and fallback.estimate(8) is None


def test_steps_carrying_prompt_rows_are_estimated_apart() -> None:
    fallback = BatchFallback()
    fallback.observe(16, gain=0.02, overhead=0.05)
    fallback.observe(16, gain=0.40, overhead=0.01, prefilling=True)
    assert fallback.route(16, prefilling=True) and not fallback.route(16)
    est = fallback.estimate(16, prefilling=True)
    assert est is not None and est.gain == pytest.approx(0.40) and fallback.estimate(8, prefilling=True) is None
