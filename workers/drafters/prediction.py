"""Predicted outputs: draft from the text a request expects its output to be (OpenAI's Predicted
Outputs: a code edit sends the file it rewrites, a regenerated document its last version).

The drafter keeps the place in the prediction where the output continues and drafts the next k
predicted tokens from there. So a prediction is drafted from its first token on, with no match
needed first (prompt lookup needs one), and where the prediction repeats itself the place decides,
not the latest occurrence (prompt lookup's guess). Where the output leaves the prediction (the
edit), the place is lost until the output's last min_n..max_n tokens occur in the prediction again;
the occurrence nearest after the last place in sync wins, since an edit rewrites a text in order.
Verification keeps the output the target's, whatever the prediction says. Training-free and
cheap, so the router scores it every step; it proposes nothing for a request without a prediction.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from workers.config import PredictionDrafterConfig
from workers.drafters.base import Draft, DraftContext
from workers.drafters.token_index import TokenIndex


@dataclass
class PredictionState:
    index: TokenIndex  # the prediction's n-grams, to find the place again once the output leaves it
    seen: int  # tokens of the request's context followed so far
    place: int | None = 0  # where the output continues in the prediction; None: lost since they parted
    synced: int = 0  # the furthest place the output has followed the prediction to
    empty: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class PredictionDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, config: PredictionDrafterConfig) -> None:
        self.config = config
        self.name = config.name

    def begin(self, ctx: DraftContext) -> PredictionState:
        index = TokenIndex(self.config.min_n, self.config.max_n)
        index.extend(ctx.params.prediction)
        return PredictionState(index, seen=ctx.num_prompt)

    def propose(self, state: PredictionState, ctx: DraftContext, k: int) -> Draft:
        prediction = ctx.params.prediction
        if not prediction:
            return Draft(state.empty)
        follow(state, prediction, ctx.token_ids, ctx.num_prompt)
        if state.place is None or state.place >= len(prediction):
            return Draft(state.empty)
        return Draft(torch.tensor(prediction[state.place : state.place + k], dtype=torch.long))

    def commit(self, state: PredictionState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the next proposal follows the new tokens (steps other drafters run included)

    def end(self, state: PredictionState) -> None:
        pass


def follow(state: PredictionState, prediction: tuple[int, ...], token_ids: list[int], num_prompt: int) -> None:
    """Move the place in the prediction over the tokens appended since the last call: one place per
    token while they agree; once they part, the place is lost until `realign` finds it again."""
    if state.seen == len(token_ids):
        return
    for token in token_ids[state.seen :]:
        if state.place is not None and state.place < len(prediction) and prediction[state.place] == token:
            state.place += 1
            state.synced = max(state.synced, state.place)
        else:
            state.place = None
    state.seen = len(token_ids)
    if state.place is None:
        state.place = realign(state.index, token_ids[num_prompt:], state.synced)


def realign(index: TokenIndex, output: list[int], synced: int) -> int | None:
    """Where the output continues in the indexed prediction: after the longest n-gram ending the
    output that occurs there, its first occurrence at or after `synced` (else its last before);
    None where no n-gram of the output's tail occurs."""
    _, positions = index.occurrences(output)
    if not positions:
        return None
    i = bisect.bisect_left(positions, synced)
    return positions[i] if i < len(positions) else positions[-1]
