"""Which target replica serves a request: the one whose KV pool likely holds its prompt's prefix.

Each replica keeps the prefixes it served (workers/prefix.py), so a conversation's next turn, sent
to the replica that served its earlier ones, prefills only its new messages. Serve's default
router picks the less loaded of two random replicas and scatters a conversation over all of
them. `PrefixAffinityRouter` (a Serve request router, run by the ingress's handle) ranks the
replicas for a request by rendezvous hashing of its affinity key: its cache salt and how its
prompt begins (a chat's messages up to its first user message, a text's first characters), so
every turn of a conversation, and every request starting alike, asks the same replica first,
and a replica added or removed moves only the keys it wins or held. Load comes first: where the
first-ranked replica's queue is longer than the shortest by more than `max_imbalance`, or it is
full, the less loaded replicas take the request (SGLang's and Ray's cache-aware routers balance
the same way).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from workers.deployment import GenerateRequest

DEFAULT_KEY_CHARS = 1024  # of a text prompt: enough for a system prompt and the start of a question
DEFAULT_MAX_IMBALANCE = 2  # queued requests a replica may have beyond the least loaded and still be preferred


def affinity_key(request: GenerateRequest, key_chars: int = DEFAULT_KEY_CHARS) -> str:
    """What requests that share a prefix in the KV pool have in common: the cache salt (no other
    salt reuses it) and the prompt's start; a chat's messages up to its first user message, which
    every later turn repeats."""
    if request.prompt_token_ids is not None:
        start: Any = list(request.prompt_token_ids[: key_chars // 4])  # ~4 characters a token
    elif isinstance(request.prompt, str):
        start = request.prompt[:key_chars]
    else:
        first_user = next((i for i, m in enumerate(request.prompt) if m.get("role") == "user"), len(request.prompt))
        start = json.dumps(request.prompt[: first_user + 1], sort_keys=True, default=str)[:key_chars]
    return json.dumps([request.cache_salt, start])


def rendezvous_order(key: str, replica_ids: Sequence[str]) -> list[int]:
    """The replicas' indices, the one `key` prefers first (highest random weight hashing: the
    order of the others stays where one comes or goes)."""
    def weight(i: int) -> bytes:
        return hashlib.blake2b(f"{key}\0{replica_ids[i]}".encode(), digest_size=8).digest()

    return sorted(range(len(replica_ids)), key=weight, reverse=True)


def affine_ranks(order: list[int], queued: list[int], max_imbalance: int) -> list[list[int]]:
    """The ranks of replicas (indices) Serve tries in turn, given `order` (rendezvous_order) and
    each replica's queue: the preferred one alone, then the others; or all of them at once (the
    least loaded wins) where the preferred one's queue exceeds the shortest by more than
    `max_imbalance`."""
    if queued[order[0]] - min(queued) > max_imbalance:
        return [sorted(order)]
    return [order[:1], order[1:]]


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the target replicas: a request's preferred replica first, the
    others next, or all of them alike when the preferred one is too busy (module docstring).
    Requests are handed their replicas first in, first out, as by Serve's own router: the `n`
    choices of one HTTP request share its internal request id, which the default exact matching
    would serve only one of."""

    def initialize_state(self, key_chars: int = DEFAULT_KEY_CHARS,
                         max_imbalance: int = DEFAULT_MAX_IMBALANCE, **kwargs: Any) -> None:
        self.key_chars = key_chars
        self.max_imbalance = max_imbalance

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        """Ranks of replicas, tried in order: within a rank Serve takes the one with the shortest
        queue that has room."""
        request = _generate_request(pending_request)
        if request is None or len(candidate_replicas) < 2:
            return [candidate_replicas]
        order = rendezvous_order(affinity_key(request, self.key_chars),
                                 [r.replica_id.unique_id for r in candidate_replicas])
        queued = [self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas]
        return [[candidate_replicas[i] for i in rank] for rank in affine_ranks(order, queued, self.max_imbalance)]


def _generate_request(pending: PendingRequest | None) -> GenerateRequest | None:
    """The GenerateRequest a call carries (`stream`, `generate`, `tokenize`); None for the others."""
    if pending is None:
        return None
    return next((a for a in pending.args if isinstance(a, GenerateRequest)), None)
