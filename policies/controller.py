"""The per-request controller: `StepController` re-plans one request before every step.

It exploits within one request: its own acceptance refines the plan's estimate, a collapsing
drafter is swapped for a better one, and when nothing beats `fallback_threshold` it decodes
plainly, returning only above threshold + hysteresis (or when a probe finds a drafter that
pays). Plain state: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from policies.acceptance import Acceptance
from policies.cost import BestDraftLen, CostTable, best_draft_len, predicted_speedup
from policies.records import PLAIN, AcceptanceCounts
from policies.schema import MAX_DRAFT_LEN, DomainPolicy, ExplorationSettings
from policies.selector import (
    BEST,
    DRAFTER_ERROR,
    FALLBACK,
    LOW_SPEEDUP,
    PROBE,
    RECOVER,
    SWITCH,
    ArmValue,
    Plan,
)

REQUEST_PRIOR_STEPS = 8.0  # weight of the global estimate against one request's own steps


@dataclass(frozen=True)
class FirstTry:
    """A cheap drafter asked before the step's drafter (DomainPolicy.cheap_first): its
    draft of up to `draft_len` tokens takes the step when it proposes any."""

    drafter: str
    draft_len: int


@dataclass(frozen=True)
class StepChoice:
    drafter: str
    draft_len: int
    reason: str  # the plan's reason on the first step; then BEST, SWITCH, FALLBACK, RECOVER, PROBE
    predicted_speedup: float
    # cheap drafters tried in order before `drafter`: the first that proposes takes the step
    first: tuple[FirstTry, ...] = ()


@dataclass
class _Local:
    """One drafter's observations within the request."""

    num_steps: int = 0
    num_drafts: int = 0
    drafted: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_LEN)
    accepted: list[int] = field(default_factory=lambda: [0] * MAX_DRAFT_LEN)

    def counts(self) -> AcceptanceCounts:
        return AcceptanceCounts(num_steps=self.num_steps, num_drafts=self.num_drafts,
                                drafted_per_position=tuple(self.drafted), accepted_per_position=tuple(self.accepted))

    def add(self, start: int, num_proposed: int, num_accepted: int) -> None:
        if start == 0:
            self.num_steps += 1
            self.num_drafts += num_proposed > 0
        for i in range(start, min(num_proposed, MAX_DRAFT_LEN)):
            self.drafted[i] += 1
            self.accepted[i] += i < num_accepted


class StepController:
    """Re-plans one request before every step.

    Each drafter's estimate starts as the plan's (global) estimate, worth REQUEST_PRIOR_STEPS
    steps, and adds this request's own steps and shadow scores. Every step picks the drafter
    and k with the best predicted speedup as if the request ran alone; in a batch the goodput
    rule (policies/batching.py) then caps k against the other requests' rows. Drafting stops
    when it falls below the domain's fallback threshold and resumes only above threshold +
    hysteresis; meanwhile a drafter that gets no shadow scores (not cheap) is probed every
    `probe_every_steps` steps at k_min.
    """

    def __init__(
        self, plan: Plan, dp: DomainPolicy, exploration: ExplorationSettings, cheap: Iterable[str] = (), *,
        allow_plain: bool = True, adaptive: bool = True,
    ) -> None:
        """`allow_plain`: may fall back to plain (False when a request forces its drafter);
        `adaptive`: re-plan every step (False when a request fixes its k)."""
        self.plan, self.dp, self.exploration = plan, dp, exploration
        self.cheap = frozenset(cheap)
        self.adaptive = adaptive and bool(plan.estimates)  # a plan without estimates has one arm
        self.costs = plan.costs or CostTable.relative()
        self.fallback_allowed = allow_plain and PLAIN in dp.drafters
        self._prior = {name: _request_prior(est) for name, est in plan.estimates.items()}
        self._local = {name: _Local() for name in self._prior}
        # derived from the estimates, per drafter: an observation clears only its drafter's (a
        # step changes one or two of them, and re-pricing every arm every step is the
        # controller's main cost in a batch of many requests)
        self._estimates: dict[str, Acceptance] = {}
        self._arms: dict[str, ArmValue] = {}
        self._given: dict[str, BestDraftLen | None] = {}  # a cheap drafter's arm given it proposes
        self._ranked: list[ArmValue] | None = None  # of every arm; any change clears it
        self._disabled: set[str] = set()
        self.current = StepChoice(plan.drafter, plan.draft_len, plan.reason, plan.predicted_speedup)
        self.plain = plan.drafter == PLAIN
        self._first = True
        self._plain_steps = 0
        # the reason of each switch to plain, a plan that starts plain included
        self.fallbacks: list[str] = [LOW_SPEEDUP] if plan.reason == FALLBACK else []
        self.trajectory: list[tuple[str, int]] = []  # (drafter, k) per step

    def rebase(self, plan: Plan) -> None:
        """The request reached another context bucket: that bucket's global estimates and step
        costs (`plan`, decided for it) become the prior; the request's own observations stay."""
        if not self.adaptive:
            return
        self.costs = plan.costs or self.costs
        for name, est in plan.estimates.items():
            if name in self._prior:
                self._prior[name] = _request_prior(est)
        self._forget()

    def knows(self, drafter: str) -> bool:
        """Whether this request has an acceptance estimate for `drafter` (its plan's candidates)."""
        return drafter in self._prior

    def estimate(self, drafter: str) -> Acceptance:
        if drafter not in self._estimates:
            self._estimates[drafter] = self._prior[drafter].update(self._local[drafter].counts())
        return self._estimates[drafter]

    def ranked(self) -> list[ArmValue]:
        """Every usable drafter at its best k, best first (computed once between observations)."""
        if self._ranked is None:
            self._ranked = self._rank()
        return self._ranked

    def _rank(self) -> list[ArmValue]:
        arms = [self._arm(name) for name in self._prior if name not in self._disabled]
        return sorted(arms, key=lambda a: -a.predicted_speedup)

    def _arm(self, name: str) -> ArmValue:
        if name not in self._arms:
            est = self.estimate(name)
            costs = self.costs.for_estimate(name, est)
            best = best_draft_len(est.prefix, costs, self.dp.k_min, self.dp.k_max)
            if best.draft_len == 0 and not self.fallback_allowed:  # no plain to fall back to: draft least
                best = BestDraftLen(self.dp.k_min, predicted_speedup(est.prefix, self.dp.k_min, costs))
            self._arms[name] = ArmValue(name, best.draft_len, best.speedup, best.speedup, est.weight[0])
        return self._arms[name]

    def _given_arm(self, name: str) -> BestDraftLen | None:
        """A cheap drafter's best k and speedup given that it proposes (None: it never has)."""
        if name not in self._given:
            est = self.estimate(name)
            arm = None
            if est.proposes > 0:
                given = tuple(min(1.0, p / est.proposes) for p in est.prefix)
                reach = None if est.proposed is None else tuple(min(1.0, r / est.proposes) for r in est.proposed)
                arm = best_draft_len(given, self.costs.for_drafter(name, 1.0, reach), self.dp.k_min, self.dp.k_max)
            self._given[name] = arm
        return self._given[name]

    def _forget(self, drafter: str | None = None) -> None:
        """Drop what was derived from `drafter`'s estimate (None: every drafter's)."""
        for derived in (self._estimates, self._arms, self._given):
            if drafter is None:
                derived.clear()
            else:
                derived.pop(drafter, None)
        self._ranked = None

    def next(self) -> StepChoice:
        choice = self._next()
        if self.adaptive and self.dp.cheap_first:
            choice = self._with_cheap_first(choice)
        self.current = choice
        self.trajectory.append((choice.drafter, choice.draft_len))
        return choice

    def _next(self) -> StepChoice:
        if self._first or not self.adaptive:  # a fixed plan: the engine plains a dropped drafter
            self._first = False
            return self.current
        arms = [a for a in self.ranked() if a.draft_len > 0]
        best = arms[0] if arms else None
        threshold = self.dp.fallback_threshold
        if not self.plain:
            if best is None or (self.fallback_allowed and best.predicted_speedup < threshold):
                # a dropped drafter's fallback was counted when the engine dropped it
                return self._to_plain(None if self.current.drafter in self._disabled else LOW_SPEEDUP)
            reason = BEST if best.drafter == self.current.drafter else SWITCH
            return StepChoice(best.drafter, best.draft_len, reason, best.predicted_speedup)
        # plain: come back when the estimate clears threshold + hysteresis, or probe
        self._plain_steps += 1
        if best is not None and best.predicted_speedup > threshold + self.dp.hysteresis:
            self.plain = False
            return StepChoice(best.drafter, best.draft_len, RECOVER, best.predicted_speedup)
        if self._plain_steps % self.exploration.probe_every_steps == 0:
            blind = [a for a in self.ranked() if a.drafter not in self.cheap]
            if blind:
                return StepChoice(blind[0].drafter, self.dp.k_min, PROBE, blind[0].predicted_speedup)
        return StepChoice(PLAIN, 0, FALLBACK if self.fallbacks else self.plan.reason, 1.0)

    def _with_cheap_first(self, choice: StepChoice) -> StepChoice:
        """Prompt lookup proposes on some steps only, and well on those: every cheap drafter whose
        acceptance given a proposal (its estimate over its propose rate) predicts a better step
        than what runs otherwise is tried first, the best first, so a step one of them has
        nothing for falls through to the next. What runs otherwise: the choice, or for a cheap
        choice the best other drafter that beats the fallback threshold (else plain)."""
        given_arms: list[tuple[str, BestDraftLen]] = []
        for name in sorted(self.cheap):
            if name not in self._prior or name in self._disabled:
                continue
            arm = self._given_arm(name)
            if arm is not None and arm.draft_len:
                given_arms.append((name, arm))
        if not given_arms:
            return choice
        otherwise = choice
        if choice.drafter in self.cheap:
            others = [a for a in self.ranked() if a.drafter not in self.cheap and a.draft_len > 0
                      and a.predicted_speedup >= self.dp.fallback_threshold]
            otherwise = (StepChoice(others[0].drafter, others[0].draft_len, choice.reason, others[0].predicted_speedup)
                         if others else StepChoice(PLAIN, 0, choice.reason, 1.0))
        bar = (otherwise.predicted_speedup if otherwise.drafter != PLAIN
               else self.dp.fallback_threshold + self.dp.hysteresis)
        tries = tuple(FirstTry(name, arm.draft_len)
                      for name, arm in sorted(given_arms, key=lambda a: -a[1].speedup) if arm.speedup > bar)
        if not tries:
            return choice
        return replace(otherwise, first=tries)

    def _to_plain(self, reason: str | None) -> StepChoice:
        self.plain = True
        self._plain_steps = 0
        if reason is not None:
            self.fallbacks.append(reason)
        return StepChoice(PLAIN, 0, FALLBACK, 1.0)

    def observe(self, drafter: str, num_proposed: int, num_accepted: int) -> None:
        """A real step's outcome. A step that used another drafter than chosen (the engine
        dropped a failing drafter) disables the chosen one for the rest of the request."""
        chosen = self.current.drafter
        if any(t.drafter == drafter for t in self.current.first):  # a cheap drafter proposed and took the step
            chosen = drafter
        if chosen != PLAIN and drafter != chosen and chosen not in self._disabled:
            self._disabled.add(chosen)
            self._ranked = None
            self.fallbacks.append(DRAFTER_ERROR)
        if drafter in self._local:
            self._local[drafter].add(0, num_proposed, num_accepted)
            self._forget(drafter)

    def observe_shadow(self, drafter: str, start: int, num_proposed: int, num_accepted: int) -> None:
        if drafter in self._local:
            self._local[drafter].add(start, num_proposed, num_accepted)
            self._forget(drafter)


def _request_prior(estimate: Acceptance) -> Acceptance:
    """A global estimate as one request's prior: worth at most REQUEST_PRIOR_STEPS steps."""
    return replace(estimate, weight=tuple(min(w, REQUEST_PRIOR_STEPS) for w in estimate.weight),
                   proposes_weight=min(estimate.proposes_weight, REQUEST_PRIOR_STEPS))
