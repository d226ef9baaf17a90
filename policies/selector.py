"""Drafter and draft-length selection: `decide` plans a request, `StepController` re-plans it
every step.

Both rank arms (a drafter at its best k) by the cost model's predicted speedup. Acceptance comes
from evidence, real drafts plus counterfactual (shadow) scores of cheap drafters, blended with
the policy's prior as `prior_steps` pseudo-observations per position, so a thin window leans on
the prior and a full one on the data. Statistics are read for the request's context-length
bucket once that bucket holds `window.min_draft_tokens` draft tokens, else across buckets.

`decide` explores (UCB or Thompson on the per-position acceptance) across requests; the
controller exploits within one request: its own acceptance refines the plan's estimate, a
collapsing drafter is swapped for a better one, and when nothing beats `fallback_threshold` it
decodes plainly, returning only above threshold + hysteresis (or when a probe finds a drafter
that pays). Pure functions and plain state: no clock, no I/O; randomness only from the `rng`
passed in.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from policies.cost import ALONE, BestDraftLen, RoundLoad, StepCosts, best_draft_len, predicted_speedup
from policies.records import PLAIN, AcceptanceCounts, StatsSnapshot, context_bucket
from policies.schema import DEFAULT_PRIOR, MAX_DRAFT_LEN, DomainPolicy, ExplorationSettings, Policy

# Until measured, a verify of k draft tokens costs (1 + VERIFY_SLOPE * k) plain steps; the
# measured curve on the default CPU target is close (docs/benchmarks.md, "verify cost").
VERIFY_SLOPE = 0.075
MIN_COST_SAMPLES = 3  # measured cost samples before they replace the prior for one k
REQUEST_PRIOR_STEPS = 8.0  # weight of the global estimate against one request's own steps

# decision reasons (also the `reason` label of routing metrics)
BEST, EXPLORE, FALLBACK, POLICY, FORCED = "best", "explore", "fallback", "policy", "forced"
SWITCH, RECOVER, PROBE = "switch", "recover", "probe"
LOW_SPEEDUP = "low_speedup"  # fallback reason: predicted speedup under the threshold
DRAFTER_ERROR = "drafter_error"  # fallback reason: the drafter raised and the engine dropped it


# -- costs ---------------------------------------------------------------------------------------

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


# -- acceptance ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Acceptance:
    """An arm's acceptance estimate: prefix[i] = P(a step asking k > i gets its first i + 1 draft
    tokens proposed and accepted), non-increasing; weight[i] = observations behind it (prior
    pseudo-observations included)."""

    prefix: tuple[float, ...]
    weight: tuple[float, ...]
    proposes: float = 1.0  # P(a step asking this drafter gets a proposal at all)
    proposes_weight: float = 0.0  # steps behind `proposes` (the prior assumes it always proposes)
    # of a drafter the engine asks for max_draft_len on every step (the cheap ones, scored as
    # shadows): P(a step gets a token proposed at position i), non-increasing (the prior: always);
    # None: a drafter that proposes all it is asked or nothing
    proposed: tuple[float, ...] | None = None

    @classmethod
    def geometric(cls, rate: float, weight: float, length: int = MAX_DRAFT_LEN, own_length: bool = False) -> Acceptance:
        return cls(tuple(rate ** (i + 1) for i in range(length)), (weight,) * length,
                   proposed=(1.0,) * length if own_length else None)

    @property
    def own_length(self) -> bool:
        """Proposes as far as it can, asked for every position: its position counts are over
        every step, and `proposed` says how far it reaches."""
        return self.proposed is not None

    def update(self, counts: AcceptanceCounts) -> Acceptance:
        """The posterior after `counts`: per position, (observed accepted + weight * prior) /
        (asked steps behind the position + weight). The
        prior at position i is the posterior at i - 1 times this estimate's conditional rate
        prefix[i] / prefix[i - 1], so a position not yet drafted follows what the earlier ones
        showed instead of staying at its absolute prior (which would pin k where it started)."""
        if counts.num_steps == 0 and not counts.drafted_per_position:
            return self
        # A step asked for a draft is one observation of "proposed and accepted up to i". Steps
        # that proposed are counted per position (drafted[i]); those that stayed silent only in
        # total, so each proposal at i stands for steps / drafts asked steps. (Shadow tails add
        # position counts without steps: they share the rate of the steps that did count.)
        # An own-length drafter was asked for every position on every step, so each step counts
        # at every position.
        steps_per_draft = counts.num_steps / counts.num_drafts if counts.num_drafts else 1.0
        drafted, accepted = counts.drafted_per_position, counts.accepted_per_position
        prefix, weight, proposed, floor, reach = [], [], [], 1.0, 1.0
        for i, (p, w) in enumerate(zip(self.prefix, self.weight)):
            d = drafted[i] if i < len(drafted) else 0
            a = accepted[i] if i < len(accepted) else 0
            if self.own_length:
                n = max(counts.num_steps, d)
            else:
                n = d * steps_per_draft if counts.num_drafts else counts.num_steps  # asked steps behind i
            before = self.prefix[i - 1] if i else 1.0
            p = floor * p / before if before > 0 else p  # the prior's conditional rate, on the posterior so far
            q = (a + w * p) / (n + w) if n + w > 0 else p
            floor = min(floor, q)  # P(first i + 1 accepted) cannot exceed P(first i accepted)
            prefix.append(floor)
            weight.append(n + w)
            if self.own_length:
                r = self.proposed[i]
                reach = min(reach, (d + w * r) / (n + w) if n + w > 0 else r)
                proposed.append(reach)
        steps = self.proposes_weight + counts.num_steps
        rate = (self.proposes * self.proposes_weight + counts.num_drafts) / steps if steps else self.proposes
        return replace(self, prefix=tuple(prefix), weight=tuple(weight), proposes=min(1.0, rate),
                       proposes_weight=steps, proposed=tuple(proposed) if self.own_length else None)

    def optimistic(self, c: float, total: float) -> Acceptance:
        """UCB: each position raised by c * sqrt(p (1 - p) ln(total + 1) / weight) + c / weight."""
        log_n = math.log(total + 1.0)
        raised, floor = [], 1.0
        for p, w in zip(self.prefix, self.weight):
            bonus = c * (math.sqrt(p * (1 - p) * log_n / w) + 1.0 / w) if w > 0 else 1.0
            floor = min(floor, min(1.0, p + bonus))
            raised.append(floor)
        return replace(self, prefix=tuple(raised))

    def sample(self, rng: random.Random) -> Acceptance:
        """Thompson: each position from Beta(p w + 1, (1 - p) w + 1), kept non-increasing."""
        drawn, floor = [], 1.0
        for p, w in zip(self.prefix, self.weight):
            floor = min(floor, rng.betavariate(p * w + 1.0, (1.0 - p) * w + 1.0))
            drawn.append(floor)
        return replace(self, prefix=tuple(drawn))


def prior_acceptance(dp: DomainPolicy, drafter: str, prior_steps: float, own_length: bool = False) -> Acceptance:
    return Acceptance.geometric(dp.priors.get(drafter, DEFAULT_PRIOR), prior_steps, own_length=own_length)


def evidence(
    snapshot: StatsSnapshot, domain: str, drafter: str, bucket: str, min_draft_tokens: int,
) -> AcceptanceCounts:
    """Real plus shadow counts of this context bucket when it holds enough, else of all buckets."""
    in_bucket = snapshot.evidence(domain, drafter, bucket)
    if sum(in_bucket.drafted_per_position) >= max(min_draft_tokens, 1):
        return in_bucket
    return snapshot.evidence(domain, drafter)


# -- decide --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Features:
    domain: str
    context_len: int  # prompt tokens


@dataclass(frozen=True)
class ArmValue:
    drafter: str
    draft_len: int  # the k to play: best by the score (decide) or the estimate; 0: cannot beat plain
    predicted_speedup: float  # the estimate's best speedup over k
    score: float  # what the choice ranked: optimistic (ucb) or sampled (thompson) speedup
    weight: float  # observations behind position 0, prior included


@dataclass(frozen=True)
class Plan:
    domain: str
    drafter: str  # PLAIN: plain decoding
    draft_len: int  # 0 for plain
    predicted_speedup: float  # of the chosen arm by the estimate (1.0 for plain)
    reason: str  # BEST, EXPLORE, FALLBACK, POLICY or FORCED
    arms: tuple[ArmValue, ...] = ()
    estimates: Mapping[str, Acceptance] = field(default_factory=dict, repr=False)
    costs: CostTable | None = field(default=None, repr=False)


def decide(
    features: Features, snapshot: StatsSnapshot, policy: Policy, rng: random.Random,
    prior_costs: CostTable | None = None, drafters: Sequence[str] | None = None, own_length: Collection[str] = (),
) -> Plan:
    """The plan of one request: the arm with the best exploration score, or plain decoding when
    no drafter's score reaches the domain's fallback threshold. `drafters` replaces the domain's
    list (with what the engine has of it, or with the one drafter a request names); `own_length`:
    the drafters asked for every position on every step (Acceptance.own_length)."""
    dp = policy.domains[features.domain]
    allowed = list(dp.drafters if drafters is None else drafters)
    candidates = [d for d in allowed if d != PLAIN]
    bucket = context_bucket(features.context_len)
    costs = cost_table(snapshot, bucket, prior_costs, candidates)
    if not candidates:
        return Plan(features.domain, PLAIN, 0, 1.0, POLICY, costs=costs)

    ex = policy.exploration
    estimates, counts = {}, {}
    for name in candidates:
        counts[name] = evidence(snapshot, features.domain, name, bucket, policy.window.min_draft_tokens)
        estimates[name] = prior_acceptance(dp, name, ex.min_samples, name in own_length).update(counts[name])
    total = sum(c.num_steps for c in counts.values()) + 1.0
    arms = []
    for name in candidates:
        step_costs = costs.for_estimate(name, estimates[name])
        mean = best_draft_len(estimates[name].prefix, step_costs, dp.k_min, dp.k_max)
        explored = (estimates[name].optimistic(ex.ucb_c, total) if ex.method == "ucb"
                    else estimates[name].sample(rng))
        score = best_draft_len(explored.prefix, step_costs, dp.k_min, dp.k_max)
        # play the k the score ranked: an optimistic k never played never loses its bonus, so k
        # would stay where the first estimate put it (the controller exploits from step 2 on)
        k = score.draft_len or mean.draft_len
        arms.append(ArmValue(name, k, mean.speedup, score.speedup, estimates[name].weight[0]))

    chosen = max(arms, key=lambda a: (a.score, a.predicted_speedup))
    if PLAIN in allowed and (chosen.score < dp.fallback_threshold or chosen.draft_len == 0):
        return Plan(features.domain, PLAIN, 0, 1.0, FALLBACK, tuple(arms), estimates, costs)
    best_mean = max(arms, key=lambda a: a.predicted_speedup)
    reason = BEST if chosen.drafter == best_mean.drafter else EXPLORE
    return Plan(features.domain, chosen.drafter, max(chosen.draft_len, dp.k_min), chosen.predicted_speedup,
                reason, tuple(arms), estimates, costs)


def forced_plan(domain: str, drafter: str, draft_len: int) -> Plan:
    """A request that names its drafter and k: no routing."""
    return Plan(domain, drafter if draft_len > 0 else PLAIN, draft_len if drafter != PLAIN else 0, 1.0, FORCED)


# -- the per-request controller ------------------------------------------------------------------

@dataclass(frozen=True)
class FirstTry:
    """A cheap drafter the engine asks before the step's drafter (DomainPolicy.cheap_first): its
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
    and k with the best predicted speedup: of the replica's throughput, when `load` says other
    requests share the replica (policies/cost.py), so a drafter that speeds this request up
    by slowing the others more is turned down. Drafting stops when it falls below the domain's
    fallback threshold and resumes only above threshold + hysteresis; meanwhile a drafter that
    gets no shadow scores (not cheap) is probed every `probe_every_steps` steps at k_min.
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
        self._estimates: dict[str, Acceptance] = {}  # of this step: observations clear it
        self._disabled: set[str] = set()
        self.current = StepChoice(plan.drafter, plan.draft_len, plan.reason, plan.predicted_speedup)
        self.plain = plan.drafter == PLAIN
        self._first = True
        self._plain_steps = 0
        # the reason of each switch to plain, a plan that starts plain included
        self.fallbacks: list[str] = [LOW_SPEEDUP] if plan.reason == FALLBACK else []
        self.trajectory: list[tuple[str, int]] = []  # (drafter, k) per step
        # the other requests of the replica (policies/cost.py), set before each step by the caller
        self.load: RoundLoad = ALONE

    def rebase(self, plan: Plan) -> None:
        """The request reached another context bucket: that bucket's global estimates and step
        costs (`plan`, decided for it) become the prior; the request's own observations stay."""
        if not self.adaptive:
            return
        self.costs = plan.costs or self.costs
        for name, est in plan.estimates.items():
            if name in self._prior:
                self._prior[name] = _request_prior(est)
        self._estimates.clear()

    def knows(self, drafter: str) -> bool:
        """Whether this request has an acceptance estimate for `drafter` (its plan's candidates)."""
        return drafter in self._prior

    def estimate(self, drafter: str) -> Acceptance:
        if drafter not in self._estimates:
            self._estimates[drafter] = self._prior[drafter].update(self._local[drafter].counts())
        return self._estimates[drafter]

    def ranked(self) -> list[ArmValue]:
        """Every usable drafter at its best k, best first."""
        arms = []
        for name in self._prior:
            if name in self._disabled:
                continue
            est = self.estimate(name)
            costs = self.costs.for_estimate(name, est)
            best = best_draft_len(est.prefix, costs, self.dp.k_min, self.dp.k_max, self.load)
            if best.draft_len == 0 and not self.fallback_allowed:  # no plain to fall back to: draft least
                best = BestDraftLen(self.dp.k_min, predicted_speedup(est.prefix, self.dp.k_min, costs, self.load))
            arms.append(ArmValue(name, best.draft_len, best.speedup, best.speedup, est.weight[0]))
        return sorted(arms, key=lambda a: -a.predicted_speedup)

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
        # under load a request's own gain moves the replica's throughput by about 1 / (1 + B) of it:
        # the hysteresis shrinks alike, or a shared replica would never come back
        if best is not None and best.predicted_speedup > threshold + self.dp.hysteresis / (1 + self.load.plain_steps):
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
            est = self.estimate(name)
            if est.proposes <= 0:
                continue
            given = tuple(min(1.0, p / est.proposes) for p in est.prefix)
            reach = None if est.proposed is None else tuple(min(1.0, r / est.proposes) for r in est.proposed)
            arm = best_draft_len(given, self.costs.for_drafter(name, 1.0, reach), self.dp.k_min, self.dp.k_max,
                                 self.load)
            if arm.draft_len:
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
            self.fallbacks.append(DRAFTER_ERROR)
        if drafter in self._local:
            self._local[drafter].add(0, num_proposed, num_accepted)
            self._estimates.pop(drafter, None)

    def observe_shadow(self, drafter: str, start: int, num_proposed: int, num_accepted: int) -> None:
        if drafter in self._local:
            self._local[drafter].add(start, num_proposed, num_accepted)
            self._estimates.pop(drafter, None)


def _request_prior(estimate: Acceptance) -> Acceptance:
    """A global estimate as one request's prior: worth at most REQUEST_PRIOR_STEPS steps."""
    return replace(estimate, weight=tuple(min(w, REQUEST_PRIOR_STEPS) for w in estimate.weight),
                   proposes_weight=min(estimate.proposes_weight, REQUEST_PRIOR_STEPS))


# -- reporting -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ArmOutlook:
    """What the policy expects of one (domain, drafter) now, for metrics and dashboards."""

    domain: str
    drafter: str
    draft_len: int  # best k by the estimate (0: it cannot beat plain)
    predicted_speedup: float
    acceptance: tuple[float, ...]  # the estimate's prefix probabilities, first k_max positions


def outlook(snapshot: StatsSnapshot, policy: Policy, prior_costs: CostTable | None = None,
            drafters: Iterable[str] | None = None, own_length: Collection[str] = ()) -> list[ArmOutlook]:
    """The estimate `decide` ranks by, without exploration, for every domain and drafter of the
    policy (that the engine has, when `drafters` is given), over all context lengths."""
    have = None if drafters is None else set(drafters)
    out = []
    for domain, dp in policy.domains.items():
        names = [d for d in dp.drafters if d != PLAIN and (have is None or d in have)]
        costs = cost_table(snapshot, context_bucket(0), prior_costs, names)
        for name in names:
            est = prior_acceptance(dp, name, policy.exploration.min_samples, name in own_length).update(
                snapshot.evidence(domain, name))
            best = best_draft_len(est.prefix, costs.for_estimate(name, est), dp.k_min, dp.k_max)
            out.append(ArmOutlook(domain, name, best.draft_len, best.speedup, est.prefix[: dp.k_max]))
    return out


def measured_speedup(snapshot: StatsSnapshot, domain: str) -> float | None:
    """What drafting really bought a domain: emitted tokens per step second, over plain decoding's
    tokens per second (the measured plain step). None before both are measured."""
    counts = [c for (d, _, _), c in snapshot.acceptance.items() if d == domain]
    step_s = sum(c.step_s for c in counts)
    plain_s = snapshot.mean_plain_step_s()
    if not step_s or not plain_s:
        return None
    return sum(c.num_emitted_tokens for c in counts) * plain_s / step_s
