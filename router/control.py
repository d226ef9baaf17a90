"""The ingress's control plane, kept out of the endpoint code: combining the worker replicas'
observations, the policy update's body, admin token and outcome.

Both control calls go to every worker replica (`DeploymentHandle.broadcast`):
- observe: a scrape then never queues behind generations holding a replica's request slots, and
  in-memory replicas add up to one view. A shared (Redis) store is read once per replica but
  counted once: every replica read the same keys.
- set_policy: each replica validates and swaps in the policy itself; a replica started later
  (autoscaling, restart) starts from the configured policy (`routing.policy`, or the Serve
  `user_config`, which Serve applies to every present and future replica).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import yaml

from policies.outlook import measured_speedup
from policies.records import StatsSnapshot
from policies.stats import SeriesPoint, StoreHealth
from router.guard import bearer_matches
from router.observation import Observation, finite
from workers.deployment import PolicyResult

ADMIN_TOKEN_ENV = "SPECROUTE_ADMIN_TOKEN"
API_KEY_ENV = "SPECROUTE_API_KEY"
CONTROL_TIMEOUT_S = 30.0  # one control call to every replica, answers included
_FIELD = re.compile(r"([A-Za-z_][\w.\-]*): ")  # a PolicyError names its field first


# -- observe -------------------------------------------------------------------------------------
def combine(observations: Sequence[Observation]) -> Observation:
    """One view of every replica's observation: a shared store's once, in-memory stores summed
    (policy and outlook: the first replica's). Store health, batching and the drafters' traffic
    memories add up over replicas."""
    first = observations[0]
    health = StoreHealth(
        first.store.backend, connected=all(o.store.connected for o in observations),
        num_errors=sum(o.store.num_errors for o in observations),
        num_pending_local=sum(o.store.num_pending_local for o in observations),
        num_dropped=sum(o.store.num_dropped for o in observations),
        last_error=next((o.store.last_error for o in observations if o.store.last_error), None),
    )
    batching, memory = first.batching, dict(first.traffic_memory)
    for o in observations[1:]:  # each replica's own scheduler and memories: always summed
        batching += o.batching
        for name, m in o.traffic_memory.items():
            memory[name] = memory[name] + m if name in memory else m
    if first.store.backend != "memory" or len(observations) == 1:
        return replace(first, store=health, batching=batching, traffic_memory=memory)
    all_time, window = _sum(o.all_time for o in observations), _sum(o.window for o in observations)
    by_start: dict[float, SeriesPoint] = {}
    for o in observations:
        for p in o.series:
            known = by_start.get(p.start_s)
            by_start[p.start_s] = p if known is None else replace(known, snapshot=known.snapshot.merge(p.snapshot))
    return replace(
        first, all_time=all_time, window=window, store=health, batching=batching, traffic_memory=memory,
        measured_speedup={d: finite(measured_speedup(window, d)) for d in first.domains},
        series=tuple(by_start[s] for s in sorted(by_start)),
    )


def _sum(snapshots: Any) -> StatsSnapshot:
    snapshots = list(snapshots)
    total = snapshots[0]
    for s in snapshots[1:]:
        total = total.merge(s)
    return total


# -- PUT /v1/policy ------------------------------------------------------------------------------
class ControlError(Exception):
    """A refused control request: HTTP status, message, the field it names."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def check_admin_token(expected: str | None, authorization: str | None) -> None:
    """Nothing to check without a configured token; else `Authorization: Bearer <token>`."""
    if expected and not bearer_matches(expected, authorization):
        raise ControlError(401, "this endpoint needs the admin token: Authorization: Bearer <token>",
                           code="invalid_admin_token")


def parse_policy_body(raw: bytes) -> dict[str, Any]:
    """A policy body, YAML or JSON (YAML parses both), as a mapping. Never a path: a request names
    no file on the server."""
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise ControlError(400, f"policy is not valid YAML or JSON: {' '.join(str(e).split())}") from None
    if not isinstance(data, dict):
        raise ControlError(400, f"policy: expected a mapping at the top level, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class PolicyUpdate:
    """What PUT /v1/policy answers on success."""

    version: str
    replicas: list[str]  # the worker replicas now running it

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)


def policy_outcome(answers: Sequence[PolicyResult | BaseException]) -> PolicyUpdate:
    """Every replica's answer to set_policy as one outcome; raises ControlError unless all took it.
    Replicas validate alike (same engine, same files), so a bad policy is refused by all: 400."""
    results = [a for a in answers if isinstance(a, PolicyResult)]
    failed = [a for a in answers if not isinstance(a, PolicyResult)]
    refused = [r for r in results if r.error is not None]
    if results and len(refused) == len(answers):
        message = refused[0].error or ""
        match = _FIELD.match(message)
        raise ControlError(400, message, match.group(1) if match else None, "invalid_policy")
    if refused or failed or not results:
        detail = "; ".join([*(r.error or "" for r in refused), *(repr(e) for e in failed)]) or "no replica answered"
        raise ControlError(500, f"policy reached {len(results) - len(refused)} of {len(answers)} replicas: {detail}")
    return PolicyUpdate(results[0].version, [r.replica for r in results])
