"""Continuous batching: every running request advances in one target forward per step.

A `BatchEngine` keeps two queues, as vLLM's scheduler does. `waiting` requests hold no memory;
a request is admitted to `running`, first come first served (or by priority, `scheduler.policy`),
when a KV slot of the pool is free (`max_num_seqs` slots) and the KV memory (`kv_cache_gib`) holds
its prompt + max_tokens positions besides what the running requests hold: a long request waits for
room, it never fails for it. Under the priority policy a request that finds no room preempts
running requests of lower priority: they give their slot back and wait again, keeping their
output, and resume where they were by prefilling their sequence again (vLLM's recompute
preemption; with prefix caching their slot keeps what it may, so little is recomputed).
Each step then:
  1. every running request that has its prompt in the cache prepares its step (its drafter
     proposes [last token + draft], k = 0 for plain decoding), each with its own drafter and k;
     a drafter that can (`BatchDrafter`: the small model, EAGLE, Medusa) proposes for all the
     requests using it in one call, its own network run once for them;
  2. requests still prefilling get prompt chunks from what is left of the step's token budget
     (`max_num_batched_tokens`; in admission order, or by priority under the priority policy), so
     a long prompt is spread over several steps instead of stalling everyone else's next token;
  3. one target forward (`forward_batch`) runs every row; verification, KV rollback, emission
     and the drafters' commits then run per request (`Generation.complete`).
Finished requests leave `running` and give their slot back at once; their owner reads their
result and closes them. With prefix caching (workers/prefix.py) a finished request's slot keeps
its sequence, and an admitted request starts with the longest prefix of its prompt the pool
holds, prefilling only the rest; one whose prompt starts like a running request's that is still
being prefilled waits for that prefix instead of prefilling it too.

What each request drafts is the caller's choice, made per step (`orders`): the router's goodput
rule lives in workers/routing.py and policies/batching.py, not here.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from workers.drafters.base import BatchDrafter
from workers.engine import Generation, PreparedStep, SpecEngine, StepOrder, StepStats
from workers.models.base import BatchedLM, ForwardOutput, SeqInput, forward_rows, synchronize
from workers.prefix import WAIT_FOR_PREFIX_TOKENS, LiveSequence, PrefixCache, common_prefix_len
from workers.result import RequestError
from workers.sampling import SamplingParams

log = logging.getLogger(__name__)
PLAIN_STEP = StepOrder()


def _rank(gen: Generation) -> tuple[int, float]:
    """A request's place under the priority policy: its priority (lower first), then its arrival."""
    return gen.priority, gen.started_at


@dataclass
class BatchStep:
    """What one step ran."""

    stats: list[tuple[Generation, StepStats]] = field(default_factory=list)  # the requests that decoded
    prefilled: list[tuple[Generation, int]] = field(default_factory=list)  # prompt tokens run per request
    failed: list[tuple[Generation, Exception]] = field(default_factory=list)  # removed from running
    num_rows: int = 0  # target rows in the forward
    forward_s: float = 0.0

    @property
    def batch_size(self) -> int:
        """Requests in the forward (decoding or prefilling)."""
        return len(self.stats) + len(self.prefilled)


class BatchEngine:
    def __init__(self, engine: SpecEngine) -> None:
        self.engine = engine
        self.config = engine.config.scheduler
        model = engine.target.model
        # a model without a pooled, batched forward (the transformers backend) runs each request's
        # rows in its own forward, still one step for all
        self.kv_cache_tokens = engine.kv_cache_tokens
        num_slots = self.config.max_num_seqs
        if self.kv_cache_tokens is not None and model.device.type != "cpu":
            # an accelerator's pool is allocated whole (a CPU's is mapped as it is written)
            num_slots = max(1, min(num_slots, self.kv_cache_tokens // engine.max_model_len))
        self.pool = model.new_pool(num_slots, engine.max_model_len) if isinstance(model, BatchedLM) else None
        caching = self.config.enable_prefix_caching
        if caching is None:  # reuse changes no output where the target scores rows alike however computed
            caching = model.batch_invariant
        if caching and self.pool is None:
            log.warning("enable_prefix_caching: this target runs without a KV pool (backend 'hf'); no prefix caching")
        self.prefix = PrefixCache(self.pool) if caching and self.pool is not None else None
        self.waiting: deque[Generation] = deque()  # in admission order
        self.running: list[Generation] = []
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def num_reserved_tokens(self) -> int:
        """KV positions the running requests hold: prompt + max_tokens each."""
        return sum(g.ctx.max_len for g in self.running)

    def add(self, prompt_ids: list[int], params: SamplingParams,
            on_step: Callable[[StepStats], None] | None = None, domain: str | None = None,
            priority: int = 0, cache_salt: str | None = None) -> Generation:
        """Queue a request (checked now: a bad one raises RequestError); it starts when admitted.
        `domain`: its routing domain (see DraftContext.domain); `priority`: lower goes first,
        under the priority policy; `cache_salt`: what it may share (DraftContext.cache_salt)."""
        self.engine.check_request(prompt_ids, params)
        if priority and self.config.policy != "priority":
            raise RequestError(f"priority {priority}: this server schedules first come first served "
                               "(scheduler.policy: priority takes priorities)", "priority")
        gen = Generation(self.engine, prompt_ids, params, on_step, prefill=False, domain=domain, priority=priority,
                         cache_salt=cache_salt)
        self._enqueue(gen)
        return gen

    def remove(self, gen: Generation) -> None:
        """Take a request out of the queues (cancelled) and free its slot, which keeps what it
        computed for prefix caching; its owner closes it."""
        if gen in self.running:
            self.running.remove(gen)
            self._release(gen)
            return
        if gen in self.waiting:
            self.waiting.remove(gen)
        gen.release_cache()  # a failed request's cache is not trusted

    def schedule(self) -> list[Generation]:
        """Admit what fits; the running requests whose next step decodes (their prompt is in the
        cache): the ones the next `step` takes orders for."""
        self._admit()
        return [g for g in self.running if not g.num_to_prefill]

    def num_prefill_rows(self, num_decode_rows: int) -> int:
        """Prompt tokens the next step would prefill after `num_decode_rows` rows of decoding."""
        pending = sum(g.num_to_prefill for g in self.running)
        return min(pending, max(0, self.config.max_num_batched_tokens - num_decode_rows))

    def step(self, orders: Mapping[Generation, StepOrder] | None = None) -> BatchStep:
        """One step of every running request (admitted by `schedule`); `orders` says what each
        decoding one runs (missing: a plain step)."""
        out = BatchStep()
        prepared: list[tuple[Generation, PreparedStep]] = []
        decoding = [g for g in self.running if not g.num_to_prefill]
        orders = self._draft_in_batch(decoding, orders or {})
        for gen in decoding:
            try:
                prepared.append((gen, gen.prepare(orders.get(gen, PLAIN_STEP))))
            except Exception as e:  # a bug or a bad order: this request fails, the batch goes on
                log.exception("preparing a step failed")
                self._fail(out, gen, e)
        budget = self.config.max_num_batched_tokens - sum(p.input_ids.shape[0] for _, p in prepared)
        chunks: list[tuple[Generation, int]] = []
        inputs = [SeqInput(p.input_ids, gen.cache, "all", p.tree) for gen, p in prepared]
        for gen in self._prefilling():
            if budget <= 0:
                break
            ids = gen.prefill_input(budget)
            budget -= ids.shape[0]
            chunks.append((gen, ids.shape[0]))
            inputs.append(gen.prefill_seq(ids))
        if not inputs:
            return out
        t0 = time.perf_counter()
        try:
            results = self._forward(inputs)
            # the step's seconds price the next steps (the goodput rule): the work's, not its launch's
            synchronize(self.engine.target.model.device)
        except Exception as e:  # the forward is shared: every request in it fails
            log.exception("batched forward failed")
            for gen in [g for g, _ in prepared] + [g for g, _ in chunks]:
                self._fail(out, gen, e)
            return out
        out.forward_s, out.num_rows = time.perf_counter() - t0, sum(s.input_ids.shape[0] for s in inputs)
        for (gen, p), result in zip(prepared, results):
            try:
                out.stats.append((gen, gen.complete(p, result, out.forward_s)))
            except Exception as e:
                log.exception("completing a step failed")
                self._fail(out, gen, e)
                continue
            if gen.finished:
                self.running.remove(gen)
                self._release(gen)  # its slot serves a waiting request from the next step on
        for (gen, n), result in zip(chunks, results[len(prepared) :]):
            gen.complete_prefill(n, result, out.forward_s)
            out.prefilled.append((gen, n))
        return out

    def _draft_in_batch(self, decoding: Sequence[Generation],
                        orders: Mapping[Generation, StepOrder]) -> dict[Generation, StepOrder]:
        """The orders with the drafts of every batch drafter asked by two or more requests filled
        in by one call each; each request is charged an equal share of its time. A drafter that
        fails there is dropped for those requests, whose steps then run plainly."""
        out = dict(orders)
        groups: dict[str, list[tuple[Generation, int]]] = {}
        for gen in decoding:
            order = orders.get(gen, PLAIN_STEP)
            if order.draft is None and order.drafter in self.engine.batch_drafters and (k := gen.clip(order.draft_len)):
                groups.setdefault(order.drafter, []).append((gen, k))
        for name, members in groups.items():
            if len(members) < 2:
                continue  # alone, `prepare` asks the drafter as usual
            t0 = time.perf_counter()
            asked = [(gen, r) for gen, k in members if (r := gen.draft_request(name, k)) is not None]
            drafter = self.engine.drafters[name]
            assert isinstance(drafter, BatchDrafter)
            try:
                drafts = drafter.propose_batch([r for _, r in asked])
                synchronize(self.engine.target.model.device)
            except Exception:
                log.exception("drafter %r failed on a batch; its requests continue without it", name)
                for gen, _ in asked:
                    gen.drop(name)
                continue
            share = (time.perf_counter() - t0) / max(1, len(asked))
            for (gen, r), draft in zip(asked, drafts):
                out[gen] = StepOrder(name, r.k, draft, orders[gen].draft_s + share)
        return out

    def _fail(self, out: BatchStep, gen: Generation, error: Exception) -> None:
        self.running.remove(gen)
        out.failed.append((gen, error))

    def _admit(self) -> None:
        """Admit waiting requests in order while they fit; under the priority policy one that does
        not fit preempts running requests of lower priority where that makes room. With prefix
        caching one that had better wait for a running request's prefill stays queued, and those
        behind it may pass."""
        deferred: list[Generation] = []
        while self.waiting:
            gen = self.waiting[0]
            if gen.closed:
                self.waiting.popleft()
                continue
            if self.prefix is not None and self._awaits_prefix(gen):  # before preempting anyone for it
                deferred.append(self.waiting.popleft())
                continue
            if not self._room(gen) and not self._preempt_for(gen):
                break
            self.waiting.popleft()
            if self.prefix is None:
                gen.attach(self.pool.allocate() if self.pool is not None else gen.model.new_cache(gen.ctx.max_len))
            else:
                self._attach_reusing(gen)
            self.running.append(gen)
        self.waiting.extendleft(reversed(deferred))  # ahead of any request preempted meanwhile: lower priority

    def _room(self, gen: Generation, num_freed: int = 0, num_freed_tokens: int = 0) -> bool:
        """Whether `gen` fits beside the running requests, `num_freed` of them holding
        `num_freed_tokens` positions gone."""
        if self.pool is not None:
            slots = self.pool.num_free + num_freed > 0
        else:
            slots = len(self.running) - num_freed < self.config.max_num_seqs
        return slots and (self.kv_cache_tokens is None or
                          self.num_reserved_tokens - num_freed_tokens + gen.ctx.max_len <= self.kv_cache_tokens)

    def _enqueue(self, gen: Generation) -> None:
        """Queue `gen` in admission order: last (first come first served), or after the requests of
        its priority or higher that arrived before it (a preempted request keeps its place)."""
        if self.config.policy == "fcfs":
            self.waiting.append(gen)
            return
        self.waiting.insert(bisect.bisect_right(self.waiting, _rank(gen), key=_rank), gen)

    def _preempt_for(self, gen: Generation) -> bool:
        """Under the priority policy, preempt the running requests of lower priority than `gen`,
        the lowest and latest first, that make room for it; False (none preempted) where they
        cannot. A request scoring its prompt is not preempted (its prompt's logprobs come once)."""
        if self.config.policy != "priority":
            return False
        lower = sorted((g for g in self.running if g.priority > gen.priority and g.prompt_logprobs is None),
                       key=_rank, reverse=True)
        for n in range(1, len(lower) + 1):
            if self._room(gen, n, sum(g.ctx.max_len for g in lower[:n])):
                for victim in lower[:n]:
                    self.running.remove(victim)
                    self._release(victim)
                    victim.num_preemptions += 1
                    self.num_preemptions += 1
                    self._enqueue(victim)
                return True
        return False

    def _prefilling(self) -> list[Generation]:
        """The running requests still prefilling, in the order a step's token budget serves them:
        admission order, or by priority then arrival under the priority policy."""
        pending = [g for g in self.running if g.num_to_prefill]
        return sorted(pending, key=_rank) if self.config.policy == "priority" else pending

    def _prompt_reusable(self, gen: Generation) -> list[int]:
        """The tokens of a waiting request's sequence (its prompt; a preempted one's output too) it
        may find in the pool (none for a request that scores its prompt: every prompt row's logits
        are asked for)."""
        if gen.prompt_logprobs is not None:
            return []
        return self._shared(gen, len(gen.ctx.token_ids) - 1)

    def _live(self) -> list[LiveSequence]:
        """The running requests' sequences as far as another prompt may reuse them."""
        return [LiveSequence(g.cache.slot, self._shared(g), g.ctx.features, g.ctx.cache_salt)
                for g in self.running if g.cache is not None]

    def _awaits_prefix(self, gen: Generation) -> bool:
        """Whether `gen` had better wait: a running request still prefilling will hold at least
        WAIT_FOR_PREFIX_TOKENS more of its prompt than the pool does now, which `gen` then copies
        instead of prefilling the same positions beside it."""
        assert self.prefix is not None
        reusable, salt = self._prompt_reusable(gen), gen.ctx.cache_salt
        coming = max((common_prefix_len(self._shared(g, len(g.ctx.token_ids) - 1), reusable)
                      for g in self.running if g.num_to_prefill and g.ctx.cache_salt == salt), default=0)
        return (coming >= WAIT_FOR_PREFIX_TOKENS
                and coming - self.prefix.longest(reusable, self._live(), salt) >= WAIT_FOR_PREFIX_TOKENS)

    def _attach_reusing(self, gen: Generation) -> None:
        """Start `gen` with the longest prefix of its prompt the pool holds, then keep the held
        prefixes within the KV memory the running requests leave."""
        assert self.prefix is not None
        reuse = self.prefix.plan(self._prompt_reusable(gen), self._live(), gen.ctx.cache_salt)
        # a resumed request's prompt was counted at its first admission
        gen.attach(self.prefix.claim(reuse, 0 if gen.num_preemptions else gen.num_prompt), reuse.features)
        if self.kv_cache_tokens is not None:
            self.prefix.evict(self.kv_cache_tokens - self.num_reserved_tokens - gen.ctx.max_len)

    def _shared(self, gen: Generation, length: int | None = None) -> list[int]:
        """The tokens of a request's first `length` positions (default: all its cache holds) whose
        keys and values another prompt may reuse exactly: all, or where prompt rows take other
        kernels than scored ones, those its prompt rows computed (a request scoring its prompt
        computes them as scored rows: none)."""
        if length is None:
            assert gen.cache is not None
            length = gen.cache.length
        if not self.engine.target.model.prompt_rows_as_scored:
            length = 0 if gen.prompt_logprobs is not None else min(length, gen.num_prompt - 1)
        return gen.ctx.token_ids[:length]

    def _release(self, gen: Generation) -> None:
        """Free a request's slot (finished, cancelled or preempted); with prefix caching what it may
        share stays there."""
        if self.prefix is None or gen.cache is None:
            gen.release_cache()
            return
        shared = self._shared(gen)  # while it holds its cache
        self.prefix.release(gen.detach_cache(), shared, gen.ctx.features, gen.ctx.cache_salt)

    def _forward(self, inputs: Sequence[SeqInput]) -> list[ForwardOutput]:
        return forward_rows(self.engine.target.model, inputs, self.engine.needs_hidden_states)
