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
corrected live: shifted per batch size, a draft row's price and a prompt row's each times a
factor (a unitless prior curve is scaled instead; workers/routing.py). A step's prompt rows
are priced on a curve of their own: they compute no logits and, on an int4 target with
bfloat16 instructions, run on the dense copy of the weights (workers/models/quant.py), so the
first prompt row of a step costs a read of those weights (~20 ms on a 2-core Xeon) and each
further one a quarter of a scored row. Priced as scored rows, a step carrying a 240-row
prompt chunk was predicted at 1.9x what it took, and the live shift that learned from it then
priced the next plain steps of that batch size at a third of their time.

Routing a step is host work too: every request's controller re-plans, its cheap drafters
propose and are scored, and the rule runs (a few tenths of a millisecond a request on a 2-core
CPU). In a big batch the drafts the rule admits may add less than that work costs, and plain
decoding is then faster. `BatchFallback` keeps, per batch size, what the rule's allocations
promised (`Forecast.gain`) against what routing them took per second of forward, and decodes a
batch of that size plainly, without asking any controller, while the promise is the smaller;
one step in ROUTE_PROBE_EVERY is routed all the same, so that the estimate follows the traffic.
Steps that carry a prompt chunk are kept apart: the chunk makes them several times a decoding
step's length, so the same drafts cost them a smaller share of it.
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


def _on_curve(xs: tuple[int, ...], ys: tuple[float, ...], x: float) -> float:
    """ys at x: linear between the points, ys[0] before the first, along the last slope past the last."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(bisect.bisect_left(xs, x), len(xs) - 1)
    a, b = i - 1, i
    return ys[a] + (x - xs[a]) * (ys[b] - ys[a]) / (xs[b] - xs[a])


def _check_curve(xs: tuple[int, ...], ys: tuple[float, ...], what: str) -> None:
    if not xs or len(xs) != len(ys) or list(xs) != sorted(set(xs)) or xs[0] < 1:
        raise ValueError(f"BatchCost needs ascending, distinct {what} counts from 1, one time each")


@dataclass(frozen=True)
class BatchCost:
    """Seconds of one target forward: its scored rows (decoding, verifying) on the curve measured
    at `rows` (ascending, from 1), linear between them, extended along the last slope; plus
    what its prompt rows add (`prefill_s`)."""

    rows: tuple[int, ...]
    seconds: tuple[float, ...]
    prefill_rows: tuple[int, ...] = ()  # prompt rows measured beside a decoding row
    prefill_seconds: tuple[float, ...] = ()  # what they added to its step; none: priced as scored rows

    def __post_init__(self) -> None:
        _check_curve(self.rows, self.seconds, "row")
        if self.prefill_rows or self.prefill_seconds:
            _check_curve(self.prefill_rows, self.prefill_seconds, "prompt row")

    def step_s(self, rows: float, prefill_rows: float = 0.0) -> float:
        """A step of `rows` scored rows and `prefill_rows` prompt rows."""
        if not self.prefill_rows:
            return _on_curve(self.rows, self.seconds, rows + prefill_rows)
        return _on_curve(self.rows, self.seconds, rows) + self.prefill_s(prefill_rows)

    def prefill_s(self, prefill_rows: float) -> float:
        """What `prefill_rows` prompt rows add to a step (0 without its own curve)."""
        if prefill_rows <= 0 or not self.prefill_rows:
            return 0.0
        return _on_curve(self.prefill_rows, self.prefill_seconds, prefill_rows)

    def scaled(self, factor: float) -> BatchCost:
        return BatchCost(self.rows, tuple(t * factor for t in self.seconds),
                         self.prefill_rows, tuple(t * factor for t in self.prefill_seconds))

    def rows_scaled(self, pivot: int, factor: float) -> BatchCost:
        """Rows past `pivot` at `factor` times the curve's price for them (pivot's seconds kept)."""
        at = self.step_s(pivot)
        return BatchCost(self.rows, tuple(at + factor * (t - at) for t in self.seconds),
                         self.prefill_rows, self.prefill_seconds)

    def shifted(self, offset: float, prefill_factor: float = 1.0) -> BatchCost:
        """Every row count's seconds plus `offset` (never below half the one-row step), the
        prompt rows' times `prefill_factor`."""
        offset = max(offset, -0.5 * self.seconds[0])
        return BatchCost(self.rows, tuple(t + offset for t in self.seconds),
                         self.prefill_rows, tuple(t * prefill_factor for t in self.prefill_seconds))


@dataclass(frozen=True)
class DraftOption:
    """What one decoding sequence may draft this step."""

    prefix: tuple[float, ...]  # P(first i + 1 draft tokens accepted), at least max_k long
    max_k: int  # the sequence's own best k (its controller's choice): the allocation's cap
    draft_s_per_token: float = 0.0
    propose_rate: float = 1.0  # share of steps the drafter proposes at all (prompt lookup)
    verified: tuple[int, ...] | None = None  # a tree's tokens verified at each depth; None: a chain
    propose_rates: tuple[float, ...] | None = None  # per position, of a chain drafter (StepCosts)
    draft_rows: tuple[float, ...] | None = None  # rows verified beyond the root at each k (`cascade`)

    def rows(self, k: int) -> float:
        if k == 0:
            return 1.0
        if self.draft_rows is not None:
            return 1.0 + self.draft_rows[k]
        if self.verified is not None:
            return 1.0 + self.propose_rate * self.verified[k]
        return 1.0 + expected_rows(self.propose_rates, self.propose_rate, k)


def cascade(tries: Sequence[DraftOption]) -> DraftOption:
    """Drafters asked in turn, the first that proposes taking the step (cheap drafters tried
    first, then the step's own; workers/shadows.py) as one option: each try's tokens, rows and
    drafting time weighted by the chance that every try before it stayed silent (each one's
    `prefix` and rows already count its own silent steps). Priced by its first try alone, a
    cascade of prompt lookup and suffix decoding showed the rule ~80% of the rows it verified."""
    if len(tries) == 1:
        return tries[0]
    top = max(t.max_k for t in tries)
    prefix, rows = [0.0] * top, [0.0] * (top + 1)
    draft_s, reach = 0.0, 1.0
    for t in tries:
        for j in range(t.max_k):
            prefix[j] += reach * t.prefix[j]
        for k in range(top + 1):
            rows[k] += reach * (t.rows(min(k, t.max_k)) - 1.0)
        draft_s += reach * t.draft_s_per_token
        reach *= 1.0 - t.propose_rate
    return DraftOption(tuple(prefix), top, draft_s, propose_rate=1.0 - reach, draft_rows=tuple(rows))


def allocate(options: Sequence[DraftOption | None], cost: BatchCost, fixed_rows: int = 0,
             prefill_rows: int = 0) -> list[int]:
    """The k of each sequence (None: it decodes plainly) maximising the batch's expected tokens
    per second over the draft positions admitted in rank order (see the module doc).
    `fixed_rows`: scored rows beyond one per sequence the rule has no say over (forced drafts);
    `prefill_rows`: the step's prompt rows."""
    ks = [0] * len(options)
    tokens = float(len(options))
    rows = float(fixed_rows + len(options))
    draft_s = 0.0
    best_goodput, best_ks = tokens / cost.step_s(rows, prefill_rows), list(ks)
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
        goodput = tokens / (cost.step_s(rows, prefill_rows) + draft_s)
        if goodput > best_goodput * (1.0 + MIN_GAIN):
            best_goodput, best_ks = goodput, list(ks)
        rank(i)
    return best_ks


@dataclass(frozen=True)
class Forecast:
    """What an allocation expects of its step."""

    tokens: float  # emitted, in expectation
    step_s: float  # the forward over the expected rows, plus drafting
    plain_tokens: int  # the same step without drafts: one token a sequence
    plain_s: float

    @property
    def gain(self) -> float:
        """G(ks) / G(0) - 1: what the drafts add to the step's tokens per second."""
        return self.tokens / self.step_s / (self.plain_tokens / self.plain_s) - 1.0


def forecast(options: Sequence[DraftOption | None], ks: Sequence[int], cost: BatchCost,
             fixed_rows: int = 0, prefill_rows: int = 0) -> Forecast:
    """The step an allocation `ks` runs (the other arguments as `allocate` takes them)."""
    tokens, rows, draft_s = float(len(options)), float(fixed_rows + len(options)), 0.0
    for opt, k in zip(options, ks, strict=True):
        if opt is not None and k:
            tokens += sum(opt.prefix[:k])
            rows += opt.rows(k) - 1.0
            draft_s += k * opt.draft_s_per_token
    return Forecast(tokens, cost.step_s(rows, prefill_rows) + draft_s, len(options),
                    cost.step_s(fixed_rows + len(options), prefill_rows))


@dataclass
class RoutingEstimate:
    """BatchFallback's estimates for one batch size."""

    gain: float  # the Forecast.gain of the routed steps
    overhead: float  # their routing seconds per forward second
    plain_steps: int = 0  # decoded plainly since the last routed step


class BatchFallback:
    """Per number of decoding requests, and whether the step carries prompt rows: whether routing
    the next step pays for its host work (see the module doc). A kind not yet seen, and a single
    request, are always routed."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[int, bool], RoutingEstimate] = {}

    def route(self, num_decoding: int, prefilling: bool = False) -> bool:
        """Whether the next step of `num_decoding` requests (`prefilling`: and prompt rows) is
        routed (else: decoded plainly)."""
        est = self._kinds.get((num_decoding, prefilling))
        if num_decoding < 2 or est is None or est.gain > est.overhead:
            return True
        est.plain_steps += 1
        if est.plain_steps >= ROUTE_PROBE_EVERY:
            est.plain_steps = 0
            return True
        return False

    def observe(self, num_decoding: int, gain: float, overhead: float, prefilling: bool = False) -> None:
        """A routed step: the rule's predicted gain, and its routing seconds per forward second."""
        est = self._kinds.get((num_decoding, prefilling))
        if est is None:
            self._kinds[num_decoding, prefilling] = RoutingEstimate(gain, overhead)
            return
        est.gain += FALLBACK_EMA * (gain - est.gain)
        est.overhead += FALLBACK_EMA * (overhead - est.overhead)

    def estimate(self, num_decoding: int, prefilling: bool = False) -> RoutingEstimate | None:
        """The estimates of this kind of step; None: not seen."""
        return self._kinds.get((num_decoding, prefilling))
