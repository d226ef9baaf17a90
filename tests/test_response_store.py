"""The stored responses' backends: the ingress's memory and a shared Redis (the module-wide Redis
at 127.0.0.1:6379, under a prefix of the test's own). The Serve app over HTTP is tested in
test_serve (memory) and test_reliability (Redis, and its outage)."""

from __future__ import annotations

import asyncio
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from helpers import throwaway_redis_server

from policies.stats import RedisStats
from router.response_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    ResponseStoreHealth,
    ResponseStoreUnavailable,
    StoredResponse,
    make_response_store,
)

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix() -> Iterator[str]:
    name = f"test-responses-{uuid.uuid4().hex[:8]}"
    yield name
    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    keys = list(client.scan_iter(match=f"{{{name}}}:*"))
    if keys:
        client.delete(*keys)
    client.close()


def _redis_or_skip() -> None:
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {REDIS_URL}: {e}")


def _stores(kind: str, max_responses: int, prefix: str) -> tuple[ResponseStore, ResponseStore]:
    """Two ingress replicas' stores: one shared Redis, or (memory) one store seen twice."""
    if kind == "memory":
        store = make_response_store(None, max_responses)
        return store, store
    _redis_or_skip()
    return (make_response_store(REDIS_URL, max_responses, prefix=prefix),
            make_response_store(REDIS_URL, max_responses, prefix=prefix))


def _stored(name: str, turns: int = 0) -> StoredResponse:
    return StoredResponse({"id": name, "output_text": "é ✓"}, [{"role": "user", "content": str(i)} for i in range(turns)])


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_the_least_recently_used_goes_first_whichever_replica_used_it(kind: str, prefix: str) -> None:
    async def run() -> None:
        one, other = _stores(kind, 2, prefix)
        assert isinstance(one, RedisResponseStore if kind == "redis" else MemoryResponseStore)
        await one.put("a", _stored("a", 3))
        await other.put("b", _stored("b"))
        assert await other.get("a") == _stored("a", 3)  # read back whole; now more recent than b
        await one.put("c", _stored("c"))
        assert (await one.get("b"), await other.get("b")) == (None, None)
        assert (await one.get("a")).response == {"id": "a", "output_text": "é ✓"}
        assert await other.delete("a") and not await one.delete("a") and await one.get("a") is None
        assert await one.get("c") is not None
        assert one.health().connected and one.health().num_errors == 0
        nothing, _ = _stores(kind, 0, f"{prefix}-none")
        await nothing.put("a", _stored("a"))
        assert await nothing.get("a") is None

    asyncio.run(run())


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_response_unused_for_the_ttl_is_dropped_and_each_use_renews_it(kind: str, prefix: str) -> None:
    now = [1000.0]

    def clock() -> float:
        return now[0]

    if kind == "redis":
        _redis_or_skip()
    one, other = ((RedisResponseStore(REDIS_URL, 10, 60, prefix=prefix, clock=clock),
                   RedisResponseStore(REDIS_URL, 10, 60, prefix=prefix, clock=clock)) if kind == "redis" else
                  (MemoryResponseStore(10, 60, clock),) * 2)

    async def run() -> None:
        await one.put("a", _stored("a"))
        now[0] = 1030
        await one.put("b", _stored("b"))
        now[0] = 1050
        assert await other.get("a") == _stored("a")  # read 50 s after its put: used again
        now[0] = 1095
        assert await other.get("b") is None and await one.get("a") == _stored("a")  # b unused for 65 s
        now[0] = 1156
        assert await one.get("a") is None and await other.get("a") is None
        await one.put("c", _stored("c"))
        assert await other.get("c") == _stored("c")

    asyncio.run(run())
    if kind == "redis":  # the keys go with their last use
        client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
        keys = list(client.scan_iter(match=f"{{{prefix}}}:responses:*"))
        assert len(keys) == 2 and all(0 < client.ttl(k) <= 60 for k in keys), keys
        asyncio.run(RedisResponseStore(REDIS_URL, 10, prefix=f"{prefix}-kept").put("d", _stored("d")))
        assert all(client.ttl(k) == -1 for k in client.scan_iter(match=f"{{{prefix}-kept}}:responses:*"))
        client.delete(*client.scan_iter(match=f"{{{prefix}-kept}}:*"))
        client.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_write_conditional_on_the_status_replaces_only_those(kind: str, prefix: str) -> None:
    """A background response is ended by the first of its writers: its generator, or a cancel
    through another replica; the later write is refused."""
    running = ("queued", "in_progress")

    def response(status: str, lease_until: float | None = None) -> StoredResponse:
        return StoredResponse({"id": "a", "status": status}, [{"role": "user", "content": "é"}], lease_until)

    async def run() -> None:
        one, other = _stores(kind, 10, prefix)
        assert not await one.put("a", response("in_progress"), if_status=running) and await one.get("a") is None
        await one.put("a", response("queued", 100.5))
        assert await other.put("a", response("in_progress", 130.5), if_status=running)
        assert (await one.get("a")).lease_until == 130.5
        assert await other.put("a", response("cancelled"), if_status=running)
        assert not await one.put("a", response("completed"), if_status=running)
        assert await one.get("a") == response("cancelled")
        assert await one.put("a", response("completed")) and (await other.get("a")).status == "completed"

    asyncio.run(run())


def test_a_stats_reset_leaves_the_stored_responses(prefix: str) -> None:
    _redis_or_skip()
    store = RedisResponseStore(REDIS_URL, 10, prefix=prefix)
    asyncio.run(store.put("kept", _stored("kept")))
    stats = RedisStats(REDIS_URL, prefix=prefix)
    stats.reset()
    assert asyncio.run(RedisResponseStore(REDIS_URL, 10, prefix=prefix).get("kept")) == _stored("kept")


def test_a_dead_redis_keeps_responses_in_the_replica_and_says_what_it_cannot_read() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = RedisResponseStore(f"redis://127.0.0.1:{port}/0", 10, timeout_s=0.5, retry_s=60)

    async def run() -> None:
        await store.put("here", _stored("here"))  # answered, kept locally
        assert await store.get("here") == _stored("here")
        with pytest.raises(ResponseStoreUnavailable):  # may be in the Redis that did not answer
            await store.get("elsewhere")
        with pytest.raises(ResponseStoreUnavailable):
            await store.delete("elsewhere")
        health = store.health()
        assert (health.backend, health.connected, health.num_local) == ("redis", False, 1) and health.num_errors >= 1
        assert await store.delete("here")

    asyncio.run(run())


def test_responses_kept_in_the_replica_move_to_redis_when_it_answers_again(tmp_path: Path) -> None:
    with throwaway_redis_server(tmp_path) as server:
        store = RedisResponseStore(server.url, 10, timeout_s=0.5, retry_s=0)
        other = RedisResponseStore(server.url, 10)

        async def run() -> None:
            await store.put("before", _stored("before"))
            server.stop("save")
            await store.put("a", _stored("a", 2))
            await store.put("b", _stored("b"))
            assert store.health().num_local == 2 and not store.health().connected
            assert not await store.put("b", StoredResponse({"status": "in_progress"}, []), if_status=["queued"])
            server.start()
            await store.put("b", _stored("b", 1))  # reaches Redis and moves a there, not b's older copy
            assert store.health() == ResponseStoreHealth("redis", connected=True, num_errors=2, num_local=0)
            await store.put("after", _stored("after"))
            for name, turns in (("before", 0), ("a", 2), ("b", 1), ("after", 0)):
                assert await other.get(name) == _stored(name, turns)
            assert await store.delete("a") and await other.get("a") is None  # deleted in Redis

        asyncio.run(run())


def test_a_prefix_must_not_break_the_hash_tag() -> None:
    with pytest.raises(ValueError, match="braces"):
        RedisResponseStore(REDIS_URL, 10, prefix="a}b")
