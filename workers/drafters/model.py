"""An independent small causal LM as drafter (SpS), with its own KV cache and rollback.

The model may compute logits over a reduced draft vocabulary only (`vocab_ids`: the token id of
each logits column, e.g. a distilled drafter's most frequent tokens): a draft token then costs a
fraction of the full lm_head, and its probabilities are spread back over the whole vocabulary
(zero elsewhere) for rejection sampling, which stays exact.

Under continuous batching the drafter proposes for every request that uses it in one batched
forward per draft position (`propose_batch`): each request's cache is then a slot of the
drafter's own KV pool, as the target's are of its pool."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from workers.config import MAX_DRAFT_LEN, ModelDrafterConfig
from workers.drafters.base import Draft, DraftContext, DraftRequest, draft_tokens, token_ids_of
from workers.models.base import BatchedLM, CausalLM, ForwardOutput, KVCache, KVPoolLike, SeqInput, forward_each
from workers.sampling import log_probs
from workers.tree import TreeGrowth, grow_tree


@dataclass
class ModelDraftState:
    cache: KVCache
    num_cached: int = 0  # leading tokens of ctx.token_ids whose keys and values are in cache
    num_draft_cached: int = 0  # own draft tokens fed after them during the last proposal


class ModelDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = False

    def __init__(self, config: ModelDrafterConfig, model: CausalLM, vocab_ids: torch.Tensor | None = None,
                 max_num_seqs: int = 1, max_model_len: int | None = None) -> None:
        """`max_num_seqs`: requests that may draft at once (the scheduler's), the slots of the KV
        pool batched proposals run in; 1: every request drafts alone in a cache of its own.
        `max_model_len`: the target's context limit, which bounds each slot (default: the
        model's positions)."""
        self.config = config
        self.name = config.name
        self.model = model
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(model.device)
        self.max_num_seqs = max_num_seqs
        self.slot_capacity = min(model.info.max_position, max_model_len or model.info.max_position)
        self._pool: KVPoolLike | None = None  # made at the first request that can use it

    def begin(self, ctx: DraftContext) -> ModelDraftState:
        tree = ctx.tree_shape(self.config.tree)
        if tree is None and self.max_num_seqs > 1 and isinstance(self.model, BatchedLM):
            if self._pool is None:
                self._pool = self.model.new_pool(self.max_num_seqs, self.slot_capacity)
            # else (more requests than slots: a serial run beside a batch) a cache of its own
            if self._pool.num_free and ctx.max_len <= self._pool.capacity:
                return ModelDraftState(cache=self._pool.allocate())
        # drafts stay inside the request's token budget, so its length bounds the cache too; a
        # tree's levels take up to topk rows per depth past the context
        extra = tree.topk * MAX_DRAFT_LEN if tree is not None else 0
        return ModelDraftState(cache=self.model.new_cache(min(ctx.max_len + extra, self.model.info.max_position)))

    def propose(self, state: ModelDraftState, ctx: DraftContext, k: int) -> Draft:
        if ctx.tree_shape(self.config.tree) is None:
            return self._chains([DraftRequest(state, ctx, k)])[0]
        pending = self._pending(state, ctx)
        logits = self.model.forward(pending, state.cache, last_only=True).logits  # [1, vocab]
        return self._propose_tree(state, ctx, logits[-1], k)

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """The requests drafting in slots of the pool run each draft position in one forward;
        the others (a cache of their own, or a tree) propose alone."""
        pool = self._pool
        pooled = [b for b, r in enumerate(requests)
                  if pool is not None and getattr(r.state.cache, "pool", None) is pool]
        drafts = dict(zip(pooled, self._chains([requests[b] for b in pooled])))
        return [drafts[b] if b in drafts else self.propose(r.state, r.ctx, r.k) for b, r in enumerate(requests)]

    def _chains(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Each request's chain of k draft tokens: first every request's pending tokens (those
        emitted since its last proposal), then one row per request still drafting, each position
        in one forward (batched over the pool's slots when there are several requests)."""
        model = self.model
        if len(requests) > 1:
            assert isinstance(model, BatchedLM)
            forward: Callable[[list[SeqInput]], list[ForwardOutput]] = model.forward_batch
        else:
            forward = functools.partial(forward_each, model)
        tokens: list[list[torch.Tensor]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        rows = list(range(len(requests)))  # the requests whose rows the next forward runs, in order
        inputs = [SeqInput(self._pending(r.state, r.ctx), r.state.cache, "last") for r in requests]
        i = 0
        while inputs:
            outs = forward(inputs)
            next_rows, inputs = [], []
            for b, out in zip(rows, outs):
                r = requests[b]
                if i >= r.k:  # k = 0: caught up only
                    continue
                token, p = draft_tokens(out.logits[-1:], r.ctx, len(r.ctx.token_ids) + i, self.vocab_ids,
                                        self.model.info.vocab_size)
                tokens[b].append(token)
                if p is not None:
                    probs[b].append(p)
                if i < r.k - 1:  # the last draft token is never fed: nothing would read its logits
                    inputs.append(SeqInput(token, r.state.cache, "last"))
                    next_rows.append(b)
            rows, i = next_rows, i + 1
        for r in requests:
            r.state.num_draft_cached = max(r.k - 1, 0)
        return [self._draft(t, p) for t, p in zip(tokens, probs)]

    def _pending(self, state: ModelDraftState, ctx: DraftContext) -> torch.Tensor:
        """The tokens emitted since the cache was last fed; the cache will hold all of ctx."""
        pending = torch.tensor(ctx.token_ids[state.num_cached :], dtype=torch.long, device=self.model.device)
        state.num_cached = len(ctx.token_ids)
        return pending

    def _draft(self, token_ids: list[torch.Tensor], probs: list[torch.Tensor]) -> Draft:
        if not token_ids:
            return Draft(torch.empty(0, dtype=torch.long, device=self.model.device))
        return Draft(torch.cat(token_ids), torch.cat(probs) if probs else None)

    def _propose_tree(self, state: ModelDraftState, ctx: DraftContext, root_logits: torch.Tensor, k: int) -> Draft:
        """A dynamic draft tree of depth k (workers/tree.py): each level's expanded nodes run in
        one forward, each at the position of its depth, seeing the context and its ancestors.
        Their cache rows are dropped at commit (the accepted tokens are fed again next time)."""
        device, cache = self.model.device, state.cache

        def expand(growth: TreeGrowth, nodes: list[int]) -> torch.Tensor:
            positions, mask = growth.level_inputs(nodes, state.num_cached, cache.length, device)
            rows = torch.tensor([growth.row[n] for n in nodes], dtype=torch.long, device=device)
            tokens = token_ids_of(rows, self.vocab_ids)
            logits = self.model.forward(tokens, cache, positions=positions, mask=mask).logits  # type: ignore[call-arg]
            return log_probs(logits, ctx.params)

        tree = self.config.tree
        assert tree is not None
        k = min(k, 1 + (cache.capacity - cache.length) // tree.topk)  # the levels must fit in the cache
        rows, shape = grow_tree(log_probs(root_logits[None], ctx.params)[0], expand, k, tree.topk, tree.nodes)
        state.num_draft_cached = 0
        return Draft(token_ids_of(torch.tensor(rows, dtype=torch.long, device=device), self.vocab_ids), tree=shape)

    def commit(self, state: ModelDraftState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        # cached drafts stay valid up to the first rejected one
        keep = state.num_cached + min(num_accepted, state.num_draft_cached)
        state.cache.truncate(keep)
        state.num_cached = keep
        state.num_draft_cached = 0

    def end(self, state: ModelDraftState) -> None:
        if self._pool is not None and getattr(state.cache, "pool", None) is self._pool:
            self._pool.release(state.cache)
        state.cache = None  # type: ignore[assignment]  # free the cache memory now
