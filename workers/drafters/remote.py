"""A drafter that runs elsewhere: `RemoteDrafter` is the target side, `DraftSessions` the side
that holds the real drafter (a Serve deployment, workers/deployment.py `DrafterWorker`).

One round trip per step: a `draft` call carries the request's token ids, the previous step's
commit and k, and returns the proposal (with its probabilities when sampling, so rejection
sampling stays exact). The engine times `propose` like any drafter's, so the round trip is part of
the draft cost the router prices. Sessions are keyed by an id the target side draws; a drafter
replica that does not hold a session, or holds one that disagrees with the token ids sent (another
replica served it before, or it was evicted), starts it again from the ids: state is a cache,
never the truth, so any replica can serve any call.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch

from workers.drafters.base import Draft, DraftContext, Drafter
from workers.sampling import PositionDraws, SamplingParams
from workers.tree import DraftTree

MAX_SESSIONS = 1024  # per drafter replica; a session whose `end` was lost is evicted, oldest first


@dataclass(frozen=True)
class DraftCall:
    """One step's request to the drafter replica."""

    session: str
    token_ids: list[int]  # the request's prompt + generated tokens so far
    k: int
    params: SamplingParams
    max_len: int
    vocab_size: int  # the target's: a drafter replica of another vocabulary refuses the call
    seq: int  # draft calls of this session before this one
    commit: tuple[int, int] | None = None  # (num_new, num_accepted) of the previous call's step
    exact_tree: bool = True  # DraftContext.exact_tree of the request
    keyed_draws: bool = False  # the request's draws are keyed by position (DraftContext.draws, from params.seed)


@dataclass(frozen=True)
class DraftReply:
    token_ids: list[int]
    probs: torch.Tensor | None  # [k', vocab] on the CPU; None for a deterministic (greedy) proposal
    restarted: bool  # the replica had to start the session from the token ids
    parents: tuple[int, ...] | None = None  # a draft tree's shape (workers/tree.py); None: a chain


class DraftService(Protocol):
    """What RemoteDrafter calls: a blocking `draft` and a best-effort `end`."""

    def draft(self, call: DraftCall) -> DraftReply: ...

    def end(self, session: str) -> None: ...


@dataclass
class RemoteState:
    session: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    commit: tuple[int, int] | None = None


class RemoteDrafter:
    """The target replica's side: the Drafter protocol over a DraftService."""

    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = False

    def __init__(self, config: Any, service: DraftService, vocab_size: int) -> None:
        self.config = config
        self.name = config.name
        self.service = service
        self.vocab_size = vocab_size

    def begin(self, ctx: DraftContext) -> RemoteState:
        return RemoteState()

    def propose(self, state: RemoteState, ctx: DraftContext, k: int) -> Draft:
        reply = self.service.draft(DraftCall(state.session, list(ctx.token_ids), k, ctx.params, ctx.max_len,
                                             self.vocab_size, state.seq, state.commit, ctx.exact_tree,
                                             ctx.draws is not None))
        state.seq += 1
        state.commit = None
        ids = torch.tensor(reply.token_ids, dtype=torch.long)
        return Draft(ids, reply.probs, None if reply.parents is None else DraftTree(reply.parents))

    def commit(self, state: RemoteState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        state.commit = (num_new, num_accepted)  # travels with the next draft call

    def end(self, state: RemoteState) -> None:
        self.service.end(state.session)


@dataclass
class _Session:
    state: Any
    ctx: DraftContext
    seq: int  # the seq of the last call this replica served


class DraftSessions:
    """The drafter replica's side: per-request state of a local drafter, by session id."""

    def __init__(self, drafter: Drafter, max_sessions: int = MAX_SESSIONS) -> None:
        self.drafter = drafter
        self.max_sessions = max_sessions
        self.sessions: OrderedDict[str, _Session] = OrderedDict()
        self.num_restarts = 0

    def draft(self, call: DraftCall) -> DraftReply:
        session = self.sessions.get(call.session)
        # the state here continues the caller's only if this replica served its previous call
        # (the commit is about that call's proposal) and the tokens it knew are still the prefix
        continues = session is not None and session.seq == call.seq - 1 and \
            call.token_ids[: len(session.ctx.token_ids)] == session.ctx.token_ids
        if not continues:
            if session is not None:
                self.num_restarts += 1
                self.drafter.end(session.state)
            elif call.seq > 0:
                self.num_restarts += 1
            session = self._start(call)
        elif call.commit is not None:
            self.drafter.commit(session.state, session.ctx, *call.commit)
        session.ctx.token_ids[:] = call.token_ids
        session.seq = call.seq
        self.sessions.move_to_end(call.session)
        draft = self.drafter.propose(session.state, session.ctx, call.k)
        probs = None if draft.probs is None else draft.probs.float().cpu()
        return DraftReply(draft.token_ids.cpu().tolist(), probs, restarted=not continues and call.seq > 0,
                          parents=None if draft.tree is None else draft.tree.parents)

    def end(self, session_id: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is not None:
            self.drafter.end(session.state)

    def _start(self, call: DraftCall) -> _Session:
        generator = torch.Generator()
        if call.params.seed is not None:
            generator.manual_seed(call.params.seed)
        else:
            generator.seed()
        draws = PositionDraws(call.params.seed) if call.keyed_draws and call.params.seed is not None else None
        ctx = DraftContext(list(call.token_ids), call.params, generator, call.max_len, exact_tree=call.exact_tree,
                           draws=draws)
        session = _Session(self.drafter.begin(ctx), ctx, call.seq)
        self.sessions[call.session] = session
        while len(self.sessions) > self.max_sessions:
            _, old = self.sessions.popitem(last=False)
            self.drafter.end(old.state)
        return session
