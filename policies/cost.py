"""Cost model: the predicted speedup of drafting k tokens with a drafter, against plain decoding.

A step that drafts k tokens emits, in expectation,
    E(k) = 1 + sum_{i < k} P(the first i + 1 draft tokens are all accepted)
tokens (the bonus or recovered token is the 1). With a_j the acceptance rate at position j given
every earlier token was accepted, P(first i + 1 accepted) = prod_{j <= i} a_j. The step costs
t_draft(k) + t_verify(k); plain decoding emits one token per t_plain. So
    speedup(k) = E(k) * t_plain / (t_draft(k) + t_verify(k)),    plain = 1.
A drafter proposes a token at position i on a share r_i of the steps that ask for it (prompt
lookup needs a match, and proposes only as far as its match goes), so a step verifies position i
with probability r_i (non-increasing in i) and
    t_verify(k) = T(1) + sum_{i < k} r_i (T(2 + i) - T(1 + i)),
which is m T(1 + k) + (1 - m) T(1) for a drafter that proposes all k tokens or none (a trained
model: r_i = m). The prefix probabilities count unproposed positions as rejected.

Under continuous batching the step is shared: the batch's goodput rule (policies/batching.py)
prices every request's draft rows against the others'.
Pure functions: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from policies.records import StatsSnapshot
from policies.schema import MAX_DRAFT_LEN

if TYPE_CHECKING:
    from policies.acceptance import Acceptance

# Until measured, a verify of k draft tokens costs (1 + VERIFY_SLOPE * k) plain steps; the
# measured curve on the default CPU target is close (docs/benchmarks.md, "verify cost").
VERIFY_SLOPE = 0.075
MIN_COST_SAMPLES = 3  # measured cost samples before they replace the prior for one k


def prefix_acceptance(conditional: Sequence[float]) -> list[float]:
    """P(the first i + 1 tokens are accepted), from acceptance rates at position i given the
    earlier ones were accepted."""
    return list(itertools.accumulate(conditional, lambda p, a: p * a))


def expected_tokens(prefix: Sequence[float], k: int) -> float:
    """E(k) = 1 + the first k prefix-acceptance probabilities. Positions never observed are
    taken as never accepted (the conservative choice: no data, no credit)."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    return 1.0 + sum(prefix[:k])


@dataclass(frozen=True)
class StepCosts:
    plain_s: float  # one plain decoding step (k = 0)
    draft_s_per_token: float  # the drafter's cost per proposed token (per position, for a tree)
    verify_s: Sequence[float]  # verify_s[n]: one target forward over 1 + n tokens; [0] == plain_s
    # how often the drafter proposes anything: a step it leaves empty (prompt lookup without a
    # match) verifies nothing and costs a plain step
    propose_rate: float = 1.0
    # a draft tree's tokens verified at each depth k (verified[k] >= k); None: a chain verifies k
    verified: Sequence[int] | None = None
    # a chain drafter that proposes as far as it can (prompt lookup, suffix): P(it proposes
    # position i), per position; None: all k positions whenever it proposes (propose_rate)
    propose_rates: Sequence[float] | None = None

    @property
    def max_k(self) -> int:
        return len(self.verified) - 1 if self.verified is not None else len(self.verify_s) - 1

    def verify_cost(self, n: int) -> float:
        """One forward over 1 + n tokens; past the measured curve, extended along its last slope."""
        last = len(self.verify_s) - 1
        if n <= last:
            return self.verify_s[n]
        slope = self.verify_s[last] - self.verify_s[last - 1] if last else 0.0
        return self.verify_s[last] + (n - last) * slope

    def step_s(self, k: int) -> float:
        if not 0 <= k <= self.max_k:
            raise ValueError(f"no verify cost for k = {k} (known up to {self.max_k})")
        return self.steps_s(k)[k]

    def steps_s(self, top: int) -> list[float]:
        """step_s(k) for k = 0..top, in one pass (the router prices every k of every drafter
        before each step)."""
        plain, m = self.verify_s[0], self.propose_rate
        if self.verified is not None:  # a tree verifies all its nodes whenever it proposes
            return [k * self.draft_s_per_token + plain + m * (self.verify_cost(self.verified[k]) - plain)
                    for k in range(top + 1)]
        out, verify = [plain], plain
        for i, r in enumerate(position_rates(self.propose_rates, m, top)):
            verify += r * (self.verify_cost(i + 1) - self.verify_cost(i))
            out.append((i + 1) * self.draft_s_per_token + verify)
        return out


def position_rates(rates: Sequence[float] | None, rate: float, k: int) -> list[float]:
    """P(a step asking k tokens verifies draft position i), i < k: `rates` kept non-increasing
    (past its end, its last value), or `rate` at every position when None."""
    if not rates:
        return [rate] * k
    out, floor = [], 1.0
    for i in range(k):
        floor = min(floor, rates[min(i, len(rates) - 1)])
        out.append(floor)
    return out


def expected_rows(rates: Sequence[float] | None, rate: float, k: int) -> float:
    """Draft positions a step asking k tokens verifies, in expectation (`position_rates`)."""
    return sum(position_rates(rates, rate, k))


def predicted_speedup(prefix: Sequence[float], k: int, costs: StepCosts) -> float:
    """The request's tokens per second drafting k tokens a step over decoding plainly (1.0 at k = 0)."""
    if k == 0:
        return 1.0
    return _speedup(expected_tokens(prefix, k), costs.step_s(k), costs.plain_s)


def _speedup(tokens: float, step_s: float, plain_s: float) -> float:
    return tokens * plain_s / step_s if step_s > 0 else math.inf


@dataclass(frozen=True)
class BestDraftLen:
    draft_len: int  # 0 means plain decoding wins
    speedup: float


def best_draft_len(prefix: Sequence[float], costs: StepCosts, k_min: int, k_max: int) -> BestDraftLen:
    """The k in [k_min, k_max] with the highest predicted speedup; k = 0 (plain) when none beats 1."""
    best = BestDraftLen(0, 1.0)
    top = min(k_max, costs.max_k)
    if top < max(k_min, 1):
        return best
    steps_s, tokens = costs.steps_s(top), 1.0
    for k in range(1, top + 1):
        tokens += prefix[k - 1] if k <= len(prefix) else 0.0
        if k >= k_min and (speedup := _speedup(tokens, steps_s[k], costs.plain_s)) > best.speedup:
            best = BestDraftLen(k, speedup)
    return best


# -- the deployment's measured costs ------------------------------------------------------------

@dataclass(frozen=True)
class CostTable:
    """Deployment-wide step costs: a plain step, verify by the number of draft tokens verified
    (verify_s[0] = plain_s) and each drafter's seconds per draft token (missing: 0, until
    measured); a tree drafter's tokens verified at each depth (the engine's config says)."""

    verify_s: tuple[float, ...]
    draft_s_per_token: Mapping[str, float] = field(default_factory=dict)
    tree_sizes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def plain_s(self) -> float:
        return self.verify_s[0]

    @classmethod
    def relative(cls, max_k: int = MAX_DRAFT_LEN) -> CostTable:
        """The prior when nothing is measured: plain = 1, verify(k) = 1 + VERIFY_SLOPE * k."""
        return cls(tuple(1.0 + VERIFY_SLOPE * k for k in range(max_k + 1)))

    def for_drafter(self, drafter: str, propose_rate: float = 1.0,
                    propose_rates: Sequence[float] | None = None) -> StepCosts:
        return StepCosts(self.plain_s, self.draft_s_per_token.get(drafter, 0.0), self.verify_s, propose_rate,
                         self.tree_sizes.get(drafter), propose_rates)

    def for_estimate(self, drafter: str, est: Acceptance) -> StepCosts:
        """The step costs of `drafter` proposing as its estimate says it does."""
        return self.for_drafter(drafter, est.proposes, est.proposed)


def cost_table(snapshot: StatsSnapshot, bucket: str, prior: CostTable | None, drafters: Iterable[str]) -> CostTable:
    """Measured costs where there are enough samples (this context bucket first, then all), the
    prior elsewhere, rescaled by the median measured / prior ratio so the curve stays consistent
    (a prior measured on another context length, or the unitless relative one); non-decreasing in k."""
    prior = prior or CostTable.relative()

    def measured(stat_of) -> float | None:
        for b in (bucket, None):
            stat = stat_of(b)
            if stat.count >= MIN_COST_SAMPLES:
                return stat.mean
        return None

    known = {k: m for k in range(len(prior.verify_s))
             if (m := measured(lambda b, k=k: snapshot.verify_s(k, b))) is not None}
    scale = statistics.median(m / prior.verify_s[k] for k, m in known.items()) if known else 1.0
    # a forward over more tokens never costs less: noise that says so would lure k upwards
    verify = tuple(itertools.accumulate(
        (known.get(k, prior.verify_s[k] * scale) for k in range(len(prior.verify_s))), max))
    draft = {}
    for name in drafters:
        m = measured(lambda b, name=name: snapshot.draft_s_per_token(name, b))
        draft[name] = m if m is not None else prior.draft_s_per_token.get(name, 0.0) * scale
    return CostTable(verify, draft, prior.tree_sizes)
