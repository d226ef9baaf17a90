"""The Responses API's stored responses (`store`, `previous_response_id`, `GET` and `DELETE
/v1/responses/{id}`): the most recent `max_responses`, the least recently used dropped first,
and none left unused (neither stored nor read) for `ttl_s`.

Two backends:
  * `MemoryResponseStore` (the default): the ingress replica's memory, as vLLM keeps them in its
    API server; a restart or a redeploy forgets them.
  * `RedisResponseStore` (`responses_url`): a Redis that every ingress replica shares, which
    outlives them. When that Redis fails, a response is kept in the replica's memory instead,
    so answering never fails on the store, and moved to Redis once it answers again; reading
    one that is in neither raises `ResponseStoreUnavailable` (it may be in the Redis that did
    not answer).

A stored response keeps its conversation whole (the earlier turns' items, its own input items,
then its output items), so a request that continues it is its conversation plus the new input:
the next turn's prompt starts with the last one's, which the target replicas' prefix cache holds.

A write may be conditional on the stored response's status (`put(..., if_status=...)`): a
background response still generated is ended by whichever write comes first, its generator's or a
cancel or a failure another ingress replica writes, and the later ones are refused, not stored.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from policies.stats import DEFAULT_PREFIX, hash_tag

log = logging.getLogger("specroute.responses")

_REDIS_ERRORS = (redis.RedisError, OSError)

# Both scripts first drop the responses last used at or before ARGV[2] (-1: none) and, with a TTL
# (ARGV[3] s, 0: none), let both keys expire with the last use.
_EXPIRE = """
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
for i = 1, #stale do redis.call('HDEL', KEYS[1], stale[i]) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
local function touch()
  if tonumber(ARGV[3]) > 0 then
    redis.call('EXPIRE', KEYS[1], ARGV[3])
    redis.call('EXPIRE', KEYS[2], ARGV[3])
  end
end
"""
# put: store responses (ARGV[4..]: id, JSON, last use; repeated), then drop the least recently used
# beyond the bound (ARGV[1])
_PUT_SCRIPT = _EXPIRE + """
for i = 4, #ARGV, 3 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('ZADD', KEYS[2], ARGV[i + 2], ARGV[i])
end
local excess = redis.call('ZCARD', KEYS[2]) - tonumber(ARGV[1])
if excess > 0 then
  local old = redis.call('ZPOPMIN', KEYS[2], excess)
  for i = 1, #old, 2 do redis.call('HDEL', KEYS[1], old[i]) end
end
touch()
"""
# put_if: store the response ARGV[4] (JSON ARGV[5], last use ARGV[6]) only where one is stored
# whose status is one of ARGV[7..]; 1 if stored, else 0
_PUT_IF_SCRIPT = _EXPIRE + """
local raw = redis.call('HGET', KEYS[1], ARGV[4])
if not raw then return 0 end
local status = cjson.decode(raw)['response']['status']
for i = 7, #ARGV do
  if status == ARGV[i] then
    redis.call('HSET', KEYS[1], ARGV[4], ARGV[5])
    redis.call('ZADD', KEYS[2], 'XX', ARGV[6], ARGV[4])
    touch()
    return 1
  end
end
return 0
"""
# get: the response ARGV[4] (nil where there is none), marked used at ARGV[1]
_GET_SCRIPT = _EXPIRE + """
local raw = redis.call('HGET', KEYS[1], ARGV[4])
if raw then
  redis.call('ZADD', KEYS[2], 'XX', ARGV[1], ARGV[4])
  touch()
end
return raw
"""


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was answered
    conversation: list[dict[str, Any]]  # input items: earlier turns, this request's input, its output
    # a background response still generated: when its generator's lease lapses (wall-clock
    # seconds), unless renewed; after that any ingress replica may take it for ended
    lease_until: float | None = None

    @property
    def status(self) -> str | None:
        return self.response.get("status")


def _allowed(stored: StoredResponse | None, if_status: Collection[str] | None) -> bool:
    """Whether a write conditional on the status (`if_status`, None: none) may replace `stored`."""
    return if_status is None or (stored is not None and stored.status in if_status)


@dataclass(frozen=True)
class ResponseStoreHealth:
    backend: str  # memory | redis
    connected: bool  # False after a failed Redis operation, until one succeeds
    num_errors: int  # failed Redis operations since the ingress started
    num_local: int  # responses in the ingress's memory (redis: those stored while it was unreachable)


class ResponseStoreUnavailable(RuntimeError):
    """The shared store did not answer and this replica does not hold the response."""


class ResponseStore(Protocol):
    max_responses: int
    ttl_s: float | None  # None: kept until the bound drops them

    async def put(self, response_id: str, stored: StoredResponse, *, if_status: Collection[str] | None = None) -> bool:
        """Store `stored`; with `if_status`, only where a response is stored under the id with one
        of those statuses. Whether it was stored."""
        ...

    async def get(self, response_id: str) -> StoredResponse | None: ...

    async def delete(self, response_id: str) -> bool: ...

    def health(self) -> ResponseStoreHealth: ...


@dataclass
class KeptResponse:
    stored: StoredResponse
    used_at: float  # the clock's time of its last put or get


class MemoryResponseStore:
    def __init__(self, max_responses: int, ttl_s: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self._clock = clock
        self._responses: OrderedDict[str, KeptResponse] = OrderedDict()  # the least recently used first

    def _expire(self) -> None:
        if self.ttl_s is None:
            return
        stale_at = self._clock() - self.ttl_s
        while self._responses and next(iter(self._responses.values())).used_at <= stale_at:
            self._responses.popitem(last=False)

    async def put(self, response_id: str, stored: StoredResponse, *, if_status: Collection[str] | None = None) -> bool:
        self._expire()
        if not _allowed(self.peek(response_id), if_status):
            return False
        self._responses[response_id] = KeptResponse(stored, self._clock())
        self._responses.move_to_end(response_id)
        while len(self._responses) > self.max_responses:
            self._responses.popitem(last=False)
        return True

    def peek(self, response_id: str) -> StoredResponse | None:
        """The stored response, without marking it used."""
        kept = self._responses.get(response_id)
        return None if kept is None else kept.stored

    async def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        kept = self._responses.get(response_id)
        if kept is None:
            return None
        kept.used_at = self._clock()
        self._responses.move_to_end(response_id)
        return kept.stored

    async def delete(self, response_id: str) -> bool:
        return self._responses.pop(response_id, None) is not None

    def __len__(self) -> int:
        self._expire()
        return len(self._responses)

    def kept(self) -> dict[str, KeptResponse]:
        """Every stored response by id, with its last use, the least recently used first."""
        self._expire()
        return dict(self._responses)

    def health(self) -> ResponseStoreHealth:
        return ResponseStoreHealth("memory", connected=True, num_errors=0, num_local=len(self))


class RedisResponseStore:
    """Keys `{prefix}:responses:v1:items` (a HASH: id -> the stored response as JSON) and
    `{prefix}:responses:v1:used` (a sorted set: id -> when last put or read), on one cluster slot.
    Each put and get first drops the responses unused for `ttl_s`, and both keys expire `ttl_s`
    after the last use, so a deployment gone leaves nothing behind. The statistics' reset
    (`{prefix}:v1:*`) leaves them alone.

    After a failure Redis is not tried again for `retry_s`: meanwhile responses go to, and are
    read from, the replica's memory (bounded alike), so a dead Redis costs a request nothing.
    The first operation that reaches Redis again moves them there, for every replica to read."""

    def __init__(self, client: str | aioredis.Redis, max_responses: int, ttl_s: float | None = None, *,
                 prefix: str = DEFAULT_PREFIX, timeout_s: float = 1.0, retry_s: float = 1.0,
                 clock: Callable[[], float] = time.time) -> None:
        tag = hash_tag(prefix)
        if isinstance(client, str):
            # redis-py retries with backoff by default: far too long on a request path
            client = aioredis.Redis.from_url(client, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                             retry=Retry(NoBackoff(), 0))
        self._redis = client
        self.max_responses = max_responses
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self._clock = clock
        self._items_key = f"{tag}:responses:v1:items"
        self._used_key = f"{tag}:responses:v1:used"
        self._put_script = client.register_script(_PUT_SCRIPT)
        self._put_if_script = client.register_script(_PUT_IF_SCRIPT)
        self._get_script = client.register_script(_GET_SCRIPT)
        self._local = MemoryResponseStore(max_responses, ttl_s, clock)  # what Redis could not take
        self._moving = asyncio.Lock()  # held while the local responses move to Redis
        self._retry_at = -math.inf
        self._num_errors = 0

    def health(self) -> ResponseStoreHealth:
        return ResponseStoreHealth("redis", connected=self._retry_at == -math.inf, num_errors=self._num_errors,
                                   num_local=len(self._local))

    def _may_try(self) -> bool:
        return time.monotonic() >= self._retry_at

    def _failed(self, error: Exception) -> None:
        self._num_errors += 1
        if self._retry_at == -math.inf:
            log.warning("responses Redis unreachable, storing in this replica's memory: %s: %s",
                        type(error).__name__, error)
        self._retry_at = time.monotonic() + self.retry_s

    async def _succeeded(self) -> None:
        if self._retry_at != -math.inf:
            log.info("responses Redis reachable again")
        self._retry_at = -math.inf
        if len(self._local) and not self._moving.locked():
            await self._move_local()

    async def _move_local(self) -> None:
        """Move the responses stored here while Redis was unreachable into it, in one call, each
        with its last use. `delete` waits for the move, so what it deletes stays deleted."""
        async with self._moving:
            kept = self._local.kept()
            try:
                await self._store(kept)
            except _REDIS_ERRORS as e:
                self._failed(e)
                return
            for response_id in kept:
                await self._local.delete(response_id)
            log.info("moved %d responses stored in this replica's memory to Redis", len(kept))

    def _expiry_args(self) -> list[float | int]:
        """The scripts' ARGV[2] and ARGV[3]: the last use that expires a response, the keys' TTL."""
        if self.ttl_s is None:
            return [-1, 0]
        return [self._clock() - self.ttl_s, math.ceil(self.ttl_s)]

    async def _store(self, kept: Mapping[str, KeptResponse]) -> None:
        """Put responses by id (the least recently used first) in Redis, with their last use."""
        args: list[str | float | int] = [self.max_responses, *self._expiry_args()]
        for response_id, response in kept.items():
            args += [response_id, json.dumps(asdict(response.stored)), response.used_at]
        await self._put_script(keys=[self._items_key, self._used_key], args=args)

    async def put(self, response_id: str, stored: StoredResponse, *, if_status: Collection[str] | None = None) -> bool:
        """While Redis is unreachable, `if_status` is checked against this replica's copy, if it
        holds one, else the write is kept (Redis may hold what the condition is about)."""
        local = self._local.peek(response_id)
        if local is not None and not _allowed(local, if_status):
            return False
        if self._may_try():
            try:
                if if_status is None or local is not None:
                    await self._store({response_id: KeptResponse(stored, self._clock())})
                    stored_here = True
                else:
                    stored_here = bool(await self._put_if_script(
                        keys=[self._items_key, self._used_key],
                        args=[self.max_responses, *self._expiry_args(), response_id, json.dumps(asdict(stored)),
                              self._clock(), *if_status]))
            except _REDIS_ERRORS as e:
                self._failed(e)
            else:
                await self._local.delete(response_id)  # an older copy kept here must not move over this one
                await self._succeeded()
                return stored_here
        await self._local.put(response_id, stored)
        return True

    async def get(self, response_id: str) -> StoredResponse | None:
        local = await self._local.get(response_id)
        if local is not None:
            return local
        raw = await self._on_redis(lambda: self._get_script(
            keys=[self._items_key, self._used_key], args=[self._clock(), *self._expiry_args(), response_id]))
        return None if raw is None else StoredResponse(**json.loads(raw))

    async def delete(self, response_id: str) -> bool:
        async with self._moving:
            if await self._local.delete(response_id):  # a response is in one place: here or in Redis
                return True
        num_deleted, _ = await self._on_redis(lambda: self._redis.pipeline(transaction=True).hdel(
            self._items_key, response_id).zrem(self._used_key, response_id).execute())
        return num_deleted > 0

    async def _on_redis(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """What `call` returns; ResponseStoreUnavailable where Redis is not tried (a recent
        failure) or fails."""
        if not self._may_try():
            raise ResponseStoreUnavailable("the responses Redis is unreachable")
        try:
            results = await call()
        except _REDIS_ERRORS as e:
            self._failed(e)
            raise ResponseStoreUnavailable(f"the responses Redis is unreachable: {type(e).__name__}") from None
        await self._succeeded()
        return results


def make_response_store(url: str | None, max_responses: int, ttl_s: float | None = None, *,
                        prefix: str | None = None) -> ResponseStore:
    """The Redis store at `url`, else the replica's memory."""
    if url is None:
        return MemoryResponseStore(max_responses, ttl_s)
    return RedisResponseStore(url, max_responses, ttl_s, prefix=prefix or DEFAULT_PREFIX)
