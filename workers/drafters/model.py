"""An independent small causal LM as drafter (SpS), with its own KV cache and rollback.

The model may compute logits over a reduced draft vocabulary only (`vocab_ids`: the token id of
each logits column, e.g. a distilled drafter's most frequent tokens): a draft token then costs a
fraction of the full lm_head, and its probabilities are spread back over the whole vocabulary
(zero elsewhere) for rejection sampling, which stays exact."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from workers.config import MAX_DRAFT_LEN, ModelDrafterConfig
from workers.drafters.base import Draft, DraftContext, full_vocab_probs, token_ids_of
from workers.models.base import CausalLM, KVCache
from workers.sampling import log_probs, probs_from_logits
from workers.tree import TreeGrowth, grow_tree


@dataclass
class ModelDraftState:
    cache: KVCache
    num_cached: int = 0  # leading tokens of ctx.token_ids whose keys and values are in cache
    num_draft_cached: int = 0  # own draft tokens fed after them during the last proposal


class ModelDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = False

    def __init__(self, config: ModelDrafterConfig, model: CausalLM, vocab_ids: torch.Tensor | None = None) -> None:
        self.config = config
        self.name = config.name
        self.model = model
        self.vocab_ids = None if vocab_ids is None else vocab_ids.to(model.device)

    def begin(self, ctx: DraftContext) -> ModelDraftState:
        # drafts stay inside the request's token budget, so its length bounds the cache too; a
        # tree's levels take up to topk rows per depth past the context
        extra = self.config.tree.topk * MAX_DRAFT_LEN if self.config.tree is not None else 0
        return ModelDraftState(cache=self.model.new_cache(min(ctx.max_len + extra, self.model.info.max_position)))

    def propose(self, state: ModelDraftState, ctx: DraftContext, k: int) -> Draft:
        device = self.model.device
        pending = torch.tensor(ctx.token_ids[state.num_cached :], dtype=torch.long, device=device)
        logits = self.model.forward(pending, state.cache, last_only=True).logits  # [1, vocab]
        state.num_cached = len(ctx.token_ids)
        if self.config.tree is not None:
            return self._propose_tree(state, ctx, logits[-1], k)
        token_ids: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            if ctx.params.greedy:
                row = logits[-1].argmax().view(1)
            else:
                p = probs_from_logits(logits[-1:], ctx.params)  # [1, vocab']
                row = torch.multinomial(p[0], 1, generator=ctx.generator)
                probs.append(full_vocab_probs(p, self.vocab_ids, self.model.info.vocab_size))
            token = token_ids_of(row, self.vocab_ids)
            token_ids.append(token)
            if i < k - 1:  # the last draft token is never fed: nothing would read its logits
                logits = self.model.forward(token, state.cache).logits
        state.num_draft_cached = max(k - 1, 0)
        if not token_ids:
            return Draft(torch.empty(0, dtype=torch.long, device=device))
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
        state.cache = None  # type: ignore[assignment]  # free the cache memory now
