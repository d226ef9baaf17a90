"""Suffix decoding: draft what most often followed the current suffix, in this request and in the
past outputs of its domain (SuffixDecoding, Oliaro et al., NeurIPS'25; vLLM's `suffix` method).

Prompt lookup (`ngram`) reads only the request's own context. Served traffic also repeats across
requests: agents call the same tools, extraction jobs emit the same keys, templated requests get
templated answers. This drafter keeps one index per domain over the outputs that domain served
(`SuffixCaches`, bounded by a token budget: the oldest requests go first; salted requests,
vLLM's `cache_salt`, read and feed their salt's own) and one per request over
its prompt and output. A proposal reads the continuations of the longest match, in both at once,
and follows the most frequent one while its estimated acceptance (the share of occurrences that
continue that way, times the path so far) stays >= `min_token_prob` (with `tree`: the likeliest
few branches); it drafts at most `max_spec_factor * match length` tokens, since a long match
predicts a long copy. Training-free and cheap, so the router scores it every step.

A sampled request's past outputs are samples of the target's distribution in like contexts, so
with `sample_drafts` its chain is drawn from the continuations' frequencies and verified against
them as the draft distribution q (rejection sampling): a draft accepted with probability
sum min(p, q) rather than the likeliest continuation's p, which pays where past outputs vary.
A sampled output repeats a drawn draft less often (sum p q) than verification accepts it, so
routing scores a drawn draft's shadow by its likeliest alternative (`Draft.likeliest`). A seeded
request's step matches its draft against draws keyed by position (workers/sampling.py
`PositionDraws`): there each token is raced by its count on the exponentials the target's own draw
races on, coupled to it, and the draft is its own shadow. Off by default: the drafter gains, the
router over it measured no faster (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from workers.config import SuffixDrafterConfig
from workers.drafters.base import Draft, DraftContext, TrafficMemory
from workers.drafters.token_index import SEPARATOR, Match, TokenIndex
from workers.sampling import PositionDraws
from workers.tree import DraftTree

MAX_MATCH_LENGTHS = 3  # distinct match lengths a proposal weighs (the longest ones)


@dataclass(frozen=True)
class Proposal:
    token_ids: list[int]
    parents: tuple[int, ...]  # per token, its parent token (-1: the root): a chain or a tree
    # a drawn chain's draft distribution per token: each continuation's share of the occurrences
    shares: tuple[dict[int, float], ...] | None = None
    likeliest: list[int] | None = None  # a drawn chain's likeliest alternative (the shadow routing scores)


def continuations(live: Sequence[Match], at: int) -> dict[int, list[Match]]:
    """The occurrences in `live` by their token `at` past the match (those that end there left
    out), the most frequent token first (ties: the earlier match's)."""
    groups: dict[int, list[Match]] = {}
    for m in live:
        if (token := m.at(at)) != SEPARATOR:
            groups.setdefault(token, []).append(m)
    return dict(sorted(groups.items(), key=lambda g: -len(g[1])))


def grow(
    matches: Sequence[Match], depth: int, min_prob: float, topk: int = 1, num_nodes: int | None = None,
) -> Proposal:
    """The likeliest continuations of `matches`, best first: a node's estimated acceptance is its
    parent's times the share of the parent's occurrences that continue with its token. Each added
    node offers its `topk` most frequent next tokens (ties: the earlier match's), down to
    `min_prob`, `depth` tokens deep, `num_nodes` in all (default: depth). topk = 1: a chain."""
    num_nodes = depth if num_nodes is None else num_nodes
    tokens: list[int] = []
    parents: list[int] = []
    heap: list[tuple[float, int, int, int, int, list[Match]]] = []  # (-prob, order, parent, depth, token, live)
    order = itertools.count()  # equal estimates: the earlier offered first

    def offer(parent: int, prob: float, at: int, live: list[Match]) -> None:
        for token, group in itertools.islice(continuations(live, at).items(), topk):
            if (p := prob * len(group) / len(live)) >= min_prob:
                heapq.heappush(heap, (-p, next(order), parent, at + 1, token, group))

    if depth > 0:
        offer(-1, 1.0, 0, list(matches))
    while heap and len(tokens) < num_nodes:
        neg_prob, _, parent, at, token, live = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        if at < depth:
            offer(len(tokens) - 1, -neg_prob, at, live)
    return Proposal(tokens, tuple(parents))


# a drawn chain's token at a depth, from the continuations there and their counts
Pick = Callable[[list[int], list[int], int], int]


def sampled(generator: torch.Generator) -> Pick:
    """Each token sampled by its count from the request's random stream."""
    def pick(tokens: list[int], counts: list[int], at: int) -> int:
        bounds = list(itertools.accumulate(counts))
        u = float(torch.rand((), generator=generator, device=generator.device)) * bounds[-1]
        return tokens[next((i for i, c in enumerate(bounds) if u < c), len(bounds) - 1)]
    return pick


def raced(draws: PositionDraws, start: int) -> Pick:
    """Each token raced by its count on the request's keyed draws at its position (`start`: the
    first drafted token's), the exponentials the target's own draw there races on."""
    return lambda tokens, counts, at: draws.race(tokens, counts, start + at)


def draw(matches: Sequence[Match], depth: int, min_prob: float, pick: Pick, with_shares: bool = True) -> Proposal:
    """A chain drawn from the continuations of `matches`: each token `pick`ed by the counts of the
    occurrences that go on (the occurrences that continue so are kept for the next). It stops
    where the estimate along the drawn path, the product of each level's likeliest share, falls
    below `min_prob` (`grow`'s rule for its chain). `with_shares`: the draft distribution too
    (what rejection sampling verifies against; a race on the step's own draws needs none)."""
    tokens: list[int] = []
    shares: list[dict[int, float]] = []
    live, prob = list(matches), 1.0
    for at in range(depth):
        groups = continuations(live, at)
        if not groups or (prob := prob * len(next(iter(groups.values()))) / len(live)) < min_prob:
            break
        counts = [len(g) for g in groups.values()]
        token, total = pick(list(groups), counts, at), sum(counts)
        tokens.append(token)
        if with_shares:
            shares.append({t: c / total for t, c in zip(groups, counts)})
        live = groups[token]
    return Proposal(tokens, tuple(range(-1, len(tokens) - 1)), tuple(shares) if with_shares else None)


MemoryKey = tuple[str, str | None]  # (domain, cache_salt): the requests whose outputs one index keeps


class SuffixCaches:
    """Past outputs per domain and cache salt (requests of other salts never read them), in one
    token budget over all: past it, the oldest request is evicted first. Thread-safe: requests on
    other threads may read while one adds."""

    def __init__(self, min_n: int, max_n: int, max_tokens: int) -> None:
        self.min_n, self.max_n, self.max_tokens = min_n, max_n, max_tokens
        self.indexes: dict[MemoryKey, TokenIndex] = {}
        self._order: deque[tuple[MemoryKey, int]] = deque()  # per request kept: (its index, absolute end)
        self.num_tokens = 0
        self.lock = threading.Lock()

    def add(self, domain: str, output_ids: Sequence[int], salt: str | None = None) -> None:
        if not output_ids or self.max_tokens < 2:  # room for one token and its separator at least
            return
        kept = list(output_ids[-(self.max_tokens - 1) :])
        key = (domain, salt)
        with self.lock:
            index = self.indexes.get(key)
            if index is None:
                index = self.indexes[key] = TokenIndex(self.min_n, self.max_n)
            index.extend([*kept, SEPARATOR])
            self._order.append((key, index.end))
            self.num_tokens += len(kept) + 1
            while self.num_tokens > self.max_tokens:
                oldest, end = self._order.popleft()
                evicted = self.indexes[oldest]
                self.num_tokens -= end - evicted.start
                evicted.evict(end)
                if not len(evicted):
                    del self.indexes[oldest]

    def index(self, domain: str, salt: str | None = None) -> TokenIndex | None:
        """The past outputs a request of `domain` salted `salt` reads (hold `lock` while reading)."""
        return self.indexes.get((domain, salt))

    def sizes(self) -> dict[str, int]:
        """Tokens kept per domain, over its salts (separators included: they are the budget's units too)."""
        sizes: dict[str, int] = {}
        with self.lock:
            for (domain, _), index in self.indexes.items():
                sizes[domain] = sizes.get(domain, 0) + len(index)
        return sizes


@dataclass
class SuffixState:
    own: TokenIndex  # this request's prompt and output
    empty: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


class SuffixDrafter:
    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, config: SuffixDrafterConfig, vocab_size: int | None = None) -> None:
        """`vocab_size`: the target's, the width of a drawn chain's draft distribution (None: chains
        are never drawn, only the likeliest proposed)."""
        self.config = config
        self.name = config.name
        self.vocab_size = vocab_size
        self.caches = self.new_caches()

    def new_caches(self) -> SuffixCaches:
        return SuffixCaches(self.config.min_n, self.config.max_n, self.config.cache_tokens)

    def begin(self, ctx: DraftContext) -> SuffixState:
        return SuffixState(TokenIndex(self.config.min_n, self.config.max_n))

    def propose(self, state: SuffixState, ctx: DraftContext, k: int) -> Draft:
        cfg = self.config
        tree = ctx.tree_shape(cfg.tree)
        if tree is None and cfg.sample_drafts and ctx.draws is not None:
            # raced on the draws the step matches it against: the race is the draft's own shadow
            pick = raced(ctx.draws, len(ctx.token_ids))
            best = self._proposal(state, ctx, k, lambda m, depth: draw(m, depth, cfg.min_token_prob, pick,
                                                                       with_shares=False))
        elif tree is None and self.vocab_size is not None and cfg.sample_drafts and not ctx.exact_match:
            pick = sampled(ctx.generator)
            best = self._proposal(state, ctx, k, lambda m, depth: dataclasses.replace(
                draw(m, depth, cfg.min_token_prob, pick), likeliest=grow(m, depth, cfg.min_token_prob).token_ids))
        else:
            topk, nodes = (1, None) if tree is None else (tree.topk, tree.nodes)
            best = self._proposal(state, ctx, k, lambda m, depth: grow(m, depth, cfg.min_token_prob, topk, nodes))
        if not best.token_ids:
            return Draft(state.empty)
        ids = torch.tensor(best.token_ids, dtype=torch.long)
        if best.shares is not None:
            assert self.vocab_size is not None
            probs = torch.zeros(len(best.shares), self.vocab_size)  # q on the target's device, as p is
            for row, shares in enumerate(best.shares):
                probs[row, list(shares)] = torch.tensor(list(shares.values()))
            probs = probs.to(ctx.generator.device)
            return Draft(ids, probs, likeliest=best.likeliest)
        return Draft(ids) if tree is None else Draft(ids, tree=DraftTree(best.parents))

    def continuation(self, state: SuffixState, ctx: DraftContext, k: int) -> list[int]:
        """The likeliest chain of at most k tokens, whatever `tree` says (what lookahead decoding
        guesses from this drafter's memory)."""
        return self._proposal(state, ctx, k, lambda m, depth: grow(m, depth, self.config.min_token_prob)).token_ids

    def _proposal(self, state: SuffixState, ctx: DraftContext, k: int,
                  extend: Callable[[list[Match], int], Proposal]) -> Proposal:
        """The continuation of the longest match (`extend`ed to a depth), read from every
        occurrence at least that long, the request's own first; when it proposes nothing, of the
        next longest."""
        cfg, ids = self.config, ctx.token_ids
        state.own.extend(ids[state.own.end :])
        matches = state.own.matches(ids, cfg.max_depth, cfg.max_occurrences)
        with self.caches.lock:  # a past output's tokens are read until the proposal is grown
            if ctx.domain is not None and (past := self.caches.index(ctx.domain, ctx.cache_salt)) is not None:
                matches += past.matches(ids, cfg.max_depth, cfg.max_occurrences)
            for length in sorted({m.length for m in matches}, reverse=True)[:MAX_MATCH_LENGTHS]:
                depth = min(k, int(cfg.max_spec_factor * length + cfg.max_spec_offset))
                if (proposal := extend([m for m in matches if m.length >= length], depth)).token_ids:
                    return proposal
        return Proposal([], ())

    def commit(self, state: SuffixState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass  # the request's index catches up on the next proposal

    def end(self, state: SuffixState) -> None:
        pass

    def learn(self, ctx: DraftContext) -> None:
        """A request of `ctx.domain` finished (or stopped): its output joins that domain's cache,
        for the requests of its salt."""
        if ctx.domain is not None:
            self.caches.add(ctx.domain, ctx.token_ids[ctx.num_prompt :], ctx.cache_salt)

    def memory(self) -> TrafficMemory:
        return TrafficMemory(self.caches.sizes(), self.caches.max_tokens)
