"""Live speculative-decoding statistics: a `StatsStore` protocol with an in-process backend and a
Redis backend that several router replicas share.

Both keep the same flat counters: one field per (kind, name, context bucket, statistic), added to
an all-time set (never expires) and to the set of the current time bucket (default 10 s), so a
window is the sum of its buckets. Buckets older than the retention are dropped (memory) or expire
(Redis TTL); a window is clamped to the retention. Field grammar, five `|`-separated parts:

    a|<domain>|<drafter>|<ctx>|steps|drafts|draft_tokens|accepted_tokens|drafted.<i>|accepted.<i>
                                    |emitted|s (tokens appended, step seconds)
    s|<domain>|<drafter>|<ctx>|steps|drafts|drafted.<i>|accepted.<i>   counterfactual (shadow) scores
    c|draft|<drafter>|<ctx>|s|n     draft seconds and draft tokens of a drafter
    c|verify|<k>|<ctx>|s|n          verify seconds and steps with k >= 1 draft tokens verified (a tree: its nodes)
    c|plain||<ctx>|s|n              seconds and count of steps with no draft token
    r|<domain>|<drafter>|<reason>|n routing decisions (one per request)
    f|<domain>||<reason>|n          fallbacks to plain decoding
    h|<name>|<label>|<i>|n, h|<name>|<label>|sum|s   latency histograms (LATENCY_BUCKETS_S)

Fields ending in `|s` are float seconds, the rest integer counts.
Domain and drafter names are percent-encoded, so any string round-trips. Counters only add, so
increments from many steps, replicas or a local buffer merge by addition.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable
from urllib.parse import quote, unquote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from policies.records import (
    LATENCY_BUCKETS_S,
    PLAIN,
    AcceptanceCounts,
    CostStat,
    Histogram,
    Record,
    RequestRecord,
    ShadowRecord,
    StatsSnapshot,
    StepRecord,
    context_bucket,
    latency_bucket,
)

__all__ = [  # the value types live in policies.records and are re-exported here
    "DEFAULT_BUCKET_S", "DEFAULT_PREFIX", "DEFAULT_RETENTION_S", "PLAIN", "AcceptanceCounts", "CostStat",
    "MemoryStats", "RedisStats", "Record", "RequestRecord", "SeriesPoint", "ShadowRecord", "StatsSnapshot",
    "StatsStore", "StepRecord", "StoreHealth", "context_bucket", "hash_tag", "make_stats_store",
]

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "specroute"
DEFAULT_BUCKET_S = 10
DEFAULT_RETENTION_S = 3600
SCHEMA_VERSION = 1  # part of every Redis key: a changed field grammar gets fresh keys

Clock = Callable[[], float]
_REDIS_ERRORS = (redis.RedisError, OSError)  # OSError: socket errors redis-py leaves unwrapped


@dataclass(frozen=True)
class StoreHealth:
    backend: str
    connected: bool  # False while the shared store is unreachable (snapshots are degraded)
    num_errors: int  # failed backend operations since start
    num_pending_local: int  # steps buffered locally, not yet in the shared store
    num_dropped: int = 0  # steps lost because the local buffer was full
    last_error: str | None = None


@dataclass(frozen=True)
class SeriesPoint:
    """One time bucket of a window: what was recorded in [start_s, start_s + bucket_s)."""

    start_s: float
    bucket_s: int
    snapshot: StatsSnapshot


@runtime_checkable
class StatsStore(Protocol):
    def record(self, record: Record) -> None:
        self.record_many((record,))

    def record_many(self, records: Iterable[Record]) -> None: ...

    def snapshot(self, window_s: float | None = None) -> StatsSnapshot:
        """Statistics of the last `window_s` seconds (rounded up to whole buckets, at most the
        retention), or of all time when None."""
        ...

    def series(self, window_s: float) -> list[SeriesPoint]:
        """One snapshot per time bucket of the last `window_s` seconds, oldest first, empty
        buckets included: the time series of dashboards."""
        ...

    def reset(self) -> None: ...

    def health(self) -> StoreHealth: ...


# -- field encoding ------------------------------------------------------------------------------

def _name(s: str) -> str:
    return quote(s, safe="")


def _step_fields(step: StepRecord) -> dict[str, int | float]:
    """The counter increments one step adds (zero increments left out)."""
    ctx = context_bucket(step.context_len)
    a = f"a|{_name(step.domain)}|{_name(step.drafter)}|{ctx}|"
    k, num_accepted = step.num_draft_tokens, step.num_accepted
    step_s = step.draft_s + step.verify_s
    out: dict[str, int | float] = {a + "steps": 1, a + "emitted": step.num_emitted, a + "s": step_s}
    if k:
        out.update({a + "drafts": 1, a + "draft_tokens": k, a + "accepted_tokens": num_accepted})
        out.update({f"{a}drafted.{i}": 1 for i in range(k)})
        out.update({f"{a}accepted.{i}": 1 for i in range(num_accepted)})
        # the cost curve is T(1 + tokens verified): a draft tree's sample goes under its node count
        v = step.num_verified
        out.update({f"c|verify|{v}|{ctx}|s": step.verify_s, f"c|verify|{v}|{ctx}|n": 1})
    else:
        out.update({f"c|plain||{ctx}|s": step.verify_s, f"c|plain||{ctx}|n": 1})
    out.update(_observe("verify", str(step.num_verified), step.verify_s))
    if step.drafter != PLAIN:
        # time spent asking counts even when nothing was proposed: it is the drafter's real cost
        c = f"c|draft|{_name(step.drafter)}|{ctx}|"
        out.update({c + "s": step.draft_s, c + "n": k})
        out.update(_observe("draft", step.drafter, step.draft_s))
    if step.num_emitted:  # each token of the step waited step_s / n on average
        for field, value in _observe("itl", "", step_s / step.num_emitted).items():
            out[field] = value * step.num_emitted
    return out


def _shadow_fields(shadow: ShadowRecord) -> dict[str, int | float]:
    s = f"s|{_name(shadow.domain)}|{_name(shadow.drafter)}|{context_bucket(shadow.context_len)}|"
    out: dict[str, int | float] = {}
    if shadow.start == 0:
        out.update({s + "steps": 1, s + "drafts": int(shadow.num_proposed > 0)})
    out.update({f"{s}drafted.{i}": 1 for i in range(shadow.start, shadow.num_proposed)})
    out.update({f"{s}accepted.{i}": 1 for i in range(shadow.start, shadow.num_accepted)})
    return out


def _request_fields(request: RequestRecord) -> dict[str, int | float]:
    domain = _name(request.domain)
    out: Counter[str] = Counter({f"r|{domain}|{_name(request.drafter)}|{_name(request.reason)}|n": 1})
    for reason in request.fallbacks:
        out[f"f|{domain}||{_name(reason)}|n"] += 1
    out.update(_observe("ttft", "", request.ttft_s))
    out.update(_observe("e2e", "", request.e2e_s))
    return dict(out)


def _observe(name: str, label: str, seconds: float) -> dict[str, int | float]:
    h = f"h|{name}|{_name(label)}|"
    return {f"{h}{latency_bucket(seconds)}|n": 1, f"{h}sum|s": seconds}


def _fields(record: Record) -> dict[str, int | float]:
    if isinstance(record, StepRecord):
        out = _step_fields(record)
    elif isinstance(record, ShadowRecord):
        out = _shadow_fields(record)
    elif isinstance(record, RequestRecord):
        out = _request_fields(record)
    else:
        raise TypeError(f"not a stats record: {type(record).__name__}")
    return {f: v for f, v in out.items() if v}


def _increments(records: Iterable[Record]) -> tuple[Counter[str], int]:
    total: Counter[str] = Counter()
    num_records = 0
    for record in records:
        total.update(_fields(record))
        num_records += 1
    return total, num_records


def _is_float(field: str) -> bool:
    return field.endswith("|s")


def _numeric(hash_: Mapping[str | bytes, str | bytes | int | float]) -> dict[str, int | float]:
    """Stored counters (a Redis HASH reply: bytes) as numbers, so buckets add up before parsing."""
    out: dict[str, int | float] = {}
    for raw_field, raw_value in hash_.items():
        field = raw_field.decode() if isinstance(raw_field, bytes) else raw_field
        try:
            out[field] = float(raw_value) if _is_float(field) else int(raw_value)
        except ValueError:
            log.debug("skipping unparsable stats field %r=%r", field, raw_value)
    return out


def _parse(fields: Mapping[str, int | float], window_s: float | None) -> StatsSnapshot:
    """Flat counters into a snapshot; fields of another grammar are skipped."""
    scalars: dict[tuple[str, str, str, str], Counter[str]] = {}  # (kind, domain, drafter, ctx)
    positions: dict[tuple[str, str, str, str], dict[str, dict[int, int]]] = {}
    costs: dict[tuple[str, str, str], list] = {}  # (kind, key, ctx) -> [total_s, count]
    decisions: Counter[tuple[str, str, str]] = Counter()
    fallbacks: Counter[tuple[str, str]] = Counter()
    histograms: dict[tuple[str, str], list] = {}  # (name, label) -> [counts, sum_s]
    num_buckets = len(LATENCY_BUCKETS_S) + 1
    for field, value in fields.items():
        parts = field.split("|")
        if len(parts) != 5:
            continue
        kind, p1, p2, p3, stat = parts
        if kind in ("a", "s"):
            key = (kind, unquote(p1), unquote(p2), p3)
            which, _, index = stat.partition(".")
            if index.isdigit():
                positions.setdefault(key, {}).setdefault(which, {})[int(index)] = int(value)
            else:
                scalars.setdefault(key, Counter())[stat] += value
        elif kind == "c" and stat in ("s", "n"):
            cost = costs.setdefault((p1, unquote(p2), p3), [0.0, 0])
            cost[0 if stat == "s" else 1] += value
        elif kind == "r" and stat == "n":
            decisions[unquote(p1), unquote(p2), unquote(p3)] += int(value)
        elif kind == "f" and stat == "n":
            fallbacks[unquote(p1), unquote(p3)] += int(value)
        elif kind == "h":
            hist = histograms.setdefault((p1, unquote(p2)), [[0] * num_buckets, 0.0])
            if p3 == "sum" and stat == "s":
                hist[1] += value
            elif p3.isdigit() and int(p3) < num_buckets and stat == "n":
                hist[0][int(p3)] += int(value)

    def per_position(key: tuple[str, str, str, str], which: str) -> tuple[int, ...]:
        by_index = positions.get(key, {}).get(which, {})
        return tuple(by_index.get(i, 0) for i in range(max(by_index, default=-1) + 1))

    acceptance, shadow = {}, {}
    for key in scalars.keys() | positions.keys():
        s = scalars.get(key, Counter())
        counts = AcceptanceCounts(
            num_steps=int(s["steps"]), num_drafts=int(s["drafts"]), num_draft_tokens=int(s["draft_tokens"]),
            num_accepted_tokens=int(s["accepted_tokens"]), drafted_per_position=per_position(key, "drafted"),
            accepted_per_position=per_position(key, "accepted"), num_emitted_tokens=int(s["emitted"]),
            step_s=float(s["s"]),
        )
        (acceptance if key[0] == "a" else shadow)[key[1:]] = counts
    draft_cost, verify_cost, plain_cost = {}, {}, {}
    for (kind, key, ctx), (total_s, count) in costs.items():
        stat = CostStat(total_s, int(count))
        if kind == "draft":
            draft_cost[key, ctx] = stat
        elif kind == "verify" and key.isdigit():
            verify_cost[int(key), ctx] = stat
        elif kind == "plain":
            plain_cost[ctx] = stat
    return StatsSnapshot(
        acceptance, draft_cost, verify_cost, plain_cost, shadow=shadow, decisions=decisions, fallbacks=fallbacks,
        histograms={key: Histogram(tuple(counts), sum_s) for key, (counts, sum_s) in histograms.items()},
        window_s=window_s,
    )


# -- time buckets --------------------------------------------------------------------------------

class _Buckets:
    """Time-bucket arithmetic shared by both backends, on an injectable clock."""

    def __init__(self, bucket_s: int, retention_s: int, clock: Clock) -> None:
        if bucket_s < 1 or retention_s < bucket_s:
            raise ValueError(f"need 1 <= bucket_s <= retention_s, got {bucket_s}, {retention_s}")
        self.bucket_s, self.retention_s, self.clock = bucket_s, retention_s, clock
        self.num_kept = retention_s // bucket_s  # buckets a window may span, the current one included

    def current(self) -> int:
        return int(self.clock() // self.bucket_s)

    def oldest_kept(self) -> int:
        return self.current() - self.num_kept + 1

    def point(self, bucket: int, fields: Mapping[str, int | float], degraded: bool = False) -> SeriesPoint:
        snapshot = replace(_parse(fields, self.bucket_s), degraded=degraded)
        return SeriesPoint(bucket * self.bucket_s, self.bucket_s, snapshot)

    def window(self, window_s: float) -> range:
        if not window_s >= 0:
            raise ValueError(f"window_s must be >= 0 or None, got {window_s}")
        now = self.clock()
        first = int((now - window_s) // self.bucket_s)
        return range(max(first, self.oldest_kept()), int(now // self.bucket_s) + 1)


def _sum_buckets(buckets: Mapping[int, Counter[str]], ids: Iterable[int] | None) -> Counter[str]:
    total: Counter[str] = Counter()
    for i in buckets if ids is None else ids:
        if i in buckets:
            total.update(buckets[i])
    return total


# -- backends ------------------------------------------------------------------------------------

class MemoryStats(StatsStore):
    """In-process counters behind a lock: one router process, or tests."""

    backend = "memory"

    def __init__(self, *, bucket_s: int = DEFAULT_BUCKET_S, retention_s: int = DEFAULT_RETENTION_S,
                 clock: Clock = time.time) -> None:
        self._buckets_of = _Buckets(bucket_s, retention_s, clock)
        self._lock = threading.Lock()
        self._buckets: dict[int, Counter[str]] = {}
        self._total: Counter[str] = Counter()

    def record_many(self, records: Iterable[Record]) -> None:
        increments, num_steps = _increments(records)
        if not num_steps:
            return
        with self._lock:
            current = self._buckets_of.current()
            if current not in self._buckets:  # a new bucket: drop the ones past retention
                oldest = self._buckets_of.oldest_kept()
                for i in [i for i in self._buckets if i < oldest]:
                    del self._buckets[i]
            self._buckets.setdefault(current, Counter()).update(increments)
            self._total.update(increments)

    def snapshot(self, window_s: float | None = None) -> StatsSnapshot:
        with self._lock:
            if window_s is None:
                fields = Counter(self._total)
            else:
                fields = _sum_buckets(self._buckets, self._buckets_of.window(window_s))
        return _parse(fields, window_s)

    def series(self, window_s: float) -> list[SeriesPoint]:
        with self._lock:
            ids = self._buckets_of.window(window_s)
            fields = [(i, Counter(self._buckets.get(i, ()))) for i in ids]
        return [self._buckets_of.point(i, f) for i, f in fields]

    def reset(self) -> None:
        with self._lock:
            self._buckets.clear()
            self._total.clear()

    def health(self) -> StoreHealth:
        return StoreHealth(self.backend, connected=True, num_errors=0, num_pending_local=0)


def hash_tag(prefix: str) -> str:
    """`{prefix}`: keys that start with it share one Redis Cluster slot, so one MULTI/EXEC or
    script may touch them all."""
    if not prefix or set(prefix) & set("{}"):
        raise ValueError(f"prefix must be non-empty and without braces, got {prefix!r}")
    return f"{{{prefix}}}"


class RedisStats(StatsStore):
    """Counters in Redis, shared by every replica using the same prefix.

    Keys: `{prefix}:v1:total` (all time, no TTL) and `{prefix}:v1:b<bucket_s>:<bucket id>` (one
    HASH per time bucket, TTL = retention + one bucket). The hash tag keeps every key on one
    cluster slot, so a write is one MULTI/EXEC of HINCRBY(FLOAT)s and a read one of HGETALLs.

    Never raises from record/snapshot/health when Redis fails: steps go to a bounded local
    buffer (aggregated counters, so a flush costs one round trip) that is flushed with the next
    write once Redis answers; after a failure Redis is not tried again for `retry_s`, so a dead
    Redis costs a request nothing. Snapshots meanwhile are the last good snapshot of the same
    window plus the local buffer, flagged `degraded`. Delivery is at-least-once: a timeout after
    Redis applied a write re-sends that batch later.
    """

    backend = "redis"

    def __init__(self, client: str | redis.Redis = "redis://127.0.0.1:6379/0", *, prefix: str = DEFAULT_PREFIX,
                 bucket_s: int = DEFAULT_BUCKET_S, retention_s: int = DEFAULT_RETENTION_S, timeout_s: float = 0.2,
                 retry_s: float = 1.0, max_pending: int = 100_000, clock: Clock = time.time) -> None:
        if isinstance(client, str):
            # redis-py retries 10 times with backoff by default: far too long on a request path
            client = redis.Redis.from_url(client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                          retry=Retry(NoBackoff(), 0))
        self._redis = client
        self._buckets_of = _Buckets(bucket_s, retention_s, clock)
        self._clock = clock
        self._base = f"{hash_tag(prefix)}:v{SCHEMA_VERSION}"
        self._total_key = f"{self._base}:total"
        self.retry_s, self.max_pending = retry_s, max_pending
        self._lock = threading.Lock()
        self._pending: dict[int, Counter[str]] = {}  # bucket id -> increments not yet in Redis
        self._num_pending = 0
        self._num_in_flight = 0  # steps of a batch being written (restored if the write fails)
        self._num_dropped = 0
        self._num_errors = 0
        self._failing = False
        self._retry_at = -math.inf  # clock time before which Redis is not tried
        self._last_error: str | None = None
        self._last_good: dict[float | None, StatsSnapshot] = {}  # window_s -> Redis part of a snapshot

    def _bucket_key(self, bucket: int) -> str:
        return f"{self._base}:b{self._buckets_of.bucket_s}:{bucket}"

    # -- failure bookkeeping (call with the lock held) -----------------------------------------
    def _may_try(self) -> bool:
        now = self._clock()
        if now < self._retry_at:
            return False
        if self._failing:  # one caller probes; the others keep buffering meanwhile
            self._retry_at = now + self.retry_s
        return True

    def _failed(self, error: Exception) -> None:
        self._num_errors += 1
        self._last_error = f"{type(error).__name__}: {error}"
        self._retry_at = self._clock() + self.retry_s
        if not self._failing:
            log.warning("stats Redis unreachable, buffering locally: %s", self._last_error)
        self._failing = True

    def _succeeded(self) -> None:
        if self._failing:
            log.info("stats Redis reachable again")
        self._failing = False
        self._retry_at = -math.inf

    # -- StatsStore ----------------------------------------------------------------------------
    def record_many(self, records: Iterable[Record]) -> None:
        increments, num_steps = _increments(records)
        if not num_steps:
            return
        with self._lock:
            if self._num_pending + self._num_in_flight + num_steps > self.max_pending:
                self._num_dropped += num_steps
            else:
                self._pending.setdefault(self._buckets_of.current(), Counter()).update(increments)
                self._num_pending += num_steps
        self._flush()

    def _flush(self) -> bool:
        """Write the local buffer in one MULTI/EXEC; True when nothing is left buffered."""
        with self._lock:
            if not self._pending:
                return True
            if not self._may_try():
                return False
            batch, num_steps = self._pending, self._num_pending
            self._pending, self._num_pending = {}, 0
            self._num_in_flight += num_steps
        try:
            pipe = self._redis.pipeline(transaction=True)
            ttl = self._buckets_of.retention_s + self._buckets_of.bucket_s
            for bucket, increments in batch.items():
                _hincr(pipe, self._bucket_key(bucket), increments)
                pipe.expire(self._bucket_key(bucket), ttl)
            _hincr(pipe, self._total_key, _sum_buckets(batch, None))
            pipe.execute()
        except _REDIS_ERRORS as e:
            with self._lock:
                for bucket, increments in batch.items():
                    self._pending.setdefault(bucket, Counter()).update(increments)
                self._num_pending += num_steps
                self._num_in_flight -= num_steps
                self._failed(e)
            return False
        with self._lock:
            self._num_in_flight -= num_steps
            self._succeeded()
        return True

    def snapshot(self, window_s: float | None = None) -> StatsSnapshot:
        ids = None if window_s is None else self._buckets_of.window(window_s)
        if self._flush():
            with self._lock:
                may_try = self._may_try()
            if may_try:
                try:
                    keys = [self._total_key] if ids is None else [self._bucket_key(i) for i in ids]
                    pipe = self._redis.pipeline(transaction=True)
                    for key in keys:
                        pipe.hgetall(key)
                    fields: Counter[str] = Counter()
                    for hash_ in pipe.execute():
                        fields.update(_numeric(hash_))
                    remote = _parse(fields, window_s)
                    with self._lock:
                        self._succeeded()
                        self._last_good.pop(window_s, None)
                        self._last_good[window_s] = remote
                        while len(self._last_good) > 16:  # callers may vary the window; keep a few
                            del self._last_good[next(iter(self._last_good))]
                    return remote
                except _REDIS_ERRORS as e:
                    with self._lock:
                        self._failed(e)
        with self._lock:  # degraded: last good Redis data plus what only this process holds
            remote = self._last_good.get(window_s, StatsSnapshot(window_s=window_s))
            local = _parse(_sum_buckets(self._pending, ids), window_s)
        return replace(remote.merge(local), window_s=window_s, degraded=True)

    def series(self, window_s: float) -> list[SeriesPoint]:
        ids = self._buckets_of.window(window_s)
        if self._flush():
            with self._lock:
                may_try = self._may_try()
            if may_try:
                try:
                    pipe = self._redis.pipeline(transaction=True)
                    for i in ids:
                        pipe.hgetall(self._bucket_key(i))
                    hashes = pipe.execute()
                    with self._lock:
                        self._succeeded()
                    return [self._buckets_of.point(i, _numeric(h)) for i, h in zip(ids, hashes)]
                except _REDIS_ERRORS as e:
                    with self._lock:
                        self._failed(e)
        with self._lock:  # degraded: no history to fall back on, only what this process holds
            pending = [(i, Counter(self._pending.get(i, ()))) for i in ids]
        return [self._buckets_of.point(i, f, degraded=True) for i, f in pending]

    def reset(self) -> None:
        """Delete this prefix's keys for every replica and drop the local buffer. An operator
        action, so unlike the request path it raises when Redis is unreachable."""
        with self._lock:
            self._pending.clear()
            self._num_pending = 0
            self._last_good.clear()
        pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._base) + ":*"
        keys = list(self._redis.scan_iter(match=pattern, count=1000))
        for i in range(0, len(keys), 1000):
            self._redis.unlink(*keys[i : i + 1000])

    def health(self) -> StoreHealth:
        with self._lock:
            may_try = self._may_try()
        if may_try:
            try:
                self._redis.ping()
                with self._lock:
                    self._succeeded()
            except _REDIS_ERRORS as e:
                with self._lock:
                    self._failed(e)
        with self._lock:
            return StoreHealth(self.backend, connected=not self._failing, num_errors=self._num_errors,
                               num_pending_local=self._num_pending + self._num_in_flight,
                               num_dropped=self._num_dropped, last_error=self._last_error)

    def close(self) -> None:
        self._redis.close()


def _hincr(pipe: redis.client.Pipeline, key: str, increments: Mapping[str, int | float]) -> None:
    for field, value in increments.items():
        if _is_float(field):
            pipe.hincrbyfloat(key, field, float(value))
        else:
            pipe.hincrby(key, field, int(value))


def make_stats_store(url: str | None, *, prefix: str = DEFAULT_PREFIX, bucket_s: int = DEFAULT_BUCKET_S,
                     retention_s: int = DEFAULT_RETENTION_S, clock: Clock = time.time) -> StatsStore:
    """None: in-process counters; a redis://, rediss:// or unix:// URL: counters shared in Redis."""
    if url is None:
        return MemoryStats(bucket_s=bucket_s, retention_s=retention_s, clock=clock)
    if url.split("://", 1)[0] in ("redis", "rediss", "unix"):
        return RedisStats(url, prefix=prefix, bucket_s=bucket_s, retention_s=retention_s, clock=clock)
    raise ValueError(f"stats store URL must be redis://, rediss:// or unix://, got {url!r}")
