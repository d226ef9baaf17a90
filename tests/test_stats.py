"""The StatsStore contract, run against MemoryStats and against RedisStats on the real Redis at
127.0.0.1:6379 (each test under its own key prefix), plus Redis-down and Redis-returns tests on a
throwaway redis-server. Time moves through an injected clock; timings are dyadic fractions so
sums are exact in every backend and snapshots compare with ==."""

from __future__ import annotations

import json
import signal
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import redis
from helpers import ThrowawayRedis, throwaway_redis_server

from policies.records import (
    CONTEXT_BUCKETS,
    FINISH_REASONS,
    LATENCY_BUCKETS_S,
    PLAIN,
    REQUEST_TOKENS_BUCKETS,
    AcceptanceCounts,
    BatchingStats,
    Histogram,
    RequestRecord,
    ShadowRecord,
    StatsSnapshot,
    StepRecord,
    context_bucket,
    latency_bucket,
)
from policies.stats import MemoryStats, RedisStats, StatsStore, make_stats_store

REDIS_URL = "redis://127.0.0.1:6379/0"
T0 = 1_000_000.0  # a multiple of every bucket size used here


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def step(domain: str = "code", drafter: str = "ngram", k: int = 4, accepted: int = 2, *, draft_s: float = 0.25,
         verify_s: float = 0.5, context_len: int = 100) -> StepRecord:
    return StepRecord(domain=domain, drafter=drafter, draft_len=k, num_draft_tokens=k, num_accepted=accepted,
                      draft_s=draft_s if drafter != PLAIN else 0.0, verify_s=verify_s, context_len=context_len)


def delete_prefix(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(match=f"{{{prefix}}}:*"))
    if keys:
        client.delete(*keys)


@pytest.fixture(scope="module")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {REDIS_URL} (start: redis-server --daemonize yes --save ''): {e}")
    yield client
    client.close()


@dataclass
class Backend:
    """Makes stores of one backend; shared=True stores see each other (same Redis prefix)."""

    name: str
    clock: FakeClock
    client: redis.Redis | None
    prefix: str = field(default_factory=lambda: f"test-{uuid.uuid4().hex[:12]}")
    prefixes: list[str] = field(default_factory=list)
    stores: list[StatsStore] = field(default_factory=list)

    def new(self, *, shared: bool = True, **kwargs) -> StatsStore:
        kwargs.setdefault("clock", self.clock)
        if self.name == "memory":
            store: StatsStore = MemoryStats(**kwargs)
        else:
            prefix = self.prefix if shared else f"test-{uuid.uuid4().hex[:12]}"
            self.prefixes.append(prefix)
            store = RedisStats(REDIS_URL, prefix=prefix, **kwargs)
        self.stores.append(store)
        return store


@pytest.fixture(params=["memory", "redis"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    client = request.getfixturevalue("redis_client") if request.param == "redis" else None
    b = Backend(request.param, FakeClock(), client)
    yield b
    for store in b.stores:
        if isinstance(store, RedisStats):
            store.close()
    if client is not None:
        for prefix in set(b.prefixes):
            delete_prefix(client, prefix)


def test_counts_and_acceptance_by_position(backend: Backend) -> None:
    store = backend.new()
    store.record(step(k=4, accepted=2))
    store.record_many([step(k=3, accepted=3), step(k=0, accepted=0), step(drafter=PLAIN, k=0, accepted=0)])
    store.record(step(domain="math", k=2, accepted=0))
    snap = store.snapshot()
    assert snap.counts("code", "ngram") == AcceptanceCounts(
        num_steps=3, num_drafts=2, num_draft_tokens=7, num_accepted_tokens=5,
        drafted_per_position=(2, 2, 2, 1), accepted_per_position=(2, 2, 1), num_emitted_tokens=8, step_s=2.25,
    )
    assert snap.acceptance_by_position("code", "ngram") == [1.0, 1.0, 0.5, 0.0]
    assert snap.acceptance_by_position("math", "ngram") == [0.0, 0.0]
    assert snap.counts("code", PLAIN) == AcceptanceCounts(num_steps=1, num_emitted_tokens=1, step_s=0.5)
    assert snap.counts("chat", "ngram") == AcceptanceCounts()
    assert snap.domains() == ["code", "math"] and snap.drafters("code") == ["ngram", PLAIN]
    assert not snap.degraded and snap.window_s is None


def test_shadow_scores_are_kept_apart_and_added_as_evidence(backend: Backend) -> None:
    store = backend.new()
    store.record(step(k=2, accepted=2))  # a real draft of positions 0, 1
    store.record_many([
        ShadowRecord("code", "ngram", context_len=100, start=2, num_proposed=5, num_accepted=3),  # its tail
        ShadowRecord("code", "ngram", context_len=100, start=0, num_proposed=4, num_accepted=1),  # a plain step
        ShadowRecord("code", "ngram", context_len=100, start=0, num_proposed=0, num_accepted=0),  # no match
    ])
    snap = store.snapshot()
    assert snap.counts("code", "ngram").drafted_per_position == (1, 1)  # metrics see real drafts only
    assert snap.shadow_counts("code", "ngram") == AcceptanceCounts(
        num_steps=2, num_drafts=1, drafted_per_position=(1, 1, 2, 2, 1), accepted_per_position=(1, 0, 1))
    evidence = snap.evidence("code", "ngram")
    assert (evidence.num_steps, evidence.num_drafts) == (3, 2)
    assert evidence.drafted_per_position == (2, 2, 2, 2, 1) and evidence.accepted_per_position == (2, 1, 1)
    with pytest.raises(ValueError):
        ShadowRecord("code", "ngram", context_len=1, start=3, num_proposed=2, num_accepted=0)


def test_requests_decisions_fallbacks_and_histograms(backend: Backend) -> None:
    store = backend.new()
    store.record_many([
        RequestRecord("code", "ngram", "best", ttft_s=0.0625, e2e_s=1.5),
        RequestRecord("code", "ngram", "best", ttft_s=0.0625, e2e_s=2.5, fallbacks=("low_speedup",)),
        RequestRecord("chat", PLAIN, "fallback", ttft_s=0.125, e2e_s=3.0, fallbacks=("low_speedup", "drafter_error")),
        step(k=3, accepted=1, draft_s=0.25, verify_s=0.5),  # 2 tokens in 0.75 s: 2 itl samples of 0.375
    ])
    snap = store.snapshot(window_s=60)
    assert snap.decisions == {("code", "ngram", "best"): 2, ("chat", PLAIN, "fallback"): 1}
    assert snap.fallbacks == {("code", "low_speedup"): 1, ("chat", "low_speedup"): 1, ("chat", "drafter_error"): 1}
    ttft = snap.histogram("ttft")
    assert ttft.count == 3 and ttft.sum_s == 0.25
    assert ttft.counts[latency_bucket(0.0625)] == 2 and sum(ttft.counts[: latency_bucket(0.0625)]) == 0
    assert snap.histogram("e2e").sum_s == 7.0
    itl = snap.histogram("itl")
    assert itl.count == 2 and itl.sum_s == 0.75 and itl.counts[latency_bucket(0.375)] == 2
    assert snap.histogram("draft", "ngram").count == 1 and snap.histogram("verify", "3").sum_s == 0.5
    assert snap.histogram("draft", "eagle") == Histogram()
    assert latency_bucket(1e9) == len(LATENCY_BUCKETS_S) and latency_bucket(0.0) == 0
    with pytest.raises(ValueError):
        RequestRecord("code", "ngram", "best", ttft_s=2.0, e2e_s=1.0)


def test_cost_means(backend: Backend) -> None:
    store = backend.new()
    store.record_many([
        step(k=4, draft_s=0.5, verify_s=0.75), step(k=4, draft_s=0.25, verify_s=0.25),
        step(k=2, draft_s=0.125, verify_s=0.5),
        step(k=0, accepted=0, draft_s=0.125, verify_s=0.25),  # asked, proposed nothing: plain step
        step(drafter=PLAIN, k=0, accepted=0, verify_s=0.125),
        step(drafter="eagle", k=1, accepted=1, draft_s=0.0625, verify_s=0.5),
    ])
    snap = store.snapshot()
    assert snap.mean_verify_s(4) == 0.5
    assert snap.mean_verify_s(1) == 0.5
    assert snap.mean_verify_s(3) is None
    assert snap.mean_plain_step_s() == 0.1875 == snap.mean_verify_s(0)
    assert snap.mean_draft_s_per_token("ngram") == (0.5 + 0.25 + 0.125 + 0.125) / 10
    assert snap.mean_draft_s_per_token("eagle") == 0.0625
    assert snap.mean_draft_s_per_token(PLAIN) is None
    assert snap.verify_s(4).count == 2 and snap.plain_step_s().count == 2


def test_a_tree_steps_verify_cost_counts_under_its_node_count(backend: Backend) -> None:
    """A draft tree of depth 2 with 9 nodes runs 1 + 9 tokens: its cost sample must not make a
    chain of 2 look that expensive; its acceptance still counts per position (depth)."""
    store = backend.new()
    tree = replace(step(k=2, accepted=2, verify_s=0.75), num_verified=9)
    store.record_many([tree, step(k=2, accepted=0, verify_s=0.25)])
    snap = store.snapshot()
    assert snap.mean_verify_s(9) == 0.75 and snap.mean_verify_s(2) == 0.25
    counts = snap.counts("code", "ngram")
    assert counts.num_draft_tokens == 4 and counts.accepted_per_position == (1, 1)
    with pytest.raises(ValueError, match="num_verified"):
        replace(tree, num_verified=1)


def test_context_buckets(backend: Backend) -> None:
    assert [context_bucket(n) for n in (0, 511, 512, 1023, 1024, 2047, 2048, 4095, 4096, 10**6)] == [
        "0-512", "0-512", "512-1k", "512-1k", "1k-2k", "1k-2k", "2k-4k", "2k-4k", "4k+", "4k+"]
    store = backend.new()
    store.record_many([
        step(k=2, accepted=2, verify_s=0.25, context_len=10),
        step(k=2, accepted=0, verify_s=0.75, context_len=3000),
        step(k=2, accepted=1, verify_s=0.5, context_len=3500),
    ])
    snap = store.snapshot(window_s=60)
    assert snap.acceptance_by_position("code", "ngram", "0-512") == [1.0, 1.0]
    assert snap.acceptance_by_position("code", "ngram", "2k-4k") == [0.5, 0.0]
    assert snap.acceptance_by_position("code", "ngram", "1k-2k") == []
    assert snap.acceptance_by_position("code", "ngram") == [2 / 3, 1 / 3]
    assert snap.mean_verify_s(2, "0-512") == 0.25 and snap.mean_verify_s(2, "2k-4k") == 0.625
    assert {b for _, _, b in snap.acceptance} == {"0-512", "2k-4k"} <= set(CONTEXT_BUCKETS)


def test_window_and_all_time(backend: Backend) -> None:
    store = backend.new(bucket_s=10)
    store.record(step(k=4, accepted=4))
    backend.clock.advance(100)
    store.record(step(k=2, accepted=1))
    recent, wide, total = store.snapshot(window_s=30), store.snapshot(window_s=150), store.snapshot()
    assert recent.counts("code", "ngram").num_draft_tokens == 2 and recent.window_s == 30
    assert wide.counts("code", "ngram").num_draft_tokens == 6
    assert total == wide.merge(StatsSnapshot()) and total.window_s is None
    assert store.snapshot(window_s=0).counts("code", "ngram").num_drafts == 1  # the current bucket
    backend.clock.advance(10)
    assert store.snapshot(window_s=0) == StatsSnapshot(window_s=0)
    with pytest.raises(ValueError):
        store.snapshot(window_s=-1)


def test_retention_drops_old_buckets_but_not_totals(backend: Backend) -> None:
    store = backend.new(bucket_s=10, retention_s=60)
    store.record(step(k=3, accepted=1))
    backend.clock.advance(50)  # 6 buckets back including the current one: still kept
    assert store.snapshot(window_s=10_000).counts("code", "ngram").num_drafts == 1
    backend.clock.advance(10)
    store.record(step(k=1, accepted=1))
    assert store.snapshot(window_s=10_000).counts("code", "ngram").num_draft_tokens == 1  # clamped to retention
    assert store.snapshot().counts("code", "ngram").num_draft_tokens == 4
    if isinstance(store, MemoryStats):
        assert len(store._buckets) == 1  # the old bucket's memory is freed
    else:
        keys = {k.decode() for k in backend.client.scan_iter(match=f"{{{backend.prefix}}}:*")}
        ttls = {k: backend.client.ttl(k) for k in keys}
        assert ttls.pop(f"{{{backend.prefix}}}:v1:total") == -1
        assert len(ttls) == 2 and all(0 < t <= 70 for t in ttls.values())


def test_reset(backend: Backend) -> None:
    store = backend.new()
    store.record_many([step(), step(drafter=PLAIN, k=0, accepted=0)])
    assert store.snapshot().domains() == ["code"]
    store.reset()
    assert store.snapshot() == StatsSnapshot() and store.snapshot(60) == StatsSnapshot(window_s=60)
    store.record(step(domain="math"))
    assert store.snapshot().domains() == ["math"]


def test_merge_is_the_sum(backend: Backend) -> None:
    steps_a = [step(k=4, accepted=3), step(drafter=PLAIN, k=0, accepted=0, verify_s=0.125)]
    steps_b = [step(k=5, accepted=5, context_len=4000), step(domain="math", drafter="eagle", k=2, accepted=1)]
    a, b, both = backend.new(shared=False), backend.new(shared=False), backend.new(shared=False)
    a.record_many(steps_a)
    b.record_many(steps_b)
    both.record_many(steps_a + steps_b)
    merged = a.snapshot().merge(b.snapshot())
    assert merged == both.snapshot()
    assert merged.counts("code", "ngram").drafted_per_position == (2, 2, 2, 2, 1)
    assert a.snapshot(30).merge(b.snapshot(60)).window_s == 60
    assert a.snapshot(30).merge(b.snapshot()).window_s is None


def test_replicas_on_one_prefix_share_totals(redis_client: redis.Redis) -> None:
    clock, prefix = FakeClock(), f"test-{uuid.uuid4().hex[:12]}"
    first, second = (RedisStats(REDIS_URL, prefix=prefix, clock=clock) for _ in range(2))
    other = RedisStats(REDIS_URL, prefix=prefix + "-other", clock=clock)
    try:
        first.record(step(k=3, accepted=2))
        second.record(step(k=2, accepted=2))
        other.record(step(k=7, accepted=7))
        for store in (first, second):
            assert store.snapshot().counts("code", "ngram").num_accepted_tokens == 4
            assert store.snapshot(60).counts("code", "ngram").num_draft_tokens == 5
        second.reset()
        assert first.snapshot() == StatsSnapshot()
        assert other.snapshot().counts("code", "ngram").num_draft_tokens == 7
    finally:
        for store in (first, second, other):
            store.close()
        delete_prefix(redis_client, prefix)
        delete_prefix(redis_client, prefix + "-other")


def test_concurrent_writers_exact_totals(backend: Backend) -> None:
    store = backend.new()
    num_threads, num_rounds = 8, 50

    def write(i: int) -> None:
        for _ in range(num_rounds):
            store.record(step(domain=f"d{i % 2}", k=3, accepted=2))
            store.record_many([step(domain=f"d{i % 2}", k=1, accepted=1), step(drafter=PLAIN, k=0, accepted=0)])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(num_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = store.snapshot()
    per_domain = num_threads // 2 * num_rounds
    for domain in ("d0", "d1"):
        assert snap.counts(domain, "ngram") == AcceptanceCounts(
            num_steps=2 * per_domain, num_drafts=2 * per_domain, num_draft_tokens=4 * per_domain,
            num_accepted_tokens=3 * per_domain, drafted_per_position=(2 * per_domain, per_domain, per_domain),
            accepted_per_position=(2 * per_domain, per_domain), num_emitted_tokens=5 * per_domain,
            step_s=1.5 * per_domain)
    assert snap.counts("code", PLAIN).num_steps == num_threads * num_rounds
    assert snap.plain_step_s().count == num_threads * num_rounds
    assert snap.verify_s(3).total_s == per_domain * 2 * 0.5


WEIRD_NAMES = ["a|b", "%7C", "", "数学", "x y/z", "{specroute}:v1", "drafted.0", "a|b|c|d|e|f"]


def test_weird_names_round_trip(backend: Backend) -> None:
    store = backend.new()
    for i, name in enumerate(WEIRD_NAMES):
        store.record(step(domain=name, drafter=name or "x", k=i + 1, accepted=i))
    snap = store.snapshot()
    assert snap.domains() == sorted(WEIRD_NAMES)
    for i, name in enumerate(WEIRD_NAMES):
        assert snap.counts(name, name or "x").num_draft_tokens == i + 1
        assert snap.mean_draft_s_per_token(name or "x") == 0.25 / (i + 1)


def test_snapshot_is_immutable(backend: Backend) -> None:
    store = backend.new()
    store.record(step())
    snap = store.snapshot()
    with pytest.raises(TypeError):
        snap.acceptance["x", "y", "z"] = AcceptanceCounts()  # type: ignore[index]
    with pytest.raises(AttributeError):
        snap.degraded = True  # type: ignore[misc]
    store.record(step())
    assert snap.counts("code", "ngram").num_steps == 1


def test_health_and_factory(backend: Backend) -> None:
    store = backend.new()
    assert isinstance(store, StatsStore)
    store.record(step())
    health = store.health()
    assert health.backend == backend.name and health.connected
    assert (health.num_errors, health.num_pending_local, health.num_dropped) == (0, 0, 0)


def test_make_stats_store() -> None:
    assert isinstance(make_stats_store(None), MemoryStats)
    store = make_stats_store(REDIS_URL, prefix="test-factory")
    assert isinstance(store, RedisStats)
    store.close()
    with pytest.raises(ValueError, match="http://x"):
        make_stats_store("http://x")
    with pytest.raises(ValueError, match="braces"):
        RedisStats(REDIS_URL, prefix="a{b}")


def test_step_record_validation_and_from_engine_stats() -> None:
    from workers.engine import StepStats

    stats = StepStats(drafter="ngram", draft_len=4, num_draft_tokens=3, num_accepted=2, num_emitted=3,
                      draft_s=0.01, verify_s=0.02, context_len=700)
    record = StepRecord.from_step("code", stats)
    assert (record.domain, record.num_draft_tokens, record.num_accepted, record.context_len) == ("code", 3, 2, 700)
    assert not record.plain and step(k=0, accepted=0).plain
    for bad in [dict(k=2, accepted=3), dict(drafter=PLAIN, k=1, accepted=0), dict(verify_s=-1.0),
                dict(verify_s=float("nan")), dict(context_len=-1)]:
        with pytest.raises(ValueError):
            step(**bad)


# -- Redis down ----------------------------------------------------------------------------------

def test_unreachable_redis_never_raises_and_buffers() -> None:
    clock = FakeClock()
    store = RedisStats("redis://127.0.0.1:1/0", clock=clock, retry_s=1.0, max_pending=6)
    store.record(step(k=3, accepted=1))
    store.record_many([step(k=2, accepted=2), step(drafter=PLAIN, k=0, accepted=0)])
    health = store.health()
    assert not health.connected and "ConnectionError" in health.last_error
    assert (health.num_errors, health.num_pending_local) == (1, 3)  # later calls skip Redis until retry_s
    snap = store.snapshot()
    assert snap.degraded and snap.counts("code", "ngram").num_accepted_tokens == 3
    assert store.snapshot(window_s=60).counts("code", PLAIN).num_steps == 1
    clock.advance(1.0)
    store.record_many([step(), step()])  # tries again: fails, buffers
    store.record_many([step(), step()])  # past max_pending: dropped and counted
    health = store.health()
    assert (health.num_errors, health.num_pending_local, health.num_dropped) == (2, 5, 2)
    assert store.snapshot().counts("code", "ngram").num_steps == 4
    store.close()


@pytest.fixture
def throwaway_redis(tmp_path: Path) -> Iterator[ThrowawayRedis]:
    with throwaway_redis_server(tmp_path) as server:
        yield server


def test_hung_redis_times_out_and_buffers(throwaway_redis: ThrowawayRedis) -> None:
    store = RedisStats(throwaway_redis.url, clock=FakeClock(), timeout_s=0.2)
    store.record(step())
    throwaway_redis.signal(signal.SIGSTOP)  # accepts connections, answers nothing
    try:
        store.record(step())
        assert store.snapshot().degraded
        health = store.health()
        assert "Timeout" in health.last_error and (health.num_errors, health.num_pending_local) == (1, 1)
    finally:
        throwaway_redis.signal(signal.SIGCONT)
        store.close()


def test_redis_returns_and_buffered_steps_reconcile(throwaway_redis: ThrowawayRedis) -> None:
    clock = FakeClock()
    store = RedisStats(throwaway_redis.url, prefix="returns", clock=clock, retry_s=5.0)
    reader = RedisStats(throwaway_redis.url, prefix="returns", clock=clock)
    try:
        store.record_many([step(k=3, accepted=3), step(k=3, accepted=1)])
        assert not store.snapshot().degraded

        throwaway_redis.stop("save")  # the restarted server holds what was written before
        store.record_many([step(k=2, accepted=1), step(drafter=PLAIN, k=0, accepted=0)])
        store.record(step(domain="math", k=1, accepted=1))
        health = store.health()
        assert not health.connected and health.num_errors >= 1 and health.num_pending_local == 3
        down = store.snapshot()  # last good Redis snapshot + the local buffer
        assert down.degraded and down.counts("code", "ngram").num_draft_tokens == 8
        assert down.counts("math", "ngram").num_steps == 1

        throwaway_redis.start()
        store.record(step(k=4, accepted=0))  # within retry_s: buffered, Redis not tried
        assert reader.snapshot().counts("code", "ngram").num_draft_tokens == 6
        clock.advance(5.0)
        store.record(step(k=1, accepted=1))  # flushes everything buffered in the same round trip
        health = store.health()
        assert health.connected and health.num_pending_local == 0
        for snap in (reader.snapshot(), reader.snapshot(window_s=60), store.snapshot()):
            assert not snap.degraded
            assert snap.counts("code", "ngram") == AcceptanceCounts(
                num_steps=5, num_drafts=5, num_draft_tokens=13, num_accepted_tokens=6,
                drafted_per_position=(5, 4, 3, 1), accepted_per_position=(4, 1, 1), num_emitted_tokens=11,
                    step_s=3.75)
            assert snap.counts("code", PLAIN).num_steps == 1 and snap.counts("math", "ngram").num_steps == 1
    finally:
        store.close()
        reader.close()


# -- JSON and time series (what /metrics, /v1/stats and the dashboard read) ------------------------
def test_snapshot_json_round_trip_is_exact(backend: Backend) -> None:
    import pickle

    store = backend.new()
    store.record_many([
        step(k=4, accepted=3, draft_s=0.1, verify_s=0.2), step(k=4, accepted=1, draft_s=0.1, verify_s=0.7),
        step(domain="m a|th%", drafter="é/x", k=2, accepted=2, context_len=4000),
        step(drafter=PLAIN, k=0, accepted=0, verify_s=0.3),
        ShadowRecord("code", "other", context_len=10, start=0, num_proposed=3, num_accepted=1),
        RequestRecord("code", "ngram", "best", ttft_s=0.05, e2e_s=0.9, fallbacks=("low_speedup",)),
    ])
    for snap in (store.snapshot(), store.snapshot(window_s=60)):
        data = json.loads(json.dumps(snap.to_json()))
        back = StatsSnapshot.from_json(data)
        assert back == snap and back.window_s == snap.window_s
        assert back.counts("code", "ngram").step_s == snap.counts("code", "ngram").step_s == 0.1 + 0.2 + 0.1 + 0.7
        assert back.histogram("e2e") == snap.histogram("e2e") and back.histogram("e2e").count == 1
        assert back.shadow_counts("code", "other").drafted_per_position == (1, 1, 1)
        assert back.mean_verify_s(4) == snap.mean_verify_s(4) and back.fallbacks == {("code", "low_speedup"): 1}
        pickle.dumps(data)  # what crosses Ray
    assert StatsSnapshot.from_json(StatsSnapshot(degraded=True).to_json()) == StatsSnapshot(degraded=True)


def test_batching_stats_add_up_and_cross_as_json() -> None:
    a = BatchingStats(num_running=2, prefix_queries=10, prefix_hits=4, num_preemptions=1).step(2, 5, 3, 0.25)
    b = BatchingStats(num_waiting=1, prefix_held_tokens=64).step(1, 1, 1, 0.5).step(4, 9, 6, 0.125)
    total = a + b
    assert (total.num_running, total.num_waiting, total.num_emitted, total.step_s) == (2, 1, 10, 0.875)
    assert (total.prefix_hit_rate, total.prefix_held_tokens, total.num_preemptions) == (0.4, 64, 1)
    assert total.batch_size.count == 3 and total.step_tokens.total == 15
    assert BatchingStats.from_json(json.loads(json.dumps(total.to_json()))) == total
    earlier = {k: v for k, v in total.to_json().items() if k != "num_preemptions"}  # a replica of an earlier version
    assert BatchingStats.from_json(earlier) == replace(total, num_preemptions=0)


def test_batching_stats_count_why_requests_left_and_how_full_the_kv_cache_is() -> None:
    a = (BatchingStats(kv_cache_used_tokens=300, kv_cache_tokens=1000)
         .finish("length", 0.004, 12, 30).finish("stop", 0.5, 700, 1).finish("abort").finish("error"))
    b = BatchingStats(kv_cache_used_tokens=100, kv_cache_tokens=1000).finish("stop", None, 3, 2).finish("abort")
    total = a + b
    assert dict(zip(FINISH_REASONS, total.finished)) == {"stop": 2, "length": 1, "abort": 2, "error": 1}
    assert total.kv_cache_usage == 0.2 and BatchingStats().kv_cache_usage is None  # unbounded: no share
    # only requests that ran to their end bring their queueing and lengths; one never admitted no queueing
    assert (total.queue_s.count, total.queue_s.total) == (2, 0.504)
    assert total.request_prompt_tokens.counts[REQUEST_TOKENS_BUCKETS.index(1000)] == 1  # 700 <= 1000
    assert (total.request_prompt_tokens.total, total.request_generation_tokens.total) == (715, 33)
    assert BatchingStats.from_json(json.loads(json.dumps(total.to_json()))) == total
    with pytest.raises(ValueError):
        BatchingStats().finish("tool_calls")  # the ingress's name for a stop, not a batch's reason


def test_series_one_snapshot_per_bucket(backend: Backend) -> None:
    store = backend.new(bucket_s=10)
    store.record(step(k=4, accepted=4))
    backend.clock.advance(20)
    store.record_many([step(k=2, accepted=1), RequestRecord("code", "ngram", "best", ttft_s=0.1, e2e_s=0.2)])
    points = store.series(window_s=30)
    assert [p.start_s for p in points] == [T0 - 10, T0, T0 + 10, T0 + 20]
    assert all(p.bucket_s == 10 and p.snapshot.window_s == 10 and not p.snapshot.degraded for p in points)
    assert [p.snapshot.counts("code", "ngram").num_draft_tokens for p in points] == [0, 4, 0, 2]
    assert [sum(p.snapshot.decisions.values()) for p in points] == [0, 0, 0, 1]
    assert [p.start_s for p in store.series(window_s=0)] == [T0 + 20]


def test_series_of_unreachable_redis_is_the_local_buffer() -> None:
    clock = FakeClock()
    store = RedisStats("redis://127.0.0.1:1/0", clock=clock, bucket_s=10)
    store.record(step(k=3, accepted=2))
    points = store.series(window_s=20)
    assert len(points) == 3 and all(p.snapshot.degraded for p in points)
    assert [p.snapshot.counts("code", "ngram").num_accepted_tokens for p in points] == [0, 0, 2]
    store.close()
