"""Acceptance estimates: what the policy believes a drafter accepts per draft position.

Evidence is real drafts plus counterfactual (shadow) scores of cheap drafters, blended with the
policy's prior as `prior_steps` pseudo-observations per position, so a thin window leans on the
prior and a full one on the data. Statistics are read for the request's context-length bucket
once that bucket holds `window.min_draft_tokens` draft tokens, else across buckets. Pure
functions; randomness only from the `rng` passed in.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from policies.records import AcceptanceCounts, StatsSnapshot
from policies.schema import DEFAULT_PRIOR, MAX_DRAFT_LEN, DomainPolicy


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
