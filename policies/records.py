"""Value types shared by the stats store and the policy: one verify step's record, context-length
buckets, and the immutable snapshot of aggregated statistics the policy reads.

Counts only ever add, so a snapshot is a sum of counters and two snapshots merge by addition
(two windows, two stores, a remote part and a locally buffered part).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any, Protocol

# The drafter name of a plain step (no draft, k = 0). Defined here, at the bottom of the
# dependency order, and imported by workers and router.
PLAIN = "none"

# Upper edges (exclusive) of the context-length buckets, and their labels; the last is open.
# Acceptance and step costs move with the context (drafters trained on short windows, attention
# over more keys), so the policy keeps statistics and costs per bucket.
CONTEXT_EDGES: tuple[int, ...] = (512, 1024, 2048, 4096)
CONTEXT_BUCKETS: tuple[str, ...] = ("0-512", "512-1k", "1k-2k", "2k-4k", "4k+")


def context_bucket(context_len: int) -> str:
    """The label of the bucket holding `context_len` tokens."""
    for edge, label in zip(CONTEXT_EDGES, CONTEXT_BUCKETS):
        if context_len < edge:
            return label
    return CONTEXT_BUCKETS[-1]


@dataclass(frozen=True)
class ContextSpan:
    """The steps of one request within one context bucket (a long request crosses several)."""

    bucket: str
    num_steps: int = 0
    num_tokens: int = 0  # tokens emitted
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, num_emitted: int, num_draft_tokens: int, num_accepted: int) -> ContextSpan:
        return ContextSpan(self.bucket, self.num_steps + 1, self.num_tokens + num_emitted,
                           self.num_draft_tokens + num_draft_tokens, self.num_accepted_tokens + num_accepted)


class StepLike(Protocol):
    """What `StepRecord.from_step` reads: the engine's StepStats, without importing it."""

    drafter: str
    draft_len: int
    num_draft_tokens: int
    num_accepted: int
    num_emitted: int
    draft_s: float
    verify_s: float
    context_len: int
    num_tree_nodes: int


class ShadowLike(Protocol):
    """What `ShadowRecord.from_score` reads: a ShadowScore (workers/shadows.py)."""

    drafter: str
    context_len: int
    start: int
    num_proposed: int
    num_accepted: int


@dataclass(frozen=True)
class StepRecord:
    """One verify step as the stats store counts it. A step that drafted no token (drafter PLAIN,
    or a drafter that proposed nothing) is a plain target step: its verify_s is a plain-step cost
    sample; its draft_s is still the asked drafter's cost."""

    domain: str
    drafter: str  # PLAIN for a step that asked no drafter
    draft_len: int  # k asked for
    num_draft_tokens: int  # k' proposed: 0 <= k' (a draft tree: its depth, the positions drafted)
    num_accepted: int  # 0 <= accepted <= k'
    draft_s: float
    verify_s: float
    context_len: int  # tokens before the step
    num_emitted: int = -1  # tokens the step appended; -1: num_accepted + 1 (the usual case)
    # draft tokens the verify forward ran, the key of its cost sample; -1: k' (a chain); a tree's nodes
    num_verified: int = -1

    def __post_init__(self) -> None:
        if self.num_emitted == -1:
            object.__setattr__(self, "num_emitted", self.num_accepted + 1)
        if self.num_verified == -1:
            object.__setattr__(self, "num_verified", self.num_draft_tokens)
        if self.num_verified < self.num_draft_tokens:
            raise ValueError(f"need num_verified >= num_draft_tokens, got {self.num_verified}, {self.num_draft_tokens}")
        if not 0 <= self.num_emitted <= self.num_accepted + 1:
            raise ValueError(f"need 0 <= num_emitted <= num_accepted + 1, got {self.num_emitted}")
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
            num_emitted=step.num_emitted, num_verified=step.num_tree_nodes or step.num_draft_tokens,
        )


@dataclass(frozen=True)
class ShadowRecord:
    """A cheap drafter scored counterfactually on target-verified tokens (HedgeSpec's free
    full-information update): its proposal of `num_proposed` tokens at `context_len`, of which
    the first `num_accepted` equal the tokens the target emitted there. Only positions
    [start, num_proposed) count: a drafter that really drafted the first `start` positions of
    that step recorded them in its StepRecord already. start == 0 counts as one shadow step.
    Kept apart from real counts, so metrics report only real drafts; the policy adds both."""

    domain: str
    drafter: str
    context_len: int
    start: int
    num_proposed: int
    num_accepted: int

    def __post_init__(self) -> None:
        if not 0 <= self.num_accepted <= self.num_proposed or not 0 <= self.start <= self.num_proposed:
            raise ValueError(f"need 0 <= num_accepted, start <= num_proposed, got {self.num_accepted}, "
                             f"{self.start}, {self.num_proposed}")
        if self.drafter == PLAIN or self.context_len < 0:
            raise ValueError(f"a shadow needs a drafter and context_len >= 0, got {self.drafter!r}, "
                             f"{self.context_len}")

    @classmethod
    def from_score(cls, domain: str, score: ShadowLike) -> ShadowRecord:
        return cls(domain=domain, drafter=score.drafter, context_len=score.context_len, start=score.start,
                   num_proposed=score.num_proposed, num_accepted=score.num_accepted)


# Upper bounds (seconds) of every latency histogram's buckets; +Inf is implicit. Fixed, so
# replicas and time buckets add up bucket by bucket.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)
# histogram names: time to first token, inter-token latency, end to end (no label); the draft
# stage (label: drafter) and the verify stage (label: draft tokens verified) of each step
HISTOGRAMS = ("ttft", "itl", "e2e", "draft", "verify")


def latency_bucket(seconds: float) -> int:
    """Index of the histogram bucket holding `seconds` (len(LATENCY_BUCKETS_S) is +Inf)."""
    return bisect.bisect_left(LATENCY_BUCKETS_S, seconds)


@dataclass(frozen=True)
class RequestRecord:
    """One finished request: how it was routed, each fallback to plain, and its latencies."""

    domain: str
    drafter: str  # the drafter of its first step's plan; PLAIN when it started plain
    reason: str  # why: best, explore, probe, fallback, forced, ...
    ttft_s: float
    e2e_s: float
    fallbacks: tuple[str, ...] = ()  # the reason of each switch to plain decoding

    def __post_init__(self) -> None:
        if not (0 <= self.ttft_s <= self.e2e_s and math.isfinite(self.e2e_s)):
            raise ValueError(f"need 0 <= ttft_s <= e2e_s, finite; got {self.ttft_s}, {self.e2e_s}")


@dataclass(frozen=True)
class Histogram:
    """Bucket counts (not cumulative; the last is +Inf) plus the sum of observations."""

    counts: tuple[int, ...] = (0,) * (len(LATENCY_BUCKETS_S) + 1)
    sum_s: float = 0.0

    @property
    def count(self) -> int:
        return sum(self.counts)

    def __add__(self, other: Histogram) -> Histogram:
        return Histogram(tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)), self.sum_s + other.sum_s)


Record = StepRecord | ShadowRecord | RequestRecord


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
    num_emitted_tokens: int = 0  # tokens the steps appended (measured speedup)
    step_s: float = 0.0  # seconds the steps took, draft and verify (measured speedup)

    def __add__(self, other: AcceptanceCounts) -> AcceptanceCounts:
        return AcceptanceCounts(
            self.num_steps + other.num_steps, self.num_drafts + other.num_drafts,
            self.num_draft_tokens + other.num_draft_tokens, self.num_accepted_tokens + other.num_accepted_tokens,
            _add_tuples(self.drafted_per_position, other.drafted_per_position),
            _add_tuples(self.accepted_per_position, other.accepted_per_position),
            self.num_emitted_tokens + other.num_emitted_tokens, self.step_s + other.step_s,
        )

    def to_json(self) -> dict[str, Any]:
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> AcceptanceCounts:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})

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
    # counterfactual scores of cheap drafters (ShadowRecord), keyed like `acceptance`
    shadow: Mapping[tuple[str, str, str], AcceptanceCounts] = field(default_factory=dict)
    decisions: Mapping[tuple[str, str, str], int] = field(default_factory=dict)  # domain, drafter, reason
    fallbacks: Mapping[tuple[str, str], int] = field(default_factory=dict)  # domain, reason
    histograms: Mapping[tuple[str, str], Histogram] = field(default_factory=dict)  # name, label
    window_s: float | None = None  # None: all time
    degraded: bool = False  # the shared store was unreachable: last good data plus local records

    _MAPS = ("acceptance", "draft_cost", "verify_cost", "plain_cost", "shadow", "decisions", "fallbacks",
             "histograms")

    def __post_init__(self) -> None:
        for name in self._MAPS:
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def counts(self, domain: str, drafter: str, bucket: str | None = None) -> AcceptanceCounts:
        """Real drafts only: what metrics report."""
        return _sum((c for (d, r, b), c in self.acceptance.items()
                     if d == domain and r == drafter and bucket in (None, b)), AcceptanceCounts())

    def shadow_counts(self, domain: str, drafter: str, bucket: str | None = None) -> AcceptanceCounts:
        return _sum((c for (d, r, b), c in self.shadow.items()
                     if d == domain and r == drafter and bucket in (None, b)), AcceptanceCounts())

    def evidence(self, domain: str, drafter: str, bucket: str | None = None) -> AcceptanceCounts:
        """Real and counterfactual observations together: what the policy learns from."""
        return self.counts(domain, drafter, bucket) + self.shadow_counts(domain, drafter, bucket)

    def histogram(self, name: str, label: str | None = None) -> Histogram:
        """One histogram; label None sums over labels."""
        return _sum((h for (n, lab), h in self.histograms.items() if n == name and label in (None, lab)),
                    Histogram())

    def acceptance_by_position(self, domain: str, drafter: str, bucket: str | None = None) -> list[float]:
        return self.counts(domain, drafter, bucket).acceptance_by_position()

    def domains(self) -> list[str]:
        return sorted({d for d, _, _ in self.acceptance} | {d for d, _, _ in self.decisions})

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
            shadow=_add_maps(self.shadow, other.shadow),
            decisions=_add_maps(self.decisions, other.decisions),
            fallbacks=_add_maps(self.fallbacks, other.fallbacks),
            histograms=_add_maps(self.histograms, other.histograms),
            window_s=None if None in (self.window_s, other.window_s) else max(self.window_s, other.window_s),
            degraded=self.degraded or other.degraded,
        )

    # -- JSON: how a snapshot crosses Ray and HTTP (MappingProxyType does not pickle) ------------
    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict, maps as lists of [*key, value] rows; `from_json` restores an equal
        snapshot (json writes floats as their shortest repr, which reads back exactly)."""
        def costs(m: Mapping) -> list[list]:
            return [[*(k if isinstance(k, tuple) else (k,)), c.total_s, c.count] for k, c in m.items()]

        return {
            "acceptance": [[*k, c.to_json()] for k, c in self.acceptance.items()],
            "shadow": [[*k, c.to_json()] for k, c in self.shadow.items()],
            "draft_cost": costs(self.draft_cost),
            "verify_cost": costs(self.verify_cost),
            "plain_cost": costs(self.plain_cost),
            "decisions": [[*k, n] for k, n in self.decisions.items()],
            "fallbacks": [[*k, n] for k, n in self.fallbacks.items()],
            "histograms": [[*k, list(h.counts), h.sum_s] for k, h in self.histograms.items()],
            "window_s": self.window_s,
            "degraded": self.degraded,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StatsSnapshot:
        return cls(
            acceptance={(d, r, b): AcceptanceCounts.from_json(c) for d, r, b, c in data.get("acceptance", ())},
            shadow={(d, r, b): AcceptanceCounts.from_json(c) for d, r, b, c in data.get("shadow", ())},
            draft_cost={(r, b): CostStat(s, n) for r, b, s, n in data.get("draft_cost", ())},
            verify_cost={(int(k), b): CostStat(s, n) for k, b, s, n in data.get("verify_cost", ())},
            plain_cost={b: CostStat(s, n) for b, s, n in data.get("plain_cost", ())},
            decisions={(d, r, why): n for d, r, why, n in data.get("decisions", ())},
            fallbacks={(d, why): n for d, why, n in data.get("fallbacks", ())},
            histograms={(name, lab): Histogram(tuple(c), s) for name, lab, c, s in data.get("histograms", ())},
            window_s=data.get("window_s"),
            degraded=bool(data.get("degraded", False)),
        )


# -- continuous batching: a replica's scheduler, observed -----------------------------------------

BATCH_SIZE_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64)
STEP_TOKENS_BUCKETS: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# a request's prompt and output lengths: vLLM's 1-2-5 series
REQUEST_TOKENS_BUCKETS: tuple[float, ...] = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
# how a request left the batch (vLLM's finished_reason values): its output ended (a stop token,
# string or a complete format), reached max_tokens, was cancelled by its client, or failed
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")


@dataclass(frozen=True)
class CountHistogram:
    """Counts per bucket (upper edges inclusive, then +Inf) and the sum of what was observed."""

    edges: tuple[float, ...]
    counts: tuple[int, ...] = ()
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.counts:
            object.__setattr__(self, "counts", (0,) * (len(self.edges) + 1))
        if len(self.counts) != len(self.edges) + 1:
            raise ValueError(f"{len(self.edges)} edges need {len(self.edges) + 1} counts, got {len(self.counts)}")

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float) -> CountHistogram:
        i = bisect.bisect_left(self.edges, value)
        counts = list(self.counts)
        counts[i] += 1
        return CountHistogram(self.edges, tuple(counts), self.total + value)

    def __add__(self, other: CountHistogram) -> CountHistogram:
        if self.edges != other.edges:
            raise ValueError("histograms with different buckets do not add")
        counts = tuple(a + b for a, b in zip(self.counts, other.counts))
        return CountHistogram(self.edges, counts, self.total + other.total)


@dataclass(frozen=True)
class BatchingStats:
    """A replica's continuous batching: queue lengths and the KV positions the running requests
    reserve, now; per step since it started the requests in the forward, the rows it ran, the
    tokens it emitted and its seconds; its prefix cache's prompt tokens placed and found (vLLM's
    queries and hits) and the tokens it holds now; the running requests it preempted for ones of
    higher priority; the prompt tokens admitted, and per request that left the batch why (counts
    by FINISH_REASONS) and, for those that finished, its time queued and its lengths."""

    num_running: int = 0
    num_waiting: int = 0
    batch_size: CountHistogram = CountHistogram(BATCH_SIZE_BUCKETS)
    step_tokens: CountHistogram = CountHistogram(STEP_TOKENS_BUCKETS)
    num_emitted: int = 0
    step_s: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_held_tokens: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    kv_cache_used_tokens: int = 0
    kv_cache_tokens: int = 0  # the KV memory's positions (0: not bounded)
    finished: tuple[int, ...] = (0,) * len(FINISH_REASONS)
    queue_s: CountHistogram = CountHistogram(LATENCY_BUCKETS_S)  # the ingress's receipt to first admission
    request_prompt_tokens: CountHistogram = CountHistogram(REQUEST_TOKENS_BUCKETS)
    request_generation_tokens: CountHistogram = CountHistogram(REQUEST_TOKENS_BUCKETS)

    @property
    def goodput(self) -> float | None:
        """Tokens emitted per second of target steps."""
        return self.num_emitted / self.step_s if self.step_s > 0 else None

    @property
    def mean_batch_size(self) -> float | None:
        return self.batch_size.total / self.batch_size.count if self.batch_size.count else None

    @property
    def prefix_hit_rate(self) -> float | None:
        """The share of prompt tokens found in the prefix cache."""
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None

    @property
    def kv_cache_usage(self) -> float | None:
        """The share of the KV memory the running requests reserve (None: not bounded)."""
        return self.kv_cache_used_tokens / self.kv_cache_tokens if self.kv_cache_tokens else None

    def finish(self, reason: str, queue_s: float | None = None, num_prompt: int = 0,
               num_generated: int = 0) -> BatchingStats:
        """A request left the batch for `reason` (FINISH_REASONS); one that ran to its end brings
        its time queued (None: it was never admitted) and its lengths."""
        finished = list(self.finished)
        finished[FINISH_REASONS.index(reason)] += 1
        if reason not in ("stop", "length"):
            return replace(self, finished=tuple(finished))
        return replace(self, finished=tuple(finished),
                       queue_s=self.queue_s if queue_s is None else self.queue_s.observe(queue_s),
                       request_prompt_tokens=self.request_prompt_tokens.observe(num_prompt),
                       request_generation_tokens=self.request_generation_tokens.observe(num_generated))

    def step(self, batch_size: int, num_rows: int, num_emitted: int, step_s: float) -> BatchingStats:
        return replace(self, batch_size=self.batch_size.observe(batch_size),
                       step_tokens=self.step_tokens.observe(num_rows), num_emitted=self.num_emitted + num_emitted,
                       step_s=self.step_s + step_s)

    def __add__(self, other: BatchingStats) -> BatchingStats:
        """Two replicas' together."""
        def add(a: Any, b: Any) -> Any:
            return tuple(x + y for x, y in zip(a, b)) if isinstance(a, tuple) else a + b

        return BatchingStats(**{f.name: add(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def to_json(self) -> dict[str, Any]:
        """Counters as numbers, histograms as [counts, total]."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {name: [list(v.counts), v.total] if isinstance(v, CountHistogram) else v for name, v in values.items()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BatchingStats:
        """`to_json`'s inverse; a field a replica of an earlier version did not send keeps its default."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                continue
            if isinstance(f.default, CountHistogram):
                counts, total = data[f.name]
                values[f.name] = CountHistogram(f.default.edges, tuple(counts), float(total))
            elif isinstance(f.default, tuple):
                values[f.name] = tuple(int(n) for n in data[f.name])
            else:
                values[f.name] = type(f.default)(data[f.name])
        return cls(**values)
