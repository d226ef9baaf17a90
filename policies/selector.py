"""Drafter and draft-length planning: `decide` plans a request.

It ranks arms (a drafter at its best k) by the cost model's predicted speedup over each drafter's
acceptance estimate (policies/acceptance.py) and explores across requests (UCB or Thompson on the
per-position acceptance); the per-request controller (policies/controller.py) exploits within one
request. Pure functions: no clock, no I/O; randomness only from the `rng` passed in.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from policies.acceptance import Acceptance, evidence, prior_acceptance
from policies.cost import CostTable, best_draft_len, cost_table
from policies.records import PLAIN, StatsSnapshot, context_bucket
from policies.schema import Policy

# decision reasons (also the `reason` label of routing metrics)
BEST, EXPLORE, FALLBACK, POLICY, FORCED = "best", "explore", "fallback", "policy", "forced"
SWITCH, RECOVER, PROBE = "switch", "recover", "probe"
LOW_SPEEDUP = "low_speedup"  # fallback reason: predicted speedup under the threshold
DRAFTER_ERROR = "drafter_error"  # fallback reason: the drafter raised and the engine dropped it


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
