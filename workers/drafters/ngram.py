"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

Training-free and nearly free to run; it wins when the answer copies its context (summaries,
RAG, code edits). The index is incremental: each new token adds one entry per n, so a proposal
costs O(max_n - min_n + k) whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from workers.config import NgramDrafterConfig
from workers.drafters.base import Draft, DraftContext


@dataclass
class NgramState:
    # index[n][ngram] = the position right after the latest occurrence of ngram that has a
    # continuation, i.e. the first token to propose
    index: dict[int, dict[tuple[int, ...], int]]
    num_indexed: int = 0  # positions j < num_indexed have been entered as continuation starts
    empty: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class NgramDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, config: NgramDrafterConfig) -> None:
        self.config = config
        self.name = config.name

    def begin(self, ctx: DraftContext) -> NgramState:
        return NgramState(index={n: {} for n in range(self.config.min_n, self.config.max_n + 1)})

    def _update(self, state: NgramState, ids: list[int]) -> None:
        for j in range(max(state.num_indexed, 1), len(ids)):
            for n, table in state.index.items():
                if j >= n:
                    table[tuple(ids[j - n : j])] = j
        state.num_indexed = max(state.num_indexed, len(ids))

    def propose(self, state: NgramState, ctx: DraftContext, k: int) -> Draft:
        ids = ctx.token_ids
        # indexes continuation starts j <= len - 1; the suffix itself (j = len) never matches
        self._update(state, ids)
        for n in range(self.config.max_n, self.config.min_n - 1, -1):
            if len(ids) < n:
                continue
            start = state.index[n].get(tuple(ids[-n:]))
            if start is not None:
                return Draft(torch.tensor(ids[start : start + k], dtype=torch.long))
        return Draft(state.empty)

    def commit(self, state: NgramState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the index catches up lazily on the next proposal

    def end(self, state: NgramState) -> None:
        pass
