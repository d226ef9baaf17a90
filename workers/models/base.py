"""The causal-LM interface the engine and the model drafter run on.

A model owns weights; a cache owns one sequence's keys and values. `forward` appends the new
tokens at `cache.length`; rolling back after a rejected draft is `cache.truncate(n)`, and after
a draft tree `cache.keep(start, path)`. One sequence per `forward`; a `BatchedLM` (the fast
Llama, workers/models/llama.py) also runs several in one `forward_batch` over the slots of a KV
pool, which continuous batching uses when present. Feature drafters (EAGLE, Medusa) read the
target through a `TargetView`: its embeddings, rotary tables and output head.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol, runtime_checkable

import torch

from workers.tree import DraftTree


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a GPU forward returns before it runs, so a clock read
    after it without this times the launch alone."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # the C library


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the system. Loading frees large temporaries (dequantised
    weights, the kernel probes' calls), but glibc keeps their pages: the shipped engine held
    1388-1440 MiB resident once loaded, 1042 after this (1897-1991 and 1400 where it probed; an
    AVX-512 EPYC). A no-op where the C library has no malloc_trim."""
    trim = getattr(LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


@dataclass(frozen=True)
class ModelInfo:
    vocab_size: int
    hidden_size: int
    max_position: int  # positions the model was trained for
    eos_token_ids: frozenset[int]
    kv_bytes_per_token: int = 0  # keys and values of one position over all layers (0: unknown)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [n, vocab] float32, for the positions asked for
    # [n, hidden] final-norm hidden states of every new position (even with last_only), when asked for
    hidden: torch.Tensor | None = None


class KVCache(Protocol):
    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are stored."""
        ...

    @property
    def capacity(self) -> int: ...

    def truncate(self, length: int) -> None:
        """Forget every position >= length (rollback to an accepted prefix)."""
        ...

    def keep(self, start: int, indices: Sequence[int]) -> None:
        """Keep positions start + indices (ascending) of the last forward, moved to start,
        start + 1, ...: a draft tree's accepted path. Only where the model supports trees."""
        ...


@dataclass(frozen=True)
class TargetView:
    """What a feature drafter (EAGLE, Medusa) computes with besides the target's features: the
    target's own token embeddings, rotary tables and output head, shared, never copied."""

    info: ModelInfo
    embed: torch.Tensor  # [vocab, hidden]
    cos: torch.Tensor  # [max_position, head_dim]
    sin: torch.Tensor  # [max_position, head_dim], signed for rotate-half: x * cos + rotate(x) * sin
    head_t: torch.Tensor  # [hidden, vocab]: logits = features @ head_t


class CausalLM(Protocol):
    info: ModelInfo
    device: torch.device
    supports_tree: bool  # forward takes a draft tree (workers/tree.py) and its cache has keep()
    # every row scored bit for bit as alone, in a chain or a batch (compact weights,
    # workers/models/llama.py); a tree's off-chain nodes are not (workers/verify.py)
    batch_invariant: bool
    # a prompt row (one that only fills the cache) computes its keys and values as a scored row
    # would; False where prompt rows take other kernels (int4 weights' dense copy, workers/models/quant.py)
    prompt_rows_as_scored: bool

    def new_cache(self, capacity: int) -> KVCache: ...

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64 on self.device
        cache: KVCache,
        *,
        last_only: bool = False,
        return_hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> ForwardOutput:
        """Run n new tokens at positions cache.length .. cache.length + n - 1 (a tree: the root
        and its nodes, each at the position of its depth; only where supports_tree)."""
        ...


@dataclass
class SeqInput:
    """One sequence's part of a step's forward: `input_ids` run after what its cache holds."""

    input_ids: torch.Tensor  # [n] int64
    cache: KVCache
    logits: Literal["all", "last", "none"] = "all"  # the rows whose logits are returned
    tree: DraftTree | None = None  # the inputs are a step's root and a draft tree's nodes
    # the rows are computed as a step's scored rows even where no logits are read (a resumed
    # request's output, whose keys and values must be those its steps computed); None: where
    # every row's logits are read
    scored: bool | None = None

    @property
    def scored_rows(self) -> bool:
        """Whether the rows take the kernels of scored rows (decode and verify steps'), not those
        of prompt rows (where a target has other ones: `prompt_rows_as_scored` False)."""
        return self.logits == "all" if self.scored is None else self.scored


def forward_each(model: CausalLM, inputs: Sequence[SeqInput], return_hidden: bool = False) -> list[ForwardOutput]:
    """Each sequence in a forward of its own (a model without a batched forward, or a batch of one)."""
    outs = []
    for s in inputs:
        out = model.forward(s.input_ids, s.cache, last_only=not s.scored_rows, tree=s.tree,
                            return_hidden=return_hidden)
        outs.append(replace(out, logits=out.logits[:0]) if s.logits == "none" else out)
    return outs


class PooledKVCache(KVCache, Protocol):
    """A sequence's cache that is one slot of a KV pool."""

    slot: int

    def extend(self, n: int) -> None:
        """Count n more positions as held (written already)."""
        ...


class KVPoolLike(Protocol):
    """Slots of one shared KV memory, one sequence each (FastLlama's KVPool)."""

    @property
    def num_free(self) -> int: ...

    @property
    def capacity(self) -> int:
        """Positions per slot."""
        ...

    @property
    def free_slots(self) -> list[int]: ...

    def allocate(self, slot: int | None = None) -> PooledKVCache:
        """The lowest free slot, or `slot`, as an empty cache."""
        ...

    def release(self, cache: PooledKVCache, keep: int = 0) -> None:
        """Give the slot back, keeping its first `keep` positions for a later sequence to reuse."""
        ...

    def forget(self, slot: int, start: int = 0) -> None:
        """Drop what a free slot holds from position `start` on."""
        ...

    def copy_prefix(self, src_slot: int, cache: PooledKVCache, length: int) -> None:
        """Start an empty cache with the first `length` positions slot `src_slot` holds."""
        ...


@runtime_checkable
class BatchedLM(Protocol):
    """A model that runs several sequences' rows in one forward over the slots of its KV pool."""

    def new_pool(self, num_slots: int, capacity: int) -> KVPoolLike: ...

    def forward_batch(self, batch: Sequence[SeqInput], *, return_hidden: bool = False) -> list[ForwardOutput]: ...


def forward_rows(model: CausalLM, inputs: Sequence[SeqInput], return_hidden: bool = False) -> list[ForwardOutput]:
    """Several sequences' rows: in one forward where the model batches (BatchedLM), else one each."""
    if isinstance(model, BatchedLM):
        return model.forward_batch(inputs, return_hidden=return_hidden)
    return forward_each(model, inputs, return_hidden)
