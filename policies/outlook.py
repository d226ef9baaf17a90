"""What the policy expects of each (domain, drafter) now, and what drafting really bought a
domain: for metrics, /v1/stats and the dashboard."""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from policies.acceptance import prior_acceptance
from policies.cost import CostTable, best_draft_len, cost_table
from policies.records import PLAIN, StatsSnapshot, context_bucket
from policies.schema import Policy


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
