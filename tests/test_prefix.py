"""Automatic prefix caching (workers/prefix.py): where a new request starts in the KV pool, and on
the shipped int4 target, where reuse is exact, that a request's tokens, logprobs and the hidden
states its feature drafter reads are bit for bit those it has without reuse."""

from __future__ import annotations

import pytest
import torch

from workers.batch import BatchEngine
from workers.config import PLAIN
from workers.engine import Generation, SpecEngine, StepOrder
from workers.models.llama import KVPool
from workers.prefix import WAIT_FOR_PREFIX_TOKENS, LiveSequence, PrefixCache, Reuse, common_prefix_len
from workers.sampling import SamplingParams

SYSTEM = "You answer questions about the solar system in one or two plain sentences, citing no sources. " * 4
QUESTIONS = ["Which planet is largest?", "How far is the Moon?", "What is a comet made of?"]


def _pool(num_slots: int = 3, capacity: int = 32) -> KVPool:
    return KVPool(2, num_slots, 1, capacity, 4, torch.float32, torch.device("cpu"))


def _fill(pool: KVPool, tokens: list[int]) -> object:
    """A slot holding `tokens`, its keys and values the token ids themselves."""
    cache = pool.allocate()
    for kv in (pool.k, pool.v):
        kv[:, cache.slot, :, : len(tokens)] = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None]
    cache.extend(len(tokens))
    return cache


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == common_prefix_len([9], [1]) == 0


def test_a_released_slot_keeps_its_prefix_and_a_continuing_prompt_takes_it_in_place() -> None:
    pool = _pool()
    prefix = PrefixCache(pool)
    cache = _fill(pool, [5, 6, 7, 8])
    slot = cache.slot
    prefix.release(cache, [5, 6, 7, 8, 9], None)  # the last token was never run: 4 positions kept
    assert prefix.held[slot].token_ids == [5, 6, 7, 8] and prefix.num_held_tokens == 4
    assert pool.k[:, slot, :, 4:].abs().sum() == 0 and pool.k[:, slot, :, 3].eq(8).all()
    reuse = prefix.plan([5, 6, 7, 8, 1, 2])  # the next turn: continues all the slot holds
    assert reuse == Reuse(slot, 4, None, None)
    again = prefix.claim(reuse, 7)
    assert again.slot == slot and again.length == 4 and not prefix.held
    assert (prefix.num_queried_tokens, prefix.num_hit_tokens) == (7, 4)


def test_a_partial_match_is_copied_and_the_held_sequence_stays() -> None:
    pool = _pool()
    prefix = PrefixCache(pool)
    first = _fill(pool, [5, 6, 7, 8])
    prefix.release(first, [5, 6, 7, 8], None)
    reuse = prefix.plan([5, 6, 1])  # shares two tokens: copied into the lowest empty slot
    assert (reuse.length, reuse.source) == (2, first.slot) and reuse.slot != first.slot
    cache = prefix.claim(reuse, 4)
    assert cache.length == 2 and pool.k[:, cache.slot, :, :2, 0].flatten().tolist() == [5, 6] * 2
    assert pool.k[:, cache.slot, :, 2:].abs().sum() == 0
    assert prefix.held[first.slot].token_ids == [5, 6, 7, 8]  # still there for the conversation's next turn
    # a running sequence is a source too: a third prompt copies the longer prefix it shares with it
    live = LiveSequence(cache.slot, [5, 6, 1], None)
    third = prefix.plan([5, 6, 1, 3], [live])
    assert (third.length, third.source) == (3, cache.slot)
    assert prefix.longest([5, 6, 1, 3], [live]) == 3 and prefix.longest([5, 6, 7, 8, 9]) == 4


def test_a_salted_prefix_is_reused_by_requests_of_its_salt_alone() -> None:
    pool = _pool()
    prefix = PrefixCache(pool)
    tenant = _fill(pool, [5, 6, 7, 8])
    prefix.release(tenant, [5, 6, 7, 8], None, salt="tenant-a")
    assert prefix.held[tenant.slot].salt == "tenant-a"
    assert prefix.longest([5, 6, 7, 8, 9]) == 0 and prefix.longest([5, 6, 7, 8, 9], salt="tenant-b") == 0
    assert prefix.longest([5, 6, 7, 8, 9], salt="tenant-a") == 4
    other = prefix.plan([5, 6, 7, 8, 9], salt="tenant-b")
    assert other.length == 0 and other.slot != tenant.slot  # the held slot is not even taken
    assert prefix.plan([5, 6, 7, 8, 9], salt="tenant-a") == Reuse(tenant.slot, 4, None, None)
    # a running sequence shares the same way
    live = LiveSequence(tenant.slot, [5, 6, 7], None, "tenant-a")
    assert prefix.longest([5, 6, 7], [live]) == 0 and prefix.longest([5, 6, 7], [live], "tenant-a") == 3
    unsalted = LiveSequence(2, [1, 2, 3], None)
    assert prefix.longest([1, 2, 3], [unsalted], "tenant-a") == 0 and prefix.longest([1, 2, 3], [unsalted]) == 3


def test_slots_go_to_empty_ones_first_then_the_least_recently_used_held() -> None:
    pool = _pool(num_slots=3)
    prefix = PrefixCache(pool)
    a, b = _fill(pool, [1, 2]), _fill(pool, [3, 4])
    prefix.release(a, [1, 2], None)
    prefix.release(b, [3, 4], None)
    assert prefix.plan([9, 9]).slot == 2  # the empty slot, not a held one
    prefix.claim(prefix.plan([9, 9]), 3)
    reuse = prefix.plan([7, 7])  # no empty slot left: the oldest held one, its sequence dropped
    assert reuse == Reuse(a.slot)
    prefix.claim(reuse, 3)
    assert set(prefix.held) == {b.slot} and pool.k[:, a.slot].abs().sum() == 0


def test_eviction_keeps_the_held_tokens_within_a_budget() -> None:
    pool = _pool()
    prefix = PrefixCache(pool)
    caches = [_fill(pool, [i] * (i + 2)) for i in range(3)]
    for c in caches:
        prefix.release(c, [c.slot] * c.length, None)
    assert prefix.num_held_tokens == 2 + 3 + 4
    prefix.evict(7)  # the oldest (2 tokens) goes: 7 left
    assert prefix.num_held_tokens == 7 and 0 not in prefix.held
    prefix.evict(0)
    assert not prefix.held and pool.k.abs().sum() == 0


def test_prefix_caching_is_on_by_default_only_where_reuse_is_exact(tiny_engine: SpecEngine) -> None:
    assert BatchEngine(tiny_engine).prefix is None  # float32: rows differ in the last bits by chunking
    assert BatchEngine(tiny_engine.with_scheduler(enable_prefix_caching=True)).prefix is not None


# -- the shipped target -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(row_invariant_engine: SpecEngine) -> SpecEngine:
    return row_invariant_engine.with_scheduler(max_num_seqs=3, max_num_batched_tokens=64)


def _chat(engine: SpecEngine, *turns: str) -> list[int]:
    roles = ["user", "assistant"]
    messages = [{"role": "system", "content": SYSTEM}]
    messages += [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]
    return engine.encode(messages)


def _run(batch: BatchEngine, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
    """The prompts in one batch, drafting in turn with nothing, prompt lookup and EAGLE."""
    gens = [batch.add(p, params) for p in prompts]
    orders = [StepOrder(PLAIN, 0), StepOrder("ngram", 4), StepOrder("eagle", 2)]
    while batch.num_unfinished:
        step = batch.step({g: orders[gens.index(g) % 3] for g in batch.schedule()})
        assert not step.failed
    return gens


def test_reused_prefixes_change_no_token_logprob_or_feature(engine: SpecEngine) -> None:
    """A conversation's second turn, and questions sharing its system prompt beside it, with prefix
    caching and without: the same tokens and logprobs, bit for bit, and the hidden states EAGLE
    reads at the reused positions equal those a prefill computes."""
    params = SamplingParams(max_tokens=24, logprobs=2)
    cached, fresh = BatchEngine(engine), BatchEngine(engine)
    assert cached.prefix is not None
    fresh.prefix = None
    first = _chat(engine, QUESTIONS[0])
    [turn1] = _run(cached, [first], params)
    assert turn1.num_cached == 0
    second = _chat(engine, QUESTIONS[0], engine.tokenizer.decode(turn1.output_ids, skip_special_tokens=True), "Why?")
    later = [second] + [_chat(engine, q) for q in QUESTIONS[1:]]
    with_reuse, without = _run(cached, later, params), _run(fresh, later, params)
    # the next turn continues the first's prompt in place (its answer too where prompt rows compute
    # keys as scored rows do); the others copy the system prompt
    system_len = common_prefix_len(later[1], later[2])
    if engine.target.model.prompt_rows_as_scored:
        assert with_reuse[0].num_cached > len(first)
    else:
        assert with_reuse[0].num_cached == len(first) - 1
    assert system_len > 80
    assert [g.num_cached for g in with_reuse[1:]] == [system_len] * 2
    assert [g.num_cached for g in without] == [0, 0, 0]
    for a, b in zip(with_reuse, without):
        assert a.output_ids == b.output_ids
        ra, rb = a.result(), b.result()
        assert ra.num_cached_tokens == a.num_cached
        assert ra.logprobs == rb.logprobs and len(ra.logprobs) == len(a.output_ids)
        n = a.num_cached
        assert torch.equal(a.ctx.features[:n], b.ctx.features[:n])
    assert "eagle" in with_reuse[2].result().drafters
    prefix = cached.prefix
    assert prefix.num_hit_tokens == sum(g.num_cached for g in [turn1, *with_reuse])
    assert prefix.num_queried_tokens == sum(len(p) for p in [first, *later])


def test_requests_arriving_together_prefill_their_shared_prefix_once(engine: SpecEngine) -> None:
    """Three questions under one new system prompt, added at once: the first prefills it while the
    others wait until what is left of it is too short to wait for, then copy it; their output is
    that of a batch without prefix caching."""
    params = SamplingParams(max_tokens=8)
    prompts = [_chat(engine, q) for q in QUESTIONS]
    system_len = common_prefix_len(prompts[0], prompts[1])
    assert system_len >= WAIT_FOR_PREFIX_TOKENS + 16
    cached, fresh = BatchEngine(engine), BatchEngine(engine)
    fresh.prefix = None
    gens = [cached.add(p, params) for p in prompts]
    cached.schedule()
    assert gens[0].cache is not None and list(cached.waiting) == gens[1:]
    while cached.num_unfinished:
        assert not cached.step({g: StepOrder("ngram", 3) for g in cached.schedule()}).failed
    assert gens[0].num_cached == 0 and gens[1].num_cached == gens[2].num_cached
    assert system_len - WAIT_FOR_PREFIX_TOKENS < gens[1].num_cached <= system_len
    assert [g.output_ids for g in gens] == [g.output_ids for g in _run(fresh, prompts, params)]


def test_requests_of_other_salts_neither_wait_for_nor_reuse_a_prefix(engine: SpecEngine) -> None:
    """The same prompt under two salts, added at once: the second neither waits for the first's
    prefill nor copies it; a third of the first's salt, after both, finds it; outputs unchanged."""
    params = SamplingParams(max_tokens=6)
    prompt = _chat(engine, QUESTIONS[0])
    batch = BatchEngine(engine)
    a = batch.add(prompt, params, cache_salt="tenant-a")
    b = batch.add(prompt, params, cache_salt="tenant-b")
    batch.schedule()
    assert a.cache is not None and b.cache is not None  # no waiting on a prefix of another salt
    while batch.num_unfinished:
        batch.schedule()
        assert not batch.step().failed
    assert a.num_cached == b.num_cached == 0
    again = batch.add(prompt, params, cache_salt="tenant-a")
    unsalted = batch.add(prompt, params)
    while batch.num_unfinished:
        batch.schedule()
        assert not batch.step().failed
    assert again.num_cached == len(prompt) - 1 and unsalted.num_cached == 0
    assert a.output_ids == b.output_ids == again.output_ids == unsalted.output_ids


def test_a_cancelled_request_keeps_its_prefix_for_the_one_waiting_on_it(engine: SpecEngine) -> None:
    """A request waiting for another's prefill is admitted once that one is cancelled, and starts
    from the positions it had prefilled, which its slot keeps."""
    params = SamplingParams(max_tokens=6)
    prompts = [_chat(engine, q) for q in QUESTIONS[:2]]
    batch = BatchEngine(engine)
    first, second = (batch.add(p, params) for p in prompts)
    batch.schedule()
    batch.step()  # the first's first chunk; the second waits
    done = first.num_prefilled
    assert 0 < done < common_prefix_len(*prompts) and second.cache is None
    slot = first.cache.slot
    batch.remove(first)
    first.close()
    assert batch.prefix.held[slot].token_ids == prompts[0][:done]
    while batch.num_unfinished:
        batch.schedule()
        assert not batch.step().failed
    assert second.finished and second.num_cached == done
    fresh = BatchEngine(engine)
    fresh.prefix = None
    assert second.output_ids == _run(fresh, [prompts[1]], params)[0].output_ids


def test_a_request_scoring_its_prompt_prefills_it_all(engine: SpecEngine) -> None:
    batch = BatchEngine(engine)
    prompt = _chat(engine, QUESTIONS[1])
    _run(batch, [prompt], SamplingParams(max_tokens=4))
    [scored] = _run(batch, [prompt], SamplingParams(max_tokens=4, prompt_logprobs=0))
    assert scored.num_cached == 0 and len(scored.result().prompt_logprobs) == len(prompt)
    [again] = _run(batch, [prompt], SamplingParams(max_tokens=4))
    assert again.num_cached == len(prompt) - 1  # all but the last prompt token, which the first step runs


def test_held_prefixes_stay_within_the_kv_memory(engine: SpecEngine) -> None:
    """The KV budget holds the running requests' reservations and what finished ones keep; an
    admission evicts the oldest held prefixes past it."""
    batch = BatchEngine(engine)
    params = SamplingParams(max_tokens=8)
    prompts = [_chat(engine, q) for q in QUESTIONS]
    batch.kv_cache_tokens = len(prompts[0]) + params.max_tokens + 8 + len(prompts[0]) // 2
    for p in prompts:
        _run(batch, [p], params)
        assert batch.prefix.num_held_tokens <= batch.kv_cache_tokens
    assert len(batch.prefix.held) == 1  # one finished sequence fits beside a running request's reservation


def test_bench_runs_conversations_with_and_without_prefix_caching(engine: SpecEngine) -> None:
    """`python -m bench.prefix`'s comparison: the second turns find the first turns' prompts, the
    system-prompt questions the system prompt, and every output equals the other mode's."""
    from bench.prefix import Conversation, compare, report

    params = SamplingParams(max_tokens=6)
    conversations = [Conversation((q, "Say more.")) for q in QUESTIONS[:2]]
    system = [Conversation((q,), SYSTEM) for q in QUESTIONS]
    results = {"runs": {"conversations@2": compare(engine, None, ["plain"], "conversations", conversations, params,
                                                   2, 1),
                        "system@1": compare(engine, None, ["plain"], "system", system, params, 1, 1)}}
    for by_method in results["runs"].values():
        on, off = by_method["plain"]["on"], by_method["plain"]["off"]
        assert on["num_mismatches"] == off["num_mismatches"] == 0
        assert on["prompt_tokens"] == off["prompt_tokens"] > on["cached_tokens"] > 0 == off["cached_tokens"]
    assert "| system | 1 | plain | on / off |" in report(results)
