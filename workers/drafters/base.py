"""The drafter interface: propose k tokens for the engine to verify.

A drafter object is shared by every request on a replica; per-request state (a KV cache, an
n-gram index) lives in the object `begin` returns. Drafters never choose their own k: the
engine (and, above it, the policy) does. Capabilities are declared as class attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from workers.config import TreeConfig
from workers.sampling import PositionDraws, SamplingParams, greedy_ids, probs_from_logits, sample_ids
from workers.structured import Guide
from workers.tree import DraftTree


@dataclass
class Draft:
    token_ids: torch.Tensor  # [k'] int64, k' <= k (a drafter may propose fewer, even none)
    probs: torch.Tensor | None = None  # [k', vocab] proposal distribution; None = deterministic
    # token_ids are the nodes of this tree, k' its depth (workers/tree.py); None: a chain. A tree's
    # candidates are deterministic (probs None)
    tree: DraftTree | None = None
    # a drawn chain's likeliest alternative: what routing scores as the drafter's shadow, since a
    # sampled output repeats a drawn draft less often than verification accepts it (None: token_ids)
    likeliest: list[int] | None = None

    @property
    def scored_ids(self) -> list[int]:
        """The tokens a shadow of this draft is scored by."""
        return self.token_ids.tolist() if self.likeliest is None else self.likeliest


@dataclass
class DraftContext:
    """What a drafter may read when proposing for one request."""

    token_ids: list[int]  # prompt + generated so far (the engine appends; drafters only read)
    params: SamplingParams
    generator: torch.Generator
    max_len: int  # the longest token_ids can grow in this request: prompt + max_tokens
    # [max_len, hidden] the target's final hidden state at each position, filled for every token
    # but the newest (its forward has not run yet); None unless a drafter needs_hidden_states
    features: torch.Tensor | None = None
    num_prompt: int = 0  # token_ids[:num_prompt] is the prompt
    # the routing domain of a request served as traffic; None (calibration, a bare engine call):
    # drafters that learn from traffic neither read nor feed a domain's memory for it
    domain: str | None = None
    # vLLM's cache_salt: the request shares what it leaves in caches (reused prefixes, a domain's
    # traffic memory) only with requests of the same salt (None: with unsalted ones), so no tenant
    # reads another's traffic in its timings
    cache_salt: str | None = None
    # the step verifies every node of a draft tree; False for a guided request, whose step verifies
    # a chain (the tree's leading chain, masked by its grammar: SpecEngine's _guided)
    exact_tree: bool = True
    # the request's place in the grammar its output must match (workers/structured.py); None: free text
    guide: Guide | None = None
    # a sampled request's draws keyed by position (workers/sampling.py PositionDraws): its steps
    # verify by exact match against them, and a drafter races its own distribution on them
    draws: PositionDraws | None = None

    @property
    def exact_match(self) -> bool:
        """Whether the steps verify by exact match: greedy decoding, or draws keyed by position."""
        return self.params.greedy or self.draws is not None

    def tree_shape(self, tree: TreeConfig | None) -> TreeConfig | None:
        """The tree a drafter configured with `tree` drafts for this request (`drafted_tree`)."""
        return drafted_tree(tree, self.exact_tree)


def drafted_tree(tree: TreeConfig | None, exact_tree: bool) -> TreeConfig | None:
    """The tree a drafter configured with `tree` drafts: none (a chain) where the step verifies
    a chain only (DraftContext.exact_tree)."""
    return tree if exact_tree else None


def token_ids_of(rows: torch.Tensor, vocab_ids: torch.Tensor | None) -> torch.Tensor:
    """The target's token ids of draft-vocabulary rows (`vocab_ids`: the token id of each row;
    None: the rows are token ids already)."""
    return rows if vocab_ids is None else vocab_ids[rows]


def full_vocab_probs(q: torch.Tensor, vocab_ids: torch.Tensor | None, vocab_size: int) -> torch.Tensor:
    """[n, draft vocab] draft probabilities over the target's vocabulary (zero outside the draft
    vocabulary, whose token ids `vocab_ids` lists; None: q is over the whole vocabulary already):
    rejection sampling needs q on the same support as the target's p."""
    if vocab_ids is None:
        return q
    full = torch.zeros(q.shape[0], vocab_size, dtype=q.dtype, device=q.device)
    full[:, vocab_ids] = q
    return full


# a drafter races q ** 2 on keyed draws: teacher-forced on 13 held-out Spec-Bench answers sampled
# at 0.7 (`python -m bench.agreement --temperature 0.7`), its token then equals the target's draw
# 0.243 of the time (distilled), 0.298 (EAGLE), 0.139 (Medusa), against 0.222 / 0.276 / 0.126 for
# the likeliest token and 0.224 / 0.284 / 0.135 racing q itself (sum min(p, q), what rejection
# sampling accepts: 0.253 / 0.314 / 0.152): these drafters are less sure than the target, and
# squaring q sharpens them toward it
RACE_POWER = 2


def draft_tokens(
    logits: torch.Tensor, ctx: DraftContext, position: int, vocab_ids: torch.Tensor | None, vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model drafter's tokens [n] (the target's ids) for rows of logits [n, draft vocab]
    predicting positions position, position + 1, ...: the likeliest when decoding greedily; raced
    on the request's keyed draws (`PositionDraws.draw` of q ** RACE_POWER), coupled to the
    target's own draws there; else drawn from q, which is returned over the whole vocabulary
    for rejection sampling."""
    if ctx.params.greedy:
        return token_ids_of(greedy_ids(logits), vocab_ids), None
    q = probs_from_logits(logits, ctx.params)
    if ctx.draws is not None:
        raced = full_vocab_probs(q**RACE_POWER, vocab_ids, vocab_size)
        return torch.tensor([ctx.draws.draw(row, position + i) for i, row in enumerate(raced)],
                            dtype=torch.long, device=logits.device), None
    return token_ids_of(sample_ids(q, ctx.generator), vocab_ids), full_vocab_probs(q, vocab_ids, vocab_size)


class Drafter(Protocol):
    name: str
    needs_hidden_states: ClassVar[bool]
    # proposing costs next to nothing against a target step, so the router may score this
    # drafter counterfactually on every step, whichever drafter runs
    cheap: ClassVar[bool]

    def begin(self, ctx: DraftContext) -> Any:
        """Per-request state, created when the drafter is first used for a request."""
        ...

    def propose(self, state: Any, ctx: DraftContext, k: int) -> Draft: ...

    def commit(self, state: Any, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        """The step appended num_new tokens to ctx.token_ids; the first num_accepted are this
        drafter's own proposals, accepted by the target."""
        ...

    def end(self, state: Any) -> None:
        """Release per-request resources."""
        ...


@dataclass
class DraftRequest:
    """One request's part of a batched proposal: what `propose` would be called with."""

    state: Any
    ctx: DraftContext
    k: int


@runtime_checkable
class BatchDrafter(Protocol):
    """A drafter that proposes for several requests in one call, running its own network once
    for all of them (continuous batching asks it for every request that uses it in a step)."""

    name: str

    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Each request's draft, as `propose` would give it (sampled ones from the request's own
        generator, in the same order); the states advance as `propose` would advance them."""
        ...


@runtime_checkable
class LogitsReader(Protocol):
    """A drafter whose draft holds rows run for its own sake, not only to be verified (Lookahead
    decoding's Jacobi window): it reads the target's logits at its draft's nodes."""

    name: str

    def read_logits(self, state: Any, ctx: DraftContext, logits: torch.Tensor) -> None:
        """After verification of this drafter's draft: logits [1 + n, vocab] of the step's inputs,
        the root then the draft's nodes (n may be fewer than proposed: a tree cut to fit the
        token budget keeps its first n nodes). ctx.token_ids does not hold the step's tokens yet."""
        ...


@runtime_checkable
class TrafficLearner(Protocol):
    """A drafter that also learns from the requests a replica serves (suffix decoding)."""

    name: str

    def learn(self, ctx: DraftContext) -> None:
        """A request stopped (finished, cancelled or failed): `ctx` holds its prompt and output."""
        ...

    def memory(self) -> TrafficMemory:
        """What the drafter holds now: the replica reports it."""
        ...


@dataclass(frozen=True)
class TrafficMemory:
    tokens: dict[str, int]  # per domain
    max_tokens: int  # the budget over all domains
