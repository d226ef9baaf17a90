"""The goodput rule: how many draft tokens each sequence of a batch verifies in the next step.

Under continuous batching one target forward verifies every running sequence's draft, so a draft
token's price is what it adds to the shared step: T(rows + 1) - T(rows), paid by every sequence
in the batch, plus its drafter's proposing time (drafters run before the forward). A step in
which sequence i drafts k_i tokens emits, in expectation,
    E_i(k_i) = 1 + sum_{j < k_i} P(the first j + 1 of i's draft tokens are accepted)
tokens (policies/cost.py), so the batch's goodput is
    G(k) = sum_i E_i(k_i) / (T(P + sum_i rows_i(k_i)) + sum_i k_i d_i),
with P the rows of prompt chunks in the step, rows_i(k) = 1 + m_i v_i(k) (m_i the drafter's
propose rate, v_i(k) the tokens a draft of depth k verifies: k for a chain, a tree's size), d_i
its seconds per draft token. `allocate` ranks every sequence's next draft position by its
expected tokens per second of price (acceptance over rows at the batch's mean row price, plus
drafting), admits positions in that order, and keeps the admitted prefix with the highest G.
A greedy rule that stops where no single extension raises G would stall on a staircase: a
kernel that computes rows in blocks (torch's int4 CPU kernel: 4 rows) makes the first row of a
block dear and the next ones nearly free, so only a whole block pays; walking the ranking to
its end sees that (tests/test_batching_policy.py holds it to an exhaustive search on such a
curve). Draft positions are thus admitted by their acceptance against their cost: with a small
batch on a step curve that is flat in rows, drafting pays; in a big batch every row costs its
share of the weights' reading and drafting stops, for a sequence or for all, without a hard
batch-size switch. Alone (one sequence, no prompt chunk) the rule reduces to the request's own
best k.

`BatchCost` is T: measured once at start (router calibration) on one sequence's rows, and
shifted live, per batch size, by what the steps of that size took beyond it (a unitless prior
curve is scaled instead; workers/routing.py).

Routing a step is host work too: every request's controller re-plans, its cheap drafters
propose and are scored, and the rule runs (a few tenths of a millisecond a request on a 2-core
CPU). In a big batch the drafts the rule admits may add less than that work costs, and plain
decoding is then faster. `BatchFallback` keeps, per batch size, what the rule's allocations
promised (`predicted_gain`) against what routing them took per second of forward, and decodes a
batch of that size plainly, without asking any controller, while the promise is the smaller;
one step in ROUTE_PROBE_EVERY is routed all the same, so that the estimate follows the traffic.
Pure functions and value types, and one small state machine fed the measured numbers: no
clock, no I/O.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.cost import expected_rows

MIN_GAIN = 1e-3  # relative goodput gain an extension must bring (no churn on float noise)
ROUTE_PROBE_EVERY = 32  # steps of a batch size decoded plainly between two routed ones
FALLBACK_EMA = 0.2  # weight of the latest routed step in BatchFallback's estimates


@dataclass(frozen=True)
class BatchCost:
    """Seconds of one target forward over n rows: measured at `rows` (ascending, from 1),
    linear between them, extended along the last slope."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if not self.rows or len(self.rows) != len(self.seconds) or list(self.rows) != sorted(set(self.rows)):
            raise ValueError("BatchCost needs ascending, distinct row counts, one time each")

    def step_s(self, rows: float) -> float:
        r, s = self.rows, self.seconds
        if len(r) == 1 or rows <= r[0]:
            return s[0]
        i = min(bisect.bisect_left(r, rows), len(r) - 1)
        a, b = i - 1, i
        return s[a] + (rows - r[a]) * (s[b] - s[a]) / (r[b] - r[a])

    def scaled(self, factor: float) -> BatchCost:
        return BatchCost(self.rows, tuple(t * factor for t in self.seconds))

    def shifted(self, offset: float) -> BatchCost:
        """Every row count's seconds plus `offset` (never below half the one-row step)."""
        offset = max(offset, -0.5 * self.seconds[0])
        return BatchCost(self.rows, tuple(t + offset for t in self.seconds))


@dataclass(frozen=True)
class DraftOption:
    """What one decoding sequence may draft this step."""

    prefix: tuple[float, ...]  # P(first i + 1 draft tokens accepted), at least max_k long
    max_k: int  # the sequence's own best k (its controller's choice): the allocation's cap
    draft_s_per_token: float = 0.0
    propose_rate: float = 1.0  # share of steps the drafter proposes at all (prompt lookup)
    verified: tuple[int, ...] | None = None  # a tree's tokens verified at each depth; None: a chain
    propose_rates: tuple[float, ...] | None = None  # per position, of a chain drafter (StepCosts)

    def rows(self, k: int) -> float:
        if k == 0:
            return 1.0
        if self.verified is not None:
            return 1.0 + self.propose_rate * self.verified[k]
        return 1.0 + expected_rows(self.propose_rates, self.propose_rate, k)


def allocate(options: Sequence[DraftOption | None], cost: BatchCost, prefill_rows: int = 0) -> list[int]:
    """The k of each sequence (None: it decodes plainly) maximising the batch's expected tokens
    per second over the draft positions admitted in rank order (see the module doc)."""
    ks = [0] * len(options)
    tokens = float(len(options))
    rows = float(prefill_rows + len(options))
    draft_s = 0.0
    best_goodput, best_ks = tokens / cost.step_s(rows), list(ks)
    extra = sum(opt.rows(opt.max_k) - 1.0 for opt in options if opt is not None)
    row_price = (cost.step_s(rows + extra) - cost.step_s(rows)) / extra if extra > 0 else 0.0

    ranked: list[tuple[float, int]] = []  # (-tokens per second of price, sequence): its next position

    def rank(i: int) -> None:
        opt = options[i]
        if opt is None or ks[i] >= opt.max_k:
            return
        price = (opt.rows(ks[i] + 1) - opt.rows(ks[i])) * row_price + opt.draft_s_per_token
        heapq.heappush(ranked, (-opt.prefix[ks[i]] / price if price > 0 else -math.inf, i))

    for i in range(len(options)):
        rank(i)
    while ranked:
        _, i = heapq.heappop(ranked)
        opt = options[i]
        assert opt is not None
        k = ks[i]
        tokens += opt.prefix[k]
        rows += opt.rows(k + 1) - opt.rows(k)
        draft_s += opt.draft_s_per_token
        ks[i] = k + 1
        goodput = tokens / (cost.step_s(rows) + draft_s)
        if goodput > best_goodput * (1.0 + MIN_GAIN):
            best_goodput, best_ks = goodput, list(ks)
        rank(i)
    return best_ks


def predicted_gain(options: Sequence[DraftOption | None], ks: Sequence[int], cost: BatchCost,
                   prefill_rows: int = 0) -> float:
    """G(ks) / G(0) - 1: what drafting ks adds to the step's expected tokens per second (the
    arguments as `allocate` takes them)."""
    tokens, rows, draft_s = float(len(options)), float(prefill_rows + len(options)), 0.0
    for opt, k in zip(options, ks, strict=True):
        if opt is not None and k:
            tokens += sum(opt.prefix[:k])
            rows += opt.rows(k) - 1.0
            draft_s += k * opt.draft_s_per_token
    plain = len(options) / cost.step_s(prefill_rows + len(options))
    return tokens / (cost.step_s(rows) + draft_s) / plain - 1.0


@dataclass
class RoutingEstimate:
    """BatchFallback's estimates for one batch size."""

    gain: float  # predicted_gain of the routed steps
    overhead: float  # their routing seconds per forward second
    plain_steps: int = 0  # decoded plainly since the last routed step


class BatchFallback:
    """Per number of decoding requests: whether routing the next step pays for its host work
    (see the module doc). A size not yet seen, and a single request, are always routed."""

    def __init__(self) -> None:
        self._sizes: dict[int, RoutingEstimate] = {}

    def route(self, num_decoding: int) -> bool:
        """Whether the next step of `num_decoding` requests is routed (else: decoded plainly)."""
        est = self._sizes.get(num_decoding)
        if num_decoding < 2 or est is None or est.gain > est.overhead:
            return True
        est.plain_steps += 1
        if est.plain_steps >= ROUTE_PROBE_EVERY:
            est.plain_steps = 0
            return True
        return False

    def observe(self, num_decoding: int, gain: float, overhead: float) -> None:
        """A routed step: the rule's predicted gain, and its routing seconds per forward second."""
        est = self._sizes.get(num_decoding)
        if est is None:
            self._sizes[num_decoding] = RoutingEstimate(gain, overhead)
            return
        est.gain += FALLBACK_EMA * (gain - est.gain)
        est.overhead += FALLBACK_EMA * (overhead - est.overhead)

    def estimate(self, num_decoding: int) -> RoutingEstimate | None:
        """The estimates of this batch size; None: not seen."""
        return self._sizes.get(num_decoding)
