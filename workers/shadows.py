"""Routing's own use of the cheap drafters on one request: tried first, and scored as shadows.

Proposing costs a cheap drafter (prompt lookup, suffix) next to nothing, so routing asks them
outside the step's plan. `first`: cheap drafters asked in turn before the step's drafter; the
first that proposes takes the step with its draft. Shadows: every cheap drafter the domain allows
proposes max_draft_len tokens on every step, whichever drafter runs, and its proposal is scored
against the tokens the target emits there (HedgeSpec's free full-information update). The engine
runs the step it is given (`StepOrder`); what the shadows scored is read after it (`scores`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from policies.controller import StepChoice
from workers.drafters.base import Draft
from workers.engine import Generation, StepOrder


@dataclass(frozen=True)
class ShadowScore:
    """A cheap drafter's proposal at `context_len`, scored against the tokens the target emitted
    there: the first `num_accepted` of its `num_proposed` tokens matched. Positions below `start`
    were really drafted (and recorded) by the step itself."""

    drafter: str
    context_len: int
    start: int
    num_proposed: int
    num_accepted: int


@dataclass
class _Pending:
    drafter: str
    context_len: int
    start: int
    token_ids: list[int]

    def resolve(self, tokens: list[int], final: bool) -> ShadowScore | None:
        """The score once the emitted tokens decide it (a mismatch, or every position known);
        at the end of the request, what is known (later positions are dropped, not guessed)."""
        known = tokens[self.context_len : self.context_len + len(self.token_ids)]
        matched = next((i for i, (a, b) in enumerate(zip(known, self.token_ids)) if a != b), None)
        if matched is not None:
            return ShadowScore(self.drafter, self.context_len, self.start, len(self.token_ids), matched)
        if len(known) == len(self.token_ids) or final:
            n = len(known)
            return ShadowScore(self.drafter, self.context_len, min(self.start, n), n, n)
        return None


class CheapDrafters:
    """One request's cheap drafters: `order` turns a step's choice into what the engine runs,
    asking the first tries and the shadows; `scores` after the step gives the shadows it decided."""

    def __init__(self, gen: Generation, shadow: Sequence[str]) -> None:
        self.gen = gen
        self.shadow = tuple(shadow)
        self._pending: list[_Pending] = []

    def order(self, choice: StepChoice) -> StepOrder:
        """The step for `choice`: the first of `choice.first` that proposes drafts it, else the
        choice's drafter. A shadow drafter that drafts is asked for max_draft_len tokens (what lies
        past its k is scored as a shadow); the shadows the step does not ask propose alongside."""
        gen = self.gen
        context_len = len(gen.ctx.token_ids)
        order = StepOrder(choice.drafter, choice.draft_len)
        asked: set[str] = set()
        t0 = time.perf_counter()
        for t in choice.first:
            if not (n := gen.clip(t.draft_len)):
                continue
            asked.add(t.drafter)
            lead = self._propose(t.drafter, n, context_len)
            if lead is not None and lead.token_ids.numel():
                order = StepOrder(t.drafter, n, lead)
                break
            if lead is not None and t.drafter in self.shadow:  # proposed nothing: a silent step of its own
                self._pending.append(_Pending(t.drafter, context_len, 0, []))
        if order.draft is None and order.drafter in self.shadow and (k := gen.clip(order.draft_len)):
            asked.add(order.drafter)
            order = StepOrder(order.drafter, k, self._propose(order.drafter, k, context_len))
        order = StepOrder(order.drafter, order.draft_len, order.draft, time.perf_counter() - t0)
        for name in self.shadow:  # the cheap drafters this step did not ask are scored all the same
            if name not in asked and (draft := gen.propose(name, gen.engine.config.max_draft_len)) is not None:
                self._pending.append(_Pending(name, context_len, 0, draft.token_ids.tolist()))
        return order

    def scores(self) -> tuple[ShadowScore, ...]:
        """The shadows the tokens emitted so far decide (all of them once the request finished)."""
        done: list[ShadowScore] = []
        undecided: list[_Pending] = []
        for pending in self._pending:
            score = pending.resolve(self.gen.ctx.token_ids, self.gen.finished)
            if score is None:
                undecided.append(pending)
            else:
                done.append(score)
        self._pending = undecided
        return tuple(done)

    def _propose(self, name: str, k: int, context_len: int) -> Draft | None:
        """`name`'s draft of up to k tokens (None: it failed). A shadow drafter is asked for
        max_draft_len: what lies past k is scored like a shadow."""
        if name not in self.shadow:
            return self.gen.propose(name, k)
        draft = self.gen.propose(name, self.gen.engine.config.max_draft_len)
        if draft is None or draft.tree is not None:
            return draft
        proposal = draft.token_ids.tolist()
        if len(proposal) > k:
            self._pending.append(_Pending(name, context_len, k, proposal))
        return Draft(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])
