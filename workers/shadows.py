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
        choice's drafter; a later try whose draft repeats the leading draft and goes on past it
        drafts instead (the same tokens first, more after). A shadow drafter that drafts is asked
        for max_draft_len tokens (what lies past its k is scored as a shadow); the shadows the step
        does not run propose alongside."""
        gen = self.gen
        context_len = len(gen.ctx.token_ids)
        order = StepOrder(choice.drafter, choice.draft_len)
        asked: dict[str, tuple[int, Draft | None, list[int]]] = {}  # name -> (k, draft, whole proposal)
        lead: str | None = None
        t0 = time.perf_counter()
        for t in choice.first:
            if not (n := gen.clip(t.draft_len)):
                continue
            draft, proposal = self._ask(t.drafter, n)
            asked[t.drafter] = (n, draft, proposal)
            if draft is None or not draft.token_ids.numel():
                continue
            if lead is None or _extends(draft, asked[lead][1]):
                lead = t.drafter
        if lead is not None:
            n, draft, _ = asked[lead]
            order = StepOrder(lead, n, draft)
        elif choice.drafter in self.shadow and (k := gen.clip(choice.draft_len)):
            draft, proposal = self._ask(choice.drafter, k)
            asked[choice.drafter] = (k, draft, proposal)
            order = StepOrder(choice.drafter, k, draft)
        order = StepOrder(order.drafter, order.draft_len, order.draft, time.perf_counter() - t0)
        for name, (k, draft, proposal) in asked.items():  # what each asked shadow said beside the step
            if name not in self.shadow or draft is None or draft.tree is not None:
                continue
            if name != order.drafter:  # proposed nothing (a silent step of its own) or did not run
                self._pending.append(_Pending(name, context_len, 0, proposal))
            elif len(proposal) > k:  # the step recorded its first k
                self._pending.append(_Pending(name, context_len, k, proposal))
        for name in self.shadow:  # the cheap drafters this step did not ask are scored all the same
            if name not in asked and (draft := gen.propose(name, gen.engine.config.max_draft_len)) is not None:
                self._pending.append(_Pending(name, context_len, 0, draft.scored_ids))
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

    def _ask(self, name: str, k: int) -> tuple[Draft | None, list[int]]:
        """`name`'s draft of up to k tokens (None: it failed) and its whole proposal: a shadow
        drafter is asked for max_draft_len, and what lies past k is scored like a shadow."""
        if name not in self.shadow:
            draft = self.gen.propose(name, k)
            return draft, [] if draft is None or draft.tree is not None else draft.scored_ids
        draft = self.gen.propose(name, self.gen.engine.config.max_draft_len)
        if draft is None or draft.tree is not None:
            return draft, []
        return Draft(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k],
                     likeliest=draft.likeliest), draft.scored_ids


def _extends(draft: Draft, lead: Draft | None) -> bool:
    """`draft` is a chain that repeats `lead`'s tokens and goes on past them."""
    if lead is None or draft.tree is not None or lead.tree is not None:
        return False
    n = lead.token_ids.shape[0]
    return draft.token_ids.shape[0] > n and bool((draft.token_ids[:n] == lead.token_ids).all())
