"""Lookahead decoding: the target drafts for itself through Jacobi iteration (Fu et al., ICML'24;
hao-ai-lab/LookaheadDecoding).

Each step runs two branches beside the step's own token, in the one target forward:
- the lookahead branch, a window of W future positions guessed over N - 1 levels (the latest
  Jacobi iterations). Column i is the path level0[0..i], level1[i], ..., level(N-2)[i]: the
  first level read left to right, then the column upwards, each token one position further, as
  LookaheadDecoding's 2D mask lets it attend. The target's next token at the top of each column is
  that column's new level; the column's tokens from the bottom up plus that token are an n-gram,
  which goes to the pool under its first token, and the oldest level drops out.
- the verification branch: up to G n-grams of the pool that follow the step's last token (one
  where the step verifies only a tree's leading chain: a guided request, DraftContext.exact_tree).
Both are paths from the step's root, so the draft is a tree (workers/tree.py) with the branches
merged where they share a prefix; the engine verifies the whole tree, losslessly for greedy and
sampled requests alike (any root path the target agrees with is kept, guesses or window), and
hands this drafter the logits at every node (`read_logits`).

The pool starts from the prompt's n-grams (`pool_from_prompt`) and, with `pool_from_traffic`, each
step also guesses a suffix drafter's likeliest continuation: what the request's domain served
before (workers/drafters/suffix.py), which the Jacobi window cannot know.

No model and no training, but every window and guess token is a target row: it pays where rows are
nearly free (a GPU at small batch, a CPU whose products cost little more for a few rows), and
where they are not the router does not choose it.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from workers.config import LookaheadDrafterConfig
from workers.drafters.base import Draft, DraftContext
from workers.drafters.suffix import SuffixDrafter, SuffixState
from workers.sampling import greedy_ids
from workers.tree import DraftTree


@dataclass
class NgramPool:
    """n-grams by first token, the latest `per_key` kept for each (the oldest dropped first)."""

    per_key: int
    grams: dict[int, OrderedDict[tuple[int, ...], None]] = field(default_factory=dict)

    def add(self, first: int, rest: tuple[int, ...]) -> None:
        if self.per_key == 0:
            return
        kept = self.grams.setdefault(first, OrderedDict())
        kept[rest] = None
        kept.move_to_end(rest)
        if len(kept) > self.per_key:
            kept.popitem(last=False)

    def after(self, first: int) -> list[tuple[int, ...]]:
        """The continuations kept for `first`, the latest first."""
        return list(reversed(self.grams.get(first, {})))


@dataclass
class LookaheadState:
    levels: list[list[int]]  # the window's levels, oldest first; fewer than N - 1 while it fills
    pool: NgramPool
    columns: list[int] = field(default_factory=list)  # the last draft's node at the top of each column
    traffic: SuffixState | None = None  # the pool_from_traffic drafter's state for this request


class LookaheadDrafter:
    needs_hidden_states: ClassVar[bool] = False
    # proposing is free, but the window only moves with the rows it runs in the target forward:
    # it cannot be scored on steps it does not run
    cheap: ClassVar[bool] = False

    def __init__(self, config: LookaheadDrafterConfig, traffic: SuffixDrafter | None = None) -> None:
        """`traffic`: the suffix drafter `config.pool_from_traffic` names."""
        self.config = config
        self.name = config.name
        self.traffic = traffic

    def begin(self, ctx: DraftContext) -> LookaheadState:
        c = self.config
        pool = NgramPool(c.guesses)
        if c.pool_from_prompt:
            prompt = ctx.token_ids[: ctx.num_prompt or len(ctx.token_ids)]
            for i in range(len(prompt) - c.ngram + 1):
                pool.add(prompt[i], tuple(prompt[i + 1 : i + c.ngram]))
        # the first level starts as tokens of the context (LookaheadDecoding's initialisation),
        # drawn by a generator of its own: the request's generator belongs to its sampling
        rng = random.Random(len(ctx.token_ids))
        traffic = self.traffic.begin(ctx) if self.traffic is not None else None
        return LookaheadState([rng.choices(ctx.token_ids, k=c.window)], pool, traffic=traffic)

    def propose(self, state: LookaheadState, ctx: DraftContext, k: int) -> Draft:
        root = ctx.token_ids[-1]
        if self.traffic is not None and state.traffic is not None:  # the latest guess: tried first
            if guess := self.traffic.continuation(state.traffic, ctx, self.config.ngram - 1):
                state.pool.add(root, tuple(guess))
        tokens: list[int] = []
        parents: list[int] = []
        nodes: dict[tuple[int, int], int] = {}  # (parent node, token) -> node: shared prefixes merge

        def node(parent: int, token: int) -> int:
            if (parent, token) not in nodes:
                nodes[(parent, token)] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            return nodes[(parent, token)]

        # the verification branch first: a sampled step tries a node's children in order
        for rest in state.pool.after(root)[: self.config.verified_guesses(ctx.exact_tree)]:
            parent = -1
            for token in rest[: max(1, min(k, self.config.ngram - 1))]:
                parent = node(parent, token)
        state.columns = []
        below = -1  # the first level, left to right
        for i, token in enumerate(state.levels[0]):
            below = top = node(below, token)
            for level in state.levels[1:]:  # then column i upwards
                top = node(top, level[i])
            state.columns.append(top)
        return Draft(torch.tensor(tokens, dtype=torch.long), tree=DraftTree(tuple(parents)))

    def read_logits(self, state: LookaheadState, ctx: DraftContext, logits: torch.Tensor) -> None:
        if not state.columns or max(state.columns) + 1 >= logits.shape[0]:
            return  # the tree was cut to fit the token budget: the window waits
        new = greedy_ids(logits[[1 + n for n in state.columns]]).tolist()
        levels = state.levels
        if len(levels) == self.config.ngram - 1:  # full: collect each column's n-gram, drop the oldest level
            for i, token in enumerate(new):
                state.pool.add(levels[0][i], (*(level[i] for level in levels[1:]), token))
            levels.pop(0)
        levels.append(new)
        state.columns = []

    def commit(self, state: LookaheadState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the window does not follow the accepted tokens: its guesses stay guesses

    def end(self, state: LookaheadState) -> None:
        pass
