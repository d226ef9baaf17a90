"""The ingress's typed view of `TargetWorker.observe()`: what /metrics, /v1/stats and the dashboard
render. The worker returns plain JSON-able data (snapshots cross Ray as `StatsSnapshot.to_json()`);
this module turns it back into value types, once, for every renderer.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from policies.records import BatchingStats, StatsSnapshot
from policies.stats import SeriesPoint, StoreHealth
from router.response_store import ResponseStoreHealth


@dataclass(frozen=True)
class ArmView:
    """The policy's current estimate for one (domain, drafter): the k it would pick and the
    speedup it predicts there."""

    domain: str
    drafter: str
    draft_len: int
    predicted_speedup: float | None  # None when the estimate is not a finite number


@dataclass(frozen=True)
class TrafficMemoryView:
    """What a drafter that learns from traffic holds on the replica (workers TrafficMemory)."""

    tokens: Mapping[str, int]  # per domain
    max_tokens: int  # its budget over all domains

    def __add__(self, other: TrafficMemoryView) -> TrafficMemoryView:
        """Two replicas' memories together (each replica keeps its own)."""
        tokens = dict(self.tokens)
        for domain, n in other.tokens.items():
            tokens[domain] = tokens.get(domain, 0) + n
        return TrafficMemoryView(tokens, self.max_tokens + other.max_tokens)


@dataclass(frozen=True)
class BackgroundResponses:
    num_held: int  # background responses an ingress holds, queued or generated
    max_held: int  # its max_background_responses


@dataclass(frozen=True)
class Observation:
    replica: str  # the worker replica that answered
    policy_version: str
    domains: tuple[str, ...]  # the policy's domains: the only `domain` label values exposed
    drafters: tuple[str, ...]  # the engine's drafters: the only `drafter` label values (plus PLAIN)
    max_draft_len: int
    window_s: float  # the policy's statistics window
    all_time: StatsSnapshot
    window: StatsSnapshot
    outlook: tuple[ArmView, ...]
    measured_speedup: Mapping[str, float | None]  # domain -> over the window
    store: StoreHealth
    series: tuple[SeriesPoint, ...] = ()  # one per store time bucket of the window, oldest first
    batching: BatchingStats = BatchingStats()  # the replica's scheduler (replicas add up)
    # per drafter that learns from traffic (suffix): tokens held per domain, and its budget
    traffic_memory: Mapping[str, TrafficMemoryView] = field(default_factory=dict)
    response_store: ResponseStoreHealth | None = None  # the ingress's stored responses (set by the ingress)
    background: BackgroundResponses | None = None  # set by the ingress

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Observation:
        return cls(
            replica=data.get("replica", ""),
            policy_version=data["policy_version"],
            domains=tuple(data["domains"]),
            drafters=tuple(data["drafters"]),
            max_draft_len=int(data["max_draft_len"]),
            window_s=float(data["window_s"]),
            all_time=StatsSnapshot.from_json(data["all_time"]),
            window=StatsSnapshot.from_json(data["window"]),
            outlook=tuple(ArmView(a["domain"], a["drafter"], int(a["draft_len"]), finite(a["predicted_speedup"]))
                          for a in data["outlook"]),
            measured_speedup={d: finite(v) for d, v in data["measured_speedup"].items()},
            store=StoreHealth(**data["store"]),
            series=tuple(SeriesPoint(p["start_s"], p["bucket_s"], StatsSnapshot.from_json(p["snapshot"]))
                         for p in data.get("series", ())),
            batching=BatchingStats.from_json(data["batching"]) if "batching" in data else BatchingStats(),
            traffic_memory={name: TrafficMemoryView(dict(m["tokens"]), int(m["max_tokens"]))
                            for name, m in data.get("traffic_memory", {}).items()},
        )


def finite(value: float | None) -> float | None:
    """JSON and Prometheus gauges get None (left out) rather than inf or nan."""
    return value if value is not None and math.isfinite(value) else None
