"""The speculative decoding loop.

One step: the drafter proposes k tokens; the target runs one forward over [last token + draft];
verification keeps the agreed prefix plus one recovered or bonus token; the target's KV cache is
rolled back to the kept prefix; the drafter is told what was kept. Plain decoding is the same
step with k = 0. A drafter may propose a tree of candidates instead (workers/tree.py): the one
forward runs every node, verification follows the path the target takes, and the cache keeps
that path, moved to where a chain would have left it. A request is a `Generation`; its caller
chooses drafter and k before every step, so a policy can adapt them mid-request. A step is
`prepare` (the draft), one target forward, `complete` (verify, roll back, emit): alone in `step`,
or with every running request sharing the forward (workers/batch.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from workers.bans import Bans, ban
from workers.chat import with_tools_described
from workers.config import PLAIN, EngineConfig
from workers.drafters.base import (
    BatchDrafter,
    Draft,
    DraftContext,
    Drafter,
    DraftRequest,
    LogitsReader,
    TrafficLearner,
)
from workers.drafters.grammar import GrammarDrafter
from workers.drafters.prediction import PredictionDrafter
from workers.drafters.registry import build_drafters
from workers.drafters.remote import DraftService
from workers.logprobs import TokenText, token_logprobs
from workers.models.base import ForwardOutput, KVCache, SeqInput, release_freed_memory, synchronize
from workers.penalties import penalize
from workers.result import GenerationResult, PredictionTokens, RequestError, StepStats, TokenLogprobs
from workers.sampling import PositionDraws, SamplingParams, make_generator, probs_from_logits
from workers.structured import Grammars
from workers.target import LoadedModel, load_model
from workers.tree import DraftTree
from workers.verify import (
    VerifyResult,
    verify_drawn,
    verify_greedy,
    verify_sampled,
    verify_tree_greedy,
    verify_tree_sampled,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
PROMPT_LOGPROBS_CHUNK = 512  # prompt rows a scored prefill runs at once (their logits: 100 MB in float32)


@dataclass(frozen=True)
class StepOrder:
    """What one step runs: the drafter and k (PLAIN or k = 0: no draft). `draft`: that drafter's
    proposal for this step when the caller has asked for it already (`Generation.propose`, in
    `draft_s` seconds); otherwise the engine asks the drafter."""

    drafter: str = PLAIN
    draft_len: int = 0
    draft: Draft | None = None
    draft_s: float = 0.0


@dataclass
class PreparedStep:
    """A step's draft, ready for the target forward over `input_ids` ([last token + draft])."""

    drafter: str  # the drafter that proposed (PLAIN: none)
    draft_len: int  # k asked for, clipped
    draft_ids: torch.Tensor  # [k'] (a tree: its nodes)
    draft_probs: torch.Tensor | None
    tree: DraftTree | None
    input_ids: torch.Tensor  # [1 + k']
    start: int  # the cache length before the forward
    context_len: int
    fallback_reason: str | None
    draft_s: float


class Generation:
    """One request's decoding state. Created by `SpecEngine.start`, which runs the prefill."""

    def __init__(
        self,
        engine: SpecEngine,
        prompt_ids: list[int],
        params: SamplingParams,
        on_step: Callable[[StepStats], None] | None,
        *,
        prefill: bool = True,
        domain: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        """`prefill`: give the request a cache of its own and prefill the prompt now; else the
        scheduler (workers/batch.py) attaches a cache from its pool when it admits the request
        (`attach`) and prefills it in chunks (`prefill_input`, `complete_prefill`). `domain`: the
        request's routing domain, for drafters that learn from traffic (DraftContext.domain).
        `priority`: the scheduler's (lower first), where it schedules by priority. `cache_salt`:
        the requests it shares cached state with (DraftContext.cache_salt)."""
        self.engine = engine
        self.priority = priority
        self.params = params
        self.on_step = on_step
        self.model = engine.target.model
        self.device = self.model.device
        max_len = len(prompt_ids) + params.max_tokens
        self.stop_ids = engine.stop_token_ids(params)
        # the request's place in the grammar its output must match (workers/structured.py)
        fmt = params.output_format
        self.guide = None if fmt is None else engine.grammars.guide(fmt, self.stop_ids)
        self._bans = Bans.of(params, self.stop_ids, self.model.info.vocab_size, self.device) if params.bans else None
        self._stop_search_from: int | None = None  # where stop strings may start to count (min_tokens)
        # a seeded sampled request's draws keyed by position (PositionDraws), as configured
        self.draws = (PositionDraws(params.seed) if params.seed is not None and not params.greedy
                      and engine.config.seeded_draws == "position" else None)
        # a guided step masks a chain's rows (_guided), so its drafters draft chains
        self.ctx = DraftContext(list(prompt_ids), params, make_generator(params.seed, self.device), max_len,
                                num_prompt=len(prompt_ids), domain=domain, cache_salt=cache_salt,
                                exact_tree=self.guide is None, guide=self.guide, draws=self.draws)
        self.with_hidden = engine.needs_hidden_states
        if self.with_hidden:
            dtype = getattr(self.model, "dtype", torch.float32)
            self.ctx.features = torch.empty(max_len, self.model.info.hidden_size, dtype=dtype, device=self.device)
        self.cache: KVCache | None = self.model.new_cache(max_len) if prefill else None
        self._closed = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None  # the stop string or stop token id that ended the output
        self.text: str | None = None
        self.steps: list[StepStats] = []
        # each output token's logprobs, when the request asks (workers/logprobs.py)
        self.logprobs: list[TokenLogprobs] | None = [] if params.logprobs is not None else None
        # each prompt token's, when the request asks: the first has none, the prefill's rows give the rest
        self.prompt_logprobs: list[TokenLogprobs] | None = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [TokenLogprobs(engine.token_text.logprob(prompt_ids[0], None), ())]
        self._prompt_tokens: torch.Tensor | None = None  # the prompt's distinct tokens, for a repetition penalty
        self._drafter_states: dict[str, Any] = {}
        self._broken: set[str] = set()
        self._no_draft = torch.empty(0, dtype=torch.long, device=self.device)
        self.started_at = time.perf_counter()  # the request's start: its queueing and prefill count
        self.queue_s: float | None = None  # from its start to its first admission (attach)
        self.prefill_s = 0.0
        self.ttft_s: float | None = None
        self.num_prefilled = 0  # positions in the cache while prefilling; the last token runs in a step
        self.num_cached = 0  # of those, the ones found there (a reused prefix), not run
        # where prefilling ends: the prompt's last token, or a preempted request's last token
        self._prefill_end = len(prompt_ids) - 1
        self.num_preemptions = 0  # times the scheduler took its cache away to resume it later
        if prefill:
            self._prefill()

    # -- public -----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def attach(self, cache: KVCache, features: torch.Tensor | None = None) -> None:
        """The cache this request runs in, from the scheduler's pool; prefilled by chunks up to its
        last token (the prompt's, or a preempted request's). A cache that holds positions already
        holds the sequence's first tokens (a reused prefix, workers/prefix.py), with the target's
        hidden states there in `features` where drafters read them."""
        if self.cache is not None:
            raise RuntimeError("this generation has a cache already")
        if cache.capacity < self.ctx.max_len:
            raise ValueError(f"a cache of {cache.capacity} positions cannot hold {self.ctx.max_len}")
        end = len(self.ctx.token_ids) - 1
        if (cached := cache.length) > end:
            raise ValueError(f"a cache holding {cached} positions for a sequence of {end + 1}")
        if cached and self.ctx.features is not None:
            if features is None or features.shape[0] < cached:
                raise ValueError(f"the target's hidden states at the {cached} positions reused are missing")
            self.ctx.features[:cached] = features[:cached]
        self.cache = cache
        self._prefill_end = end
        self.num_prefilled = cached
        if not self.num_preemptions:  # the prompt's reuse, what usage reports; its first admission
            self.num_cached = cached
            self.queue_s = time.perf_counter() - self.started_at

    def detach_cache(self) -> KVCache | None:
        """Take the request's cache away (the scheduler frees its slot, keeping its prefix)."""
        cache, self.cache = self.cache, None
        return cache

    @property
    def num_prompt(self) -> int:
        return self.ctx.num_prompt

    @property
    def output_ids(self) -> list[int]:
        return self.ctx.token_ids[self.num_prompt :]

    @property
    def num_remaining(self) -> int:
        return self.ctx.max_len - len(self.ctx.token_ids)

    @property
    def num_to_prefill(self) -> int:
        """Tokens still to run before the next step: all but the last one of the prompt, or of a
        preempted request's sequence."""
        return self._prefill_end - self.num_prefilled

    def prefill_seq(self, input_ids: torch.Tensor) -> SeqInput:
        """The next prefill chunk (`prefill_input`) as a batched forward's input. Its rows return
        logits where the request scores its prompt; a preempted request's output, which its
        steps computed as scored rows, is run as scored rows again where prompt rows take other
        kernels (`prompt_rows_as_scored` False), so its keys and values are those it had, without
        the logits nobody reads."""
        assert self.cache is not None
        if self.prompt_logprobs is not None:
            return SeqInput(input_ids, self.cache, "all")
        resumed = self.num_prefilled >= self.num_prompt - 1
        return SeqInput(input_ids, self.cache, "none", scored=resumed and not self.model.prompt_rows_as_scored)

    def step(self, drafter: str = PLAIN, k: int = 0) -> StepStats:
        """One step of this request alone, drafting up to k tokens with `drafter`."""
        return self.run(StepOrder(drafter, k))

    def run(self, order: StepOrder) -> StepStats:
        """One step of this request alone: `prepare`, one target forward, `complete`."""
        prepared = self.prepare(order)
        t1 = time.perf_counter()
        out = self.model.forward(prepared.input_ids, self.cache, return_hidden=self.with_hidden, tree=prepared.tree)
        synchronize(self.device)
        return self.complete(prepared, out, time.perf_counter() - t1)

    def clip(self, k: int) -> int:
        """k within the token budget (the bonus token needs room) and the engine's bound."""
        return max(0, min(k, self.num_remaining - 1, self.engine.config.max_draft_len))

    def draft_request(self, drafter: str, k: int) -> DraftRequest | None:
        """What a batched proposal asks `drafter` for on this request (its state begun now if need
        be); None when the drafter failed on this request."""
        if drafter not in self._broken:
            self._guard(drafter, lambda impl, state: None)  # begins the state
        if drafter in self._broken:
            return None
        return DraftRequest(self._drafter_states[drafter], self.ctx, k)

    def drop(self, drafter: str) -> None:
        """`drafter` failed on this request: it is not asked again, and its state is released."""
        self._broken.add(drafter)
        state = self._drafter_states.pop(drafter, None)
        if state is not None:
            try:
                self.engine.drafters[drafter].end(state)
            except Exception:
                log.exception("drafter %r failed to release its state", drafter)

    def propose(self, drafter: str, k: int) -> Draft | None:
        """`drafter`'s proposal of up to k tokens at the current position; None when the drafter
        failed on this request (now or earlier: it is dropped for the rest of the request)."""
        if drafter not in self.engine.drafters:
            raise RequestError(f"unknown drafter {drafter!r}", "drafter")
        if drafter in self._broken:
            return None
        return self._guard(drafter, lambda impl, state: impl.propose(state, self.ctx, k))

    def prepare(self, order: StepOrder) -> PreparedStep:
        """The inputs of the step's target forward: the order's draft of up to k tokens (k clipped
        to the token budget; PLAIN or k = 0: none). A drafter that fails is dropped for the rest
        of the request and the step goes on plainly."""
        if self.finished:
            raise RuntimeError("step() on a finished generation")
        if self.cache is None or self.num_to_prefill:
            raise RuntimeError("step() before the prompt is prefilled")
        drafter, draft = order.drafter, order.draft
        if drafter != PLAIN and drafter not in self.engine.drafters:
            raise RequestError(f"unknown drafter {drafter!r}", "drafter")
        k = self.clip(order.draft_len)
        fallback = None
        if draft is None and drafter in self._broken:
            drafter, fallback = PLAIN, "drafter_error"
        if k == 0:
            drafter, draft = PLAIN, None
        t0 = time.perf_counter()
        if draft is None and drafter != PLAIN:
            draft = self.propose(drafter, k)
            if draft is None:
                drafter, fallback = PLAIN, "drafter_error"
        if draft is not None and draft.tree is None and draft.token_ids.shape[0] > k:
            draft = Draft(draft.token_ids[:k], None if draft.probs is None else draft.probs[:k])
        if draft is not None and self.guide is not None:
            draft = self._guided(draft)
        if draft is not None:  # a drafter on the target's GPU returns at launch too
            synchronize(self.device)
        draft_s = order.draft_s + time.perf_counter() - t0
        context_len = len(self.ctx.token_ids)
        draft_ids = draft.token_ids.to(self.device) if draft is not None else self._no_draft
        tree = draft.tree if draft is not None else None
        if tree is not None and len(tree) >= (room := self.cache.capacity - self.cache.length):
            tree, draft_ids = tree.prefix(room - 1), draft_ids[: room - 1]  # near max_tokens: what fits
        return PreparedStep(
            drafter=drafter, draft_len=k, draft_ids=draft_ids, draft_probs=draft.probs if draft is not None else None,
            tree=tree, input_ids=torch.cat([self._last_token(), draft_ids]), start=self.cache.length,
            context_len=context_len, fallback_reason=fallback, draft_s=draft_s,
        )

    def complete(self, prepared: PreparedStep, out: ForwardOutput, forward_s: float) -> StepStats:
        """Verify the prepared draft against the target's forward over it, roll the cache back to
        the kept tokens, emit them and let the drafter commit. `forward_s`: the forward's seconds
        (in a batch, the whole batch's)."""
        t1 = time.perf_counter()
        p, tree, context_len = prepared, prepared.tree, prepared.context_len
        result = self._verify(out.logits, p.draft_ids, p.draft_probs, tree)
        if tree is None:
            self.cache.truncate(p.start + 1 + result.num_accepted)  # keep [last + accepted]
            kept = slice(0, result.num_accepted + 1)
        else:  # keep [root + accepted path], moved together
            kept = [0, *(1 + i for i in result.path)]
            self.cache.keep(p.start, kept)
        if out.hidden is not None:  # the kept inputs' features: positions context_len - 1 onwards
            self.ctx.features[context_len - 1 : context_len + result.num_accepted] = out.hidden[kept]
        verify_s = forward_s + time.perf_counter() - t1

        drafter = p.drafter
        if drafter in self.engine.logits_readers and p.draft_ids.numel():
            self._guard(drafter, lambda impl, state: impl.read_logits(state, self.ctx, out.logits))
        num_emitted = self._emit(result.token_ids)
        if self.logprobs is not None and num_emitted:  # token i was chosen by kept row i
            rows = kept[:num_emitted] if isinstance(kept, list) else slice(0, num_emitted)
            self.logprobs += token_logprobs(out.logits[rows], result.token_ids[:num_emitted],
                                            self.params.logprobs or 0, self.engine.token_text)
        if drafter != PLAIN:
            self._guard(drafter, lambda impl, state: impl.commit(state, self.ctx, num_emitted, result.num_accepted))
        stats = StepStats(
            drafter=drafter, draft_len=p.draft_len,
            num_draft_tokens=tree.depth if tree is not None else int(p.draft_ids.shape[0]),
            num_accepted=result.num_accepted, num_emitted=num_emitted,
            num_tree_nodes=len(tree) if tree is not None else 0,
            draft_s=p.draft_s, verify_s=verify_s, context_len=context_len, fallback_reason=p.fallback_reason,
        )
        self._record(stats)
        return stats

    def prefill_input(self, max_tokens: int) -> torch.Tensor:
        """The next chunk of at most max_tokens tokens to prefill (scheduler-driven): the prompt's,
        then a resumed request's output, never both in one chunk."""
        a = self.num_prefilled
        end = self._prefill_end if a >= self.num_prompt - 1 else self.num_prompt - 1
        return torch.tensor(self.ctx.token_ids[a : a + min(max_tokens, end - a)], dtype=torch.long,
                            device=self.device)

    def complete_prefill(self, num_tokens: int, out: ForwardOutput, forward_s: float) -> None:
        """The chunk of `prefill_input` ran: its features are kept for the drafters that read them,
        its rows' logprobs for a request that scores its prompt."""
        if out.hidden is not None:
            self.ctx.features[self.num_prefilled : self.num_prefilled + num_tokens] = out.hidden
        self._score_prompt(self.num_prefilled, out)
        self.num_prefilled += num_tokens
        self.prefill_s += forward_s

    def close(self) -> None:
        """Release drafter state (also called when a generation is abandoned); drafters that
        learn from traffic see what the request produced."""
        if self._closed:
            return
        for learner in self.engine.learners:
            try:
                learner.learn(self.ctx)
            except Exception:
                log.exception("drafter %r failed to learn from a request", learner.name)
        for name, state in self._drafter_states.items():
            self.engine.drafters[name].end(state)
        self._drafter_states.clear()
        self.release_cache()
        self._closed = True

    def release_cache(self) -> None:
        """Give a pooled cache's slot back (the scheduler does once the request finishes)."""
        if (pool := getattr(self.cache, "pool", None)) is not None:
            pool.release(self.cache)
        self.cache = None

    def result(self) -> GenerationResult:
        drafted = [s for s in self.steps if s.num_draft_tokens]
        accepted = [0] * max((s.num_draft_tokens for s in drafted), default=0)
        proposed = accepted.copy()
        for s in drafted:
            for i in range(s.num_draft_tokens):
                proposed[i] += 1
                accepted[i] += i < s.num_accepted
        return GenerationResult(
            prompt_token_ids=self.ctx.token_ids[: self.num_prompt],
            token_ids=self.output_ids,
            text=self.text if self.text is not None else self._decode(),
            finish_reason=self.finish_reason or "length",
            stop_reason=self.stop_reason,
            num_steps=len(self.steps),
            num_draft_tokens=sum(s.num_draft_tokens for s in self.steps),
            num_accepted_tokens=sum(s.num_accepted for s in self.steps),
            accepted_per_position=accepted,
            drafted_per_position=proposed,
            drafters=list(dict.fromkeys(s.drafter for s in drafted)),
            prefill_s=self.prefill_s,
            wall_s=time.perf_counter() - self.started_at,
            ttft_s=self.ttft_s if self.ttft_s is not None else time.perf_counter() - self.started_at,
            steps=self.steps,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            prompt_logprobs=list(self.prompt_logprobs) if self.prompt_logprobs is not None else None,
            prediction=self._prediction_tokens() if self.params.prediction else None,
            num_cached_tokens=self.num_cached,
        )

    def _prediction_tokens(self) -> PredictionTokens:
        drafted = [s for s in self.steps if s.drafter in self.engine.prediction_drafters]
        accepted = sum(s.num_accepted for s in drafted)
        return PredictionTokens(accepted, sum(s.num_draft_tokens for s in drafted) - accepted)

    # -- internals --------------------------------------------------------------------------
    def _prefill(self) -> None:
        t0 = time.perf_counter()
        prompt = torch.tensor(self.ctx.token_ids[:-1], dtype=torch.long, device=self.device)
        # scored prompts keep every row's logits: in chunks, so they never hold [prompt, vocab] at once
        chunk = PROMPT_LOGPROBS_CHUNK if self.prompt_logprobs is not None else max(1, prompt.numel())
        for a in range(0, prompt.numel(), chunk):
            out = self.model.forward(prompt[a : a + chunk], self.cache, last_only=self.prompt_logprobs is None,
                                     return_hidden=self.with_hidden)
            self._score_prompt(a, out)
            if out.hidden is not None:
                self.ctx.features[a : a + out.hidden.shape[0]] = out.hidden
        # the last prompt token goes through the ordinary step path: identical numerics to
        # every later step, and the first generated token comes out of `step` like all others
        self.num_prefilled = prompt.numel()
        synchronize(self.device)
        self.prefill_s = time.perf_counter() - t0

    def _score_prompt(self, start: int, out: ForwardOutput) -> None:
        """The prompt logprobs of a prefill chunk from `start`: row i scores prompt token start + i + 1."""
        if self.prompt_logprobs is not None:
            n = out.logits.shape[0]
            self.prompt_logprobs += token_logprobs(out.logits, self.ctx.token_ids[start + 1 : start + 1 + n],
                                                   self.params.prompt_logprobs or 0, self.engine.token_text)

    def _last_token(self) -> torch.Tensor:
        return torch.tensor(self.ctx.token_ids[-1:], dtype=torch.long, device=self.device)

    def _guard(self, drafter: str, call: Callable[[Drafter, Any], T]) -> T | None:
        """Run a drafter call on this request's state; a drafter must never fail the request,
        so an exception drops it for the rest of the request and returns None."""
        impl = self.engine.drafters[drafter]
        try:
            if drafter not in self._drafter_states:
                self._drafter_states[drafter] = impl.begin(self.ctx)
            return call(impl, self._drafter_states[drafter])
        except Exception:
            log.exception("drafter %r failed; this request continues without it", drafter)
            self.drop(drafter)
            return None

    def _guided(self, draft: Draft) -> Draft:
        """The draft a guided step verifies: a tree's leading chain (its rows are masked along one
        path), cut after the tokens the grammar allows. A sampled draft keeps its first forbidden
        token: its certain rejection draws the next token from the residual its probabilities leave."""
        ids, probs = draft.token_ids, draft.probs
        if draft.tree is not None:
            ids, probs = ids[: draft.tree.leading_chain], None
        keep = self.guide.valid_prefix(ids.tolist())
        if probs is not None:
            keep = min(keep + 1, ids.shape[0])
        return Draft(ids[:keep], None if probs is None else probs[:keep])

    def _verify(
        self, logits: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None, tree: DraftTree | None,
    ) -> VerifyResult:
        if self.params.penalized or self._bans is not None:
            # row r's history: the output and the draft tokens on its path
            sees = (tree or DraftTree.chain(draft_ids.shape[0])).input_mask(logits.device)[:, 1:]
            if self.params.penalized:
                logits = self._penalized(logits, draft_ids, sees)
            if self._bans is not None:
                logits = ban(logits, self._bans, self.output_ids, draft_ids, sees)
        if self.guide is not None:  # a chain (`_guided`): row r masked after the first r draft tokens
            allowed = torch.from_numpy(self.guide.masks(draft_ids.tolist())).to(logits.device)
            logits = logits.float().masked_fill(~allowed, float("-inf"))
        if self.params.greedy:
            return verify_greedy(logits, draft_ids) if tree is None else verify_tree_greedy(logits, draft_ids, tree)
        probs = probs_from_logits(logits, self.params)
        if self.draws is not None:  # the rows predict positions len(token_ids) onwards, one per depth
            return verify_drawn(probs, draft_ids, self.draws, len(self.ctx.token_ids), tree)
        if tree is not None:
            return verify_tree_sampled(probs, draft_ids, tree, self.ctx.generator)
        return verify_sampled(probs, draft_ids, draft_probs, self.ctx.generator)

    def _penalized(self, logits: torch.Tensor, draft_ids: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """The step's rows biased and penalised, each by the history on its own path."""
        if self.params.repetition_penalty != 1.0 and self._prompt_tokens is None:
            self._prompt_tokens = torch.tensor(sorted(set(self.ctx.token_ids[: self.num_prompt])), device=logits.device)
        return penalize(logits, self.params, self.output_ids, draft_ids, sees, self._prompt_tokens)

    def _emit(self, token_ids: list[int]) -> int:
        """Append tokens one by one, stopping where plain decoding would have stopped."""
        for n, token in enumerate(token_ids, start=1):
            self.ctx.token_ids.append(token)
            if self.guide is not None:
                self.guide.advance(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
                self.stop_reason = token if token in self.params.extra_stop_token_ids else None  # EOS: None
            elif self.params.stop and (found := self._stop_string()) is not None:
                self.finish_reason, (self.text, self.stop_reason) = "stop", found
            elif self.guide is not None and self.guide.done:
                self.finish_reason = "stop"  # a complete grammar ends the output: no forward for its end token
            elif self.num_remaining == 0:
                self.finish_reason = "length"
            if self.finished:
                return n
        return len(token_ids)

    def _stop_string(self) -> tuple[str, str] | None:
        """The output text cut at the first stop string (before it, or after it where the request
        keeps it) and that string, or None when none occurs yet. As in vLLM, stop strings count
        once the output is longer than min_tokens, and only those that end past its first
        min_tokens tokens."""
        params = self.params
        if len(self.output_ids) <= params.min_tokens:
            return None
        if self._stop_search_from is None:
            self._stop_search_from = len(self._decode(self.output_ids[: params.min_tokens])) if params.min_tokens else 0
        text, start = self._decode(), self._stop_search_from
        hits = [(i, len(s), s) for s in params.stop if (i := text.find(s, max(0, start - len(s) + 1))) >= 0]
        if not hits:
            return None
        i, n, stop = min(hits)
        return (text[: i + n] if params.include_stop_str_in_output else text[:i]), stop

    def _decode(self, token_ids: list[int] | None = None) -> str:
        """The output's text (or token_ids'), special tokens left out unless the request keeps them."""
        return self.engine.target.tokenizer.decode(self.output_ids if token_ids is None else token_ids,
                                                   skip_special_tokens=self.params.skip_special_tokens)

    def _record(self, stats: StepStats) -> None:
        if not self.steps:
            self.ttft_s = time.perf_counter() - self.started_at
        self.steps.append(stats)
        if self.on_step is not None:
            self.on_step(stats)


def context_limit(configured: int | None, max_position: int, kv_cache_tokens: int | None) -> int:
    """The longest prompt + output a request may ask for: the configured limit (default: the
    model's positions), never past the model's positions nor what the KV memory holds."""
    limit = max_position if configured is None else configured
    bounds = {"the model's positions": max_position, "scheduler.kv_cache_gib": kv_cache_tokens}
    for what, bound in bounds.items():
        if bound is not None and limit > bound:
            if configured is not None:
                log.warning("max_model_len %d exceeds %s (%d): serving %d", configured, what, bound, bound)
            limit = bound
    return limit


class SpecEngine:
    def __init__(self, target: LoadedModel, drafters: dict[str, Drafter], config: EngineConfig) -> None:
        self.target = target
        self.drafters = drafters
        self.config = config
        info = target.model.info
        # the KV memory every running request shares, in positions (None: the model does not say)
        self.kv_cache_tokens = (int(config.scheduler.kv_cache_gib * 2**30) // info.kv_bytes_per_token
                                if info.kv_bytes_per_token else None)
        self.max_model_len = context_limit(config.target.max_model_len, info.max_position, self.kv_cache_tokens)
        # the target's hidden states are kept per request only when some drafter reads them
        self.needs_hidden_states = any(d.needs_hidden_states for d in drafters.values())
        self.learners = [d for d in drafters.values() if isinstance(d, TrafficLearner)]
        self.logits_readers = {name for name, d in drafters.items() if isinstance(d, LogitsReader)}
        # looked up per request and step (isinstance against a Protocol costs ~8 us)
        self.batch_drafters = {name for name, d in drafters.items() if isinstance(d, BatchDrafter)}
        self.prediction_drafters = {name for name, d in drafters.items() if isinstance(d, PredictionDrafter)}
        self.grammar_drafters = {name for name, d in drafters.items() if isinstance(d, GrammarDrafter)}

    @classmethod
    def from_config(cls, config: EngineConfig, services: Mapping[str, DraftService] | None = None) -> SpecEngine:
        """`services`: drafters served by their own deployments, by name (workers/drafters/remote.py)."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        target = load_model(config.target)
        drafters = build_drafters(config.drafters, target, services, config.scheduler.max_num_seqs,
                                  config.target.max_model_len)
        release_freed_memory()  # the loading's temporaries
        return cls(target, drafters, config)

    def with_scheduler(self, **settings: Any) -> SpecEngine:
        """This engine, its target and drafters shared, with these `SchedulerConfig` settings (no
        more `max_num_seqs` than the drafters were built for)."""
        scheduler = self.config.scheduler.model_copy(update=settings)
        return SpecEngine(self.target, self.drafters, self.config.model_copy(update={"scheduler": scheduler}))

    @property
    def tokenizer(self) -> Any:
        return self.target.tokenizer

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured outputs' matchers for this tokenizer (built on the first request that asks)."""
        info = self.target.model.info
        return Grammars(self.target.tokenizer, info.vocab_size, info.eos_token_ids)

    @functools.cached_property
    def token_text(self) -> TokenText:
        """Tokens' text and bytes, for the logprobs requests ask for."""
        return TokenText(self.target.tokenizer)

    def encode(self, prompt: str | list[dict[str, Any]], *, chat: bool = True,
               tools: list[dict[str, Any]] | None = None, generation_prompt: bool = True,
               continue_final_message: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a prompt; a string is wrapped as one user message when chat is True. `tools`:
        OpenAI's tool definitions, rendered by the chat template, or where it does not render them,
        listed in the system message (workers/chat.py). `generation_prompt`: the template opens the
        assistant's message; `continue_final_message`: the last message is left open, its end
        token and what follows cut (transformers' options); `template_kwargs`: more variables for
        the template (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`)."""
        tok = self.target.tokenizer
        if isinstance(prompt, list) or (chat and tok.chat_template):
            messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]

            def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[int]:
                return list(tok.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=generation_prompt,
                    continue_final_message=continue_final_message, tokenize=True, return_dict=False,
                    **(template_kwargs or {})))

            ids = render(messages, tools)
            if tools and ids == render(messages, None):
                ids = render(with_tools_described(messages, tools, self.config.target.tool_call_parser), None)
            return ids
        return tok.encode(prompt)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a bare text, without special tokens (a predicted output)."""
        return self.target.tokenizer.encode(text, add_special_tokens=False)

    def bad_word_ids(self, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
        """Bad words' token sequences, as vLLM bans them: each word at the start of a text and
        after a space (workers/bans.py)."""
        spellings = (self.encode_text(w) for word in words for w in (word.lstrip(), " " + word.lstrip()))
        return tuple(dict.fromkeys(tuple(ids) for ids in spellings if ids))

    def default_draft_len(self, drafter: str) -> int:
        return 0 if drafter == PLAIN else getattr(self.drafters[drafter].config, "draft_len", 0)

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        """Refuse token ids outside the vocabulary, naming the request field that carried them."""
        vocab_size = self.target.model.info.vocab_size
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise RequestError(f"{param}: token id {bad} is not in the vocabulary of {vocab_size} tokens", param)

    def stop_token_ids(self, params: SamplingParams) -> set[int]:
        """The tokens that end a request's output: end of sequence (unless ignored) and its own."""
        ids = set() if params.ignore_eos else set(self.target.model.info.eos_token_ids)
        return ids | params.extra_stop_token_ids

    def check_request(self, prompt_ids: list[int], params: SamplingParams, drafter: str = PLAIN) -> None:
        if not prompt_ids:
            raise RequestError("prompt is empty", "prompt")
        if drafter != PLAIN and drafter not in self.drafters:
            known = ", ".join([PLAIN, *self.drafters]) or PLAIN
            raise RequestError(f"unknown drafter {drafter!r}; configured: {known}", "drafter")
        self.check_token_ids(list(params.logit_bias), "logit_bias")
        self.check_token_ids(sorted(params.extra_stop_token_ids), "stop_token_ids")
        self.check_token_ids([t for word in params.bad_words for t in word], "bad_words")
        if params.allowed_token_ids is not None:
            self.check_token_ids(sorted(params.allowed_token_ids), "allowed_token_ids")
            # a token no bad word ends and no min_tokens holds back: no row is left without a token
            takeable = params.allowed_token_ids - {word[-1] for word in params.bad_words}
            if params.min_tokens:
                takeable -= self.stop_token_ids(params)
            if not takeable:
                raise RequestError("allowed_token_ids: every allowed token may be banned (it ends a bad word, or "
                                   "is a stop token before min_tokens)", "allowed_token_ids")
        self.check_token_ids(prompt_ids, "prompt")
        if params.prediction:
            if len(params.prediction) > self.max_model_len:
                raise RequestError(f"prediction: {len(params.prediction)} tokens, more than this model's maximum "
                                   f"context length of {self.max_model_len}", "prediction")
            self.check_token_ids(params.prediction, "prediction")
        if params.output_format is not None:
            for name in ("allowed_token_ids", "bad_words"):
                if getattr(params, name):
                    raise RequestError(f"{name} cannot be combined with a response format or tool calls: the "
                                       "grammar may need a token it bans", name)
            try:
                self.grammars.check(params.output_format)
            except ValueError as e:
                raise RequestError(f"response_format: {e}", "response_format") from None
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise RequestError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{len(prompt_ids)} prompt tokens + max_tokens {params.max_tokens} were requested",
                "prompt", "context_length_exceeded",
            )

    def start(
        self, prompt_ids: list[int], params: SamplingParams,
        on_step: Callable[[StepStats], None] | None = None, domain: str | None = None,
        cache_salt: str | None = None,
    ) -> Generation:
        """`domain`: the request's routing domain (DraftContext.domain); `cache_salt`: what it
        shares (DraftContext.cache_salt)."""
        self.check_request(prompt_ids, params)
        return Generation(self, prompt_ids, params, on_step, domain=domain, cache_salt=cache_salt)

    def stream(
        self, prompt_ids: list[int], params: SamplingParams, drafter: str = PLAIN,
        draft_len: int | None = None, on_step: Callable[[StepStats], None] | None = None, domain: str | None = None,
    ) -> Iterator[tuple[Generation, StepStats]]:
        """Run a request with a fixed drafter and k, yielding after every step."""
        self.check_request(prompt_ids, params, drafter)
        k = self.default_draft_len(drafter) if draft_len is None else draft_len
        gen = Generation(self, prompt_ids, params, on_step, domain=domain)
        try:
            while not gen.finished:
                yield gen, gen.step(drafter, k)
        finally:
            gen.close()

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, drafter: str = PLAIN,
        draft_len: int | None = None, on_step: Callable[[StepStats], None] | None = None, domain: str | None = None,
    ) -> GenerationResult:
        # run to the end, keeping only the last (generation, step): max_tokens >= 1, so one exists
        (gen, _), = deque(self.stream(prompt_ids, params, drafter, draft_len, on_step, domain), maxlen=1)
        return gen.result()
