"""Prompt lookup (n-gram) drafting: copy what followed the latest earlier occurrence of the suffix.

Training-free and nearly free to run; it wins when the answer copies its context (summaries,
RAG, code edits). The index (workers/drafters/token_index.py) is incremental: each new token adds
one entry per n, so a proposal costs O(max_n - min_n + k) whatever the context length.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from workers.config import NgramDrafterConfig
from workers.drafters.base import Draft, DraftContext
from workers.drafters.token_index import TokenIndex


@dataclass
class NgramState:
    index: TokenIndex  # the request's tokens, up to the last proposal
    empty: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class NgramDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, config: NgramDrafterConfig) -> None:
        self.config = config
        self.name = config.name

    def begin(self, ctx: DraftContext) -> NgramState:
        return NgramState(TokenIndex(self.config.min_n, self.config.max_n))

    def propose(self, state: NgramState, ctx: DraftContext, k: int) -> Draft:
        ids = ctx.token_ids
        # indexes continuation starts j <= len - 1; the suffix itself (j = len) never matches
        state.index.extend(ids[state.index.end :])
        _, positions = state.index.occurrences(ids)
        if not positions:
            return Draft(state.empty)
        start = positions[-1]  # the latest occurrence
        return Draft(torch.tensor(ids[start : start + k], dtype=torch.long))

    def commit(self, state: NgramState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the index catches up lazily on the next proposal

    def end(self, state: NgramState) -> None:
        pass
