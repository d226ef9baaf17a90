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
its seconds per draft token. `allocate` starts every sequence at k = 0 (plain) and repeatedly
applies the single extension, one sequence to a larger k up to its cap, that raises G the most,
until none does (SmartSpec's and vLLM's adaptive rule, per sequence). Draft positions are thus
admitted by their acceptance against their marginal cost: with a small batch on a step curve
that is flat in rows, drafting pays; in a big batch every row costs its share of the weights'
reading and drafting stops, for a sequence or for all, without a hard batch-size switch.
Alone (one sequence, no prompt chunk) the rule reduces to the request's own best k.

`BatchCost` is T: measured once at start (router calibration) and rescaled live by the ratio
of measured to predicted step times. Pure functions and value types: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

from policies.cost import expected_rows, expected_tokens

MIN_GAIN = 1e-3  # relative goodput gain an extension must bring (no churn on float noise)


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
    per second, by greedy single extensions (see the module doc)."""
    ks = [0] * len(options)
    tokens = float(len(options))
    rows = float(prefill_rows + len(options))
    draft_s = 0.0
    goodput = tokens / cost.step_s(rows)
    while True:
        best: tuple[float, int, int] | None = None  # (goodput, sequence, k)
        for i, opt in enumerate(options):
            if opt is None:
                continue
            e0, r0, d0 = expected_tokens(opt.prefix, ks[i]), opt.rows(ks[i]), ks[i] * opt.draft_s_per_token
            for k in range(ks[i] + 1, opt.max_k + 1):
                t = tokens + expected_tokens(opt.prefix, k) - e0
                s = cost.step_s(rows + opt.rows(k) - r0) + draft_s + k * opt.draft_s_per_token - d0
                if s > 0 and (best is None or t / s > best[0]):
                    best = (t / s, i, k)
        if best is None or best[0] <= goodput * (1.0 + MIN_GAIN):
            return ks
        goodput, i, k = best
        opt = options[i]
        assert opt is not None
        tokens += expected_tokens(opt.prefix, k) - expected_tokens(opt.prefix, ks[i])
        rows += opt.rows(k) - opt.rows(ks[i])
        draft_s += (k - ks[i]) * opt.draft_s_per_token
        ks[i] = k
