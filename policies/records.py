"""Value types shared by the stats store and the policy: one verify step's record, context-length
buckets, and the immutable snapshot of aggregated statistics the policy reads.

Counts only ever add, so a snapshot is a sum of counters and two snapshots merge by addition
(two windows, two stores, a remote part and a locally buffered part).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol

# The drafter name of a plain step (no draft, k = 0). Defined here, at the bottom of the
# dependency order, and imported by workers and router.
PLAIN = "none"

# Upper edges (exclusive) of the context-length buckets, and their labels; the last is open.
# Acceptance falls on long contexts, so the policy sees statistics per bucket.
CONTEXT_EDGES: tuple[int, ...] = (512, 1024, 2048)
CONTEXT_BUCKETS: tuple[str, ...] = ("0-512", "512-1k", "1k-2k", "2k+")


def context_bucket(context_len: int) -> str:
    """The label of the bucket holding `context_len` tokens."""
    for edge, label in zip(CONTEXT_EDGES, CONTEXT_BUCKETS):
        if context_len < edge:
            return label
    return CONTEXT_BUCKETS[-1]


class StepLike(Protocol):
    """What `StepRecord.from_step` reads: the engine's StepStats, without importing it."""

    drafter: str
    draft_len: int
    num_draft_tokens: int
    num_accepted: int
    draft_s: float
    verify_s: float
    context_len: int


@dataclass(frozen=True)
class StepRecord:
    """One verify step as the stats store counts it. A step that drafted no token (drafter PLAIN,
    or a drafter that proposed nothing) is a plain target step: its verify_s is a plain-step cost
    sample; its draft_s is still the asked drafter's cost."""

    domain: str
    drafter: str  # PLAIN for a step that asked no drafter
    draft_len: int  # k asked for
    num_draft_tokens: int  # k' proposed: 0 <= k'
    num_accepted: int  # 0 <= accepted <= k'
    draft_s: float
    verify_s: float
    context_len: int  # tokens before the step

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_draft_tokens:
            raise ValueError(f"need 0 <= num_accepted <= num_draft_tokens, got {self.num_accepted}, "
                             f"{self.num_draft_tokens}")
        if self.drafter == PLAIN and self.num_draft_tokens:
            raise ValueError(f"a plain step drafted {self.num_draft_tokens} tokens")
        if min(self.draft_len, self.context_len) < 0:
            raise ValueError("draft_len and context_len must be >= 0")
        if not (math.isfinite(self.draft_s) and math.isfinite(self.verify_s)
                and self.draft_s >= 0 and self.verify_s >= 0):
            raise ValueError(f"times must be finite and >= 0, got {self.draft_s}, {self.verify_s}")

    @property
    def plain(self) -> bool:
        return self.num_draft_tokens == 0

    @classmethod
    def from_step(cls, domain: str, step: StepLike) -> StepRecord:
        return cls(
            domain=domain, drafter=step.drafter, draft_len=step.draft_len,
            num_draft_tokens=step.num_draft_tokens, num_accepted=step.num_accepted,
            draft_s=step.draft_s, verify_s=step.verify_s, context_len=step.context_len,
        )


@dataclass(frozen=True)
class CostStat:
    """A cost sample kept as a sum and a count, so windows and replicas add up exactly."""

    total_s: float = 0.0
    count: int = 0

    @property
    def mean(self) -> float | None:
        return self.total_s / self.count if self.count else None

    def __add__(self, other: CostStat) -> CostStat:
        return CostStat(self.total_s + other.total_s, self.count + other.count)


def _add_tuples(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    if len(a) < len(b):
        a, b = b, a
    return tuple(x + (b[i] if i < len(b) else 0) for i, x in enumerate(a))


@dataclass(frozen=True)
class AcceptanceCounts:
    """Counters of one (domain, drafter[, context bucket]), named like vLLM's spec-decode metrics."""

    num_steps: int = 0  # every step, plain ones included (drafter PLAIN counts its plain steps)
    num_drafts: int = 0  # steps that proposed >= 1 token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: tuple[int, ...] = ()  # [i]: drafts that proposed a token at position i
    accepted_per_position: tuple[int, ...] = ()  # [i]: drafts whose token at position i was accepted

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.num_steps + other.num_steps, self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens, self.num_accepted_tokens + other.num_accepted_tokens,
            _add_tuples(self.drafted_per_position, other.drafted_per_position),
            _add_tuples(self.accepted_per_position, other.accepted_per_position),
        )

    def acceptance_by_position(self) -> list[float]:
        """accepted/drafted at each position that was ever drafted."""
        accepted = self.accepted_per_position
        return [(accepted[i] if i < len(accepted) else 0) / d for i, d in enumerate(self.drafted_per_position) if d]


def _add_maps(a: Mapping, b: Mapping) -> dict:
    out = dict(a)
    for key, value in b.items():
        out[key] = out[key] + value if key in out else value
    return out


def _sum(values: Iterable, zero):
    total = zero
    for value in values:
        total = total + value
    return total


@dataclass(frozen=True)
class StatsSnapshot:
    """Statistics over one window, at the finest grain kept; the helpers sum over context buckets
    when `bucket` is None. Costs are per deployment (hardware), not per domain."""

    # keys end with the context bucket
    acceptance: Mapping[tuple[str, str, str], AcceptanceCounts] = field(default_factory=dict)  # domain, drafter
    draft_cost: Mapping[tuple[str, str], CostStat] = field(default_factory=dict)  # drafter: seconds per draft token
    verify_cost: Mapping[tuple[int, str], CostStat] = field(default_factory=dict)  # k >= 1 draft tokens
    plain_cost: Mapping[str, CostStat] = field(default_factory=dict)  # steps with no draft token
    window_s: float | None = None  # None: all time
    degraded: bool = False  # the shared store was unreachable: last good data plus local records

    def __post_init__(self) -> None:
        for name in ("acceptance", "draft_cost", "verify_cost", "plain_cost"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def counts(self, domain: str, drafter: str, bucket: str | None = None) -> AcceptanceCounts:
        return _sum((c for (d, r, b), c in self.acceptance.items()
                     if d == domain and r == drafter and bucket in (None, b)), AcceptanceCounts())

    def acceptance_by_position(self, domain: str, drafter: str, bucket: str | None = None) -> list[float]:
        return self.counts(domain, drafter, bucket).acceptance_by_position()

    def domains(self) -> list[str]:
        return sorted({d for d, _, _ in self.acceptance})

    def drafters(self, domain: str) -> list[str]:
        return sorted({r for d, r, _ in self.acceptance if d == domain})

    def draft_s_per_token(self, drafter: str, bucket: str | None = None) -> CostStat:
        return _sum((c for (r, b), c in self.draft_cost.items() if r == drafter and bucket in (None, b)), CostStat())

    def verify_s(self, k: int, bucket: str | None = None) -> CostStat:
        if k == 0:
            return self.plain_step_s(bucket)
        return _sum((c for (n, b), c in self.verify_cost.items() if n == k and bucket in (None, b)), CostStat())

    def plain_step_s(self, bucket: str | None = None) -> CostStat:
        return _sum((c for b, c in self.plain_cost.items() if bucket in (None, b)), CostStat())

    def mean_draft_s_per_token(self, drafter: str, bucket: str | None = None) -> float | None:
        return self.draft_s_per_token(drafter, bucket).mean

    def mean_verify_s(self, k: int, bucket: str | None = None) -> float | None:
        """Mean seconds of a target forward verifying k draft tokens (k = 0: a plain step)."""
        return self.verify_s(k, bucket).mean

    def mean_plain_step_s(self, bucket: str | None = None) -> float | None:
        return self.plain_step_s(bucket).mean

    def merge(self, other: StatsSnapshot) -> StatsSnapshot:
        """The sum of two snapshots; its window is the wider of the two (None: all time)."""
        return StatsSnapshot(
            acceptance=_add_maps(self.acceptance, other.acceptance),
            draft_cost=_add_maps(self.draft_cost, other.draft_cost),
            verify_cost=_add_maps(self.verify_cost, other.verify_cost),
            plain_cost=_add_maps(self.plain_cost, other.plain_cost),
            window_s=None if None in (self.window_s, other.window_s) else max(self.window_s, other.window_s),
            degraded=self.degraded or other.degraded,
        )
