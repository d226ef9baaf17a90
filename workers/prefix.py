"""Automatic prefix caching: a prompt that starts like a sequence the KV pool holds reuses that
sequence's keys and values instead of prefilling them (vLLM's automatic prefix caching; llama.cpp's
server reuses a slot's cache the same way).

The pool holds one sequence per slot (workers/models/llama.py, KVPool), so a prefix is shared in
place or by copy. A finished request's slot keeps its sequence (`HeldPrefix`) until a request
needs the slot or the memory. A new request takes a held slot in place where its prompt continues
the whole held sequence (the next turn of a conversation), and otherwise copies the longest prefix
its prompt shares with any slot, running or held, into a slot of its own (a system prompt shared
by concurrent requests): copying a position's keys and values is a memory copy, prefilling it a
forward. The target's final hidden states there, which feature drafters (EAGLE, Medusa) read,
travel with them.

Requests that arrive together with a new shared prefix would each prefill it beside the others;
instead a request whose prompt starts like one a running request is still prefilling waits until
that prefix is in the pool and copies it (SGLang's in-batch prefix caching), letting the requests
behind it pass meanwhile.

A request's `cache_salt` (vLLM's) bounds what it shares: it reuses, and leaves for reuse, only the
positions of requests with the same salt (none: of unsalted ones), so a tenant whose prompts are
salted cannot learn from a request's time to first token what another tenant's prompts held.

Reuse is exact only where keys and values do not depend on how they were computed (in which
prompt chunk, beside which rows): on a `batch_invariant` target a request's output is bit for bit
the same with or without it, which is where `SchedulerConfig.enable_prefix_caching` turns it on by
default.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from workers.models.base import KVPoolLike, PooledKVCache

# A request waits for a running one's prefill where that wins it at least this many positions over
# what the pool holds now: below it, a step of waiting costs more than the rows it saves.
WAIT_FOR_PREFIX_TOKENS = 64


@dataclass
class HeldPrefix:
    """What a free slot keeps of the sequence that finished in it."""

    token_ids: list[int]  # the tokens at positions 0, 1, ... of the slot
    features: torch.Tensor | None  # [len, hidden] the target's final hidden states there, where drafters read them
    last_used: int  # the cache's clock when it was kept or last copied from: the oldest is evicted first
    salt: str | None = None  # the cache_salt of the request that left it: only its like reuse it


@dataclass(frozen=True)
class LiveSequence:
    """A running request's sequence, which a new prompt may copy a prefix of."""

    slot: int
    token_ids: Sequence[int]  # the tokens whose keys and values the slot holds
    features: torch.Tensor | None  # [>= len(token_ids), hidden], where drafters read them
    salt: str | None = None  # the request's cache_salt: only requests with the same one reuse it


@dataclass(frozen=True)
class Reuse:
    """Where a request starts: the slot it runs in and how many of its prompt's positions it
    finds there."""

    slot: int
    length: int = 0
    source: int | None = None  # the slot the positions are copied from; None: in place
    features: torch.Tensor | None = None  # the target's hidden states at those positions (rows :length)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[:n], dtype=np.int64))
    return int(differ[0]) if differ.size else n


class PrefixCache:
    """The held prefixes of one KV pool's free slots, and where each new request starts."""

    def __init__(self, pool: KVPoolLike) -> None:
        self.pool = pool
        self.held: dict[int, HeldPrefix] = {}
        self._clock = itertools.count()
        self.num_queried_tokens = 0  # prompt tokens of the requests placed
        self.num_hit_tokens = 0  # of those, the positions found in the pool

    @property
    def num_held_tokens(self) -> int:
        return sum(len(h.token_ids) for h in self.held.values())

    def longest(self, reusable: Sequence[int], running: Iterable[LiveSequence] = (), salt: str | None = None) -> int:
        """How many of the tokens `reusable` the pool holds now for a request salted `salt`, in a
        held or a running slot."""
        return self._best(reusable, running, salt)[1]

    def plan(self, reusable: Sequence[int], running: Iterable[LiveSequence] = (), salt: str | None = None) -> Reuse:
        """Where a prompt whose first tokens `reusable` may come from the pool starts (a free slot
        must exist), for a request salted `salt`. The longest shared prefix of the same salt wins;
        a held slot is taken in place only where the prompt continues all it holds (nothing is
        lost), else the prefix is copied into an empty slot, or into the least recently used held
        one."""
        best, best_len = self._best(reusable, running, salt)
        if best is not None and best.slot in self.held and best_len == len(best.token_ids):
            return Reuse(best.slot, best_len, None, best.features)
        source = best.slot if best is not None else None
        slot = self._vacant(exclude=source)
        if slot is None:  # the source is the only free slot: it is taken in place, its tail dropped
            assert best is not None and source is not None
            return Reuse(source, best_len, None, best.features)
        if best is None:
            return Reuse(slot)
        return Reuse(slot, best_len, source, best.features)

    def claim(self, reuse: Reuse, num_prompt_tokens: int) -> PooledKVCache:
        """The cache of a request placed by `plan`, its first `reuse.length` positions filled;
        `num_prompt_tokens` count as queried, as many of the positions as hits (a preempted
        request resuming counts none)."""
        cache = self.pool.allocate(reuse.slot)
        held = self.held.pop(reuse.slot, None)
        if held is not None and len(held.token_ids) > reuse.length:  # what the slot kept past the reuse goes
            self.pool.forget(reuse.slot, reuse.length)
        if reuse.source is None:
            cache.extend(reuse.length)
        else:  # over what the slot kept before it, if anything
            self.pool.copy_prefix(reuse.source, cache, reuse.length)
            if (source := self.held.get(reuse.source)) is not None:
                source.last_used = next(self._clock)
        self.num_queried_tokens += num_prompt_tokens
        self.num_hit_tokens += min(reuse.length, num_prompt_tokens)
        return cache

    def release(self, cache: PooledKVCache, token_ids: Sequence[int], features: torch.Tensor | None,
                salt: str | None = None) -> None:
        """Free a request's slot, keeping what it holds of `token_ids` (and `features`) for the
        requests salted `salt`."""
        keep = min(cache.length, len(token_ids))
        slot = cache.slot
        self.pool.release(cache, keep)
        if keep:
            kept = None if features is None else features[:keep].clone()  # the request's buffer is max_len long
            self.held[slot] = HeldPrefix(list(token_ids[:keep]), kept, next(self._clock), salt)

    def evict(self, max_tokens: int) -> None:
        """Drop the least recently used held prefixes until they hold at most `max_tokens`."""
        while self.held and self.num_held_tokens > max_tokens:
            slot = self._oldest(self.held)
            del self.held[slot]
            self.pool.forget(slot)

    def clear(self) -> int:
        """Drop every held prefix (vLLM's reset_prefix_cache): the positions dropped. Running
        requests keep theirs, and leave them held when they finish."""
        num_tokens = self.num_held_tokens
        self.evict(0)
        return num_tokens

    def _best(self, reusable: Sequence[int], running: Iterable[LiveSequence],
              salt: str | None) -> tuple[LiveSequence | None, int]:
        """The sequence salted `salt` sharing the longest prefix with `reusable`, and its length; a
        tie goes to a held slot, which may be taken in place."""
        best: LiveSequence | None = None
        best_len = 0
        candidates = [LiveSequence(slot, h.token_ids, h.features, h.salt) for slot, h in self.held.items()]
        for seq in [*candidates, *running]:
            if seq.salt != salt:
                continue
            n = common_prefix_len(seq.token_ids, reusable)
            if n > best_len or (n == best_len and n and seq.slot in self.held and best.slot not in self.held):
                best, best_len = seq, n
        return best, best_len

    def _vacant(self, exclude: int | None) -> int | None:
        """A free slot to start in: the lowest empty one, else the least recently used held one."""
        free = [s for s in self.pool.free_slots if s != exclude]
        empty = [s for s in free if s not in self.held]
        if empty:
            return empty[0]
        return self._oldest(free) if free else None

    def _oldest(self, slots: Iterable[int]) -> int:
        """The held slot among `slots` least recently used."""
        return min(slots, key=lambda s: self.held[s].last_used)
