"""Priority scheduling (`scheduler.policy: priority`, vLLM's): the waiting queue's order, the
refusal of priorities under first come first served, and preemption: a request of higher
priority that finds no room takes a running request's slot, and the preempted request resumes
where it was with every token and logprob it has without preemption (on the shipped target's
row-invariant weights, with and without prefix caching)."""

from __future__ import annotations

import pytest
import torch

from workers.batch import BatchEngine
from workers.config import PLAIN
from workers.engine import Generation, SpecEngine, StepOrder
from workers.result import RequestError
from workers.sampling import SamplingParams

QUESTIONS = ["Which planet is largest?", "How far is the Moon?", "What is a comet made of?"]
ORDERS = [StepOrder("ngram", 4), StepOrder("eagle", 2), StepOrder(PLAIN, 0)]  # the preempted request drafts with EAGLE


def test_first_come_first_served_refuses_a_priority_naming_the_field(tiny_engine: SpecEngine) -> None:
    batch = BatchEngine(tiny_engine)
    batch.add([1, 2, 3], SamplingParams(max_tokens=2), priority=0)
    with pytest.raises(RequestError) as info:
        batch.add([1, 2, 3], SamplingParams(max_tokens=2), priority=2)
    assert info.value.param == "priority" and len(batch.waiting) == 1


def test_the_waiting_queue_is_ordered_by_priority_then_arrival(tiny_engine: SpecEngine) -> None:
    batch = BatchEngine(tiny_engine.with_scheduler(policy="priority", max_num_seqs=1))
    params = SamplingParams(max_tokens=2)
    a, b, c, d = (batch.add([1, 2, 3], params, priority=p) for p in (0, 5, -1, 5))
    assert list(batch.waiting) == [c, a, b, d]
    assert batch.schedule() == [] and batch.running == [c]  # one slot; c is prefilling
    e = batch.add([1, 2], params, priority=-1)  # equal to the running request's: it waits, nothing is preempted
    batch.schedule()
    assert batch.running == [c] and list(batch.waiting) == [e, a, b, d] and batch.num_preemptions == 0


def test_prompt_chunks_serve_the_higher_priority_first(tiny_engine: SpecEngine) -> None:
    batch = BatchEngine(tiny_engine.with_scheduler(policy="priority", max_num_batched_tokens=8))
    params = SamplingParams(max_tokens=2)
    low = batch.add(list(range(1, 30)), params, priority=1)
    batch.schedule()
    high = batch.add(list(range(30, 60)), params)
    batch.schedule()
    assert batch.running == [low, high]  # both hold a slot, low admitted first
    assert batch.step().prefilled == [(high, 8)]


# -- the shipped target -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(row_invariant_engine: SpecEngine) -> SpecEngine:
    """Two KV slots, so a third request finds no room."""
    return row_invariant_engine.with_scheduler(max_num_seqs=2, max_num_batched_tokens=64, policy="priority")


def _step_all(batch: BatchEngine, gens: list[Generation]) -> None:
    step = batch.step({g: ORDERS[gens.index(g) % len(ORDERS)] for g in batch.schedule()})
    assert not step.failed


@pytest.mark.parametrize("caching", [True, False])
def test_a_preempted_request_resumes_with_the_tokens_and_logprobs_it_has_alone(engine: SpecEngine,
                                                                                caching: bool) -> None:
    params = SamplingParams(max_tokens=16, logprobs=2)
    prompts = [engine.encode(q) for q in QUESTIONS]
    batch = BatchEngine(engine.with_scheduler(enable_prefix_caching=caching))
    assert (batch.prefix is not None) == caching
    low = [batch.add(p, params, priority=1) for p in prompts[:2]]
    gens = [*low]
    while min(len(g.output_ids) for g in low) < 4:
        _step_all(batch, gens)
    done_before = len(low[1].output_ids)
    gens.append(high := batch.add(prompts[2], params))  # priority 0: no slot is free
    batch.schedule()
    # the lowest priority and latest arrival gives its slot back and waits, its output kept
    assert batch.running == [low[0], high] and list(batch.waiting) == [low[1]]
    assert low[1].cache is None and low[1].num_preemptions == 1 and batch.num_preemptions == 1
    assert len(low[1].output_ids) == done_before
    while batch.num_unfinished:
        _step_all(batch, gens)
    assert low[1].num_preemptions == 1 and low[1].num_cached == 0  # usage reports the first admission's reuse
    for i, gen in enumerate(gens):  # each alone, drafting as it did
        alone = BatchEngine(engine)
        ref = alone.add(prompts[i], params)
        while alone.num_unfinished:
            assert not alone.step({g: ORDERS[i] for g in alone.schedule()}).failed
        assert gen.output_ids == ref.output_ids
        assert gen.result().logprobs == ref.result().logprobs
        n = len(ref.ctx.token_ids) - 1  # the positions computed; EAGLE reads their hidden states
        assert torch.equal(gen.ctx.features[:n], ref.ctx.features[:n])


def test_bench_compares_the_policies(engine: SpecEngine) -> None:
    """`python -m bench.priority`'s comparison: under the priority policy the foreground's next
    question, sent once a background request has taken the slot it left, preempts one; the
    answers finished under both policies are the same."""
    from bench.priority import compare, report

    background = [engine.encode(q) for q in QUESTIONS]
    foreground = [engine.encode(q + " Answer in one word.") for q in QUESTIONS[:2]]
    results = compare(engine, background, foreground, 3, SamplingParams(max_tokens=48, ignore_eos=True),
                      SamplingParams(max_tokens=4), 0.01, 1)
    assert results["fcfs"]["num_preemptions"] == 0 < results["priority"]["num_preemptions"]
    assert results["num_compared"] >= 2 and results["num_mismatches"] == 0
    assert "| priority |" in report(results)
