"""Continuous batching on the tiny target: the pooled, batched forward against one sequence at a
time; the scheduler (admission, chunked prefill, slots); losslessness of mixed batches (greedy
and sampled, every drafter kind the tiny engine has, draft trees); drafters proposing for a whole
batch in one call; failure isolation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from helpers import (
    TWO_TOKEN_PARAMS,
    TwoTokenCase,
    assert_follows_joint,
    assert_same_or_tie,
    slow_device_waits,
    with_draws,
    write_eagle,
    write_medusa_heads,
)

from workers.batch import BatchEngine
from workers.config import PLAIN, EagleDrafterConfig, EngineConfig, MedusaDrafterConfig, NgramDrafterConfig
from workers.drafters.base import BatchDrafter, DraftRequest
from workers.drafters.model import ModelDrafter
from workers.drafters.registry import build_drafter
from workers.engine import Generation, SpecEngine, StepOrder
from workers.models import llama
from workers.models.base import LIBC, SeqInput, release_freed_memory
from workers.sampling import SamplingParams
from workers.tree import DraftTree

TEXTS = [
    "Tell me a story about a cat and a dog.",
    "Summarize: the committee met on Tuesday and agreed to postpone the vote until March.",
    "Write a Python function that reverses a linked list.",
    "Count: one two three four five six seven eight nine ten one two",
    "hi",
]
# (drafter, k) per request of a mixed batch: every kind the engine has, plain included
MIX = [(PLAIN, 0), ("ngram", 4), ("self", 3), ("other", 2), ("self_tree", 3)]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tiny_drafter_dir: Path) -> SpecEngine:
    return SpecEngine.from_config(EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 512},
        "drafters": [
            NgramDrafterConfig().model_dump(),
            {"kind": "model", "name": "self", "model": {"model": str(tiny_llama_dir)}, "draft_len": 4},
            {"kind": "model", "name": "other", "model": {"model": str(tiny_drafter_dir)}, "draft_len": 3},
            {"kind": "model", "name": "self_tree", "model": {"model": str(tiny_llama_dir)}, "draft_len": 3,
             "tree": {"topk": 2, "nodes": 5}},
        ],
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 24},
    }))


@pytest.fixture(scope="module")
def prompts(engine: SpecEngine) -> list[list[int]]:
    return [engine.encode(t, chat=i % 2 == 0) for i, t in enumerate(TEXTS)]


def greedy(max_tokens: int = 24, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def run_batch(batch: BatchEngine, gens: list[Generation], orders: dict[Generation, StepOrder]) -> list[int]:
    """Step until every generation finished; the batch size of each step."""
    sizes = []
    while batch.num_unfinished:
        decoding = batch.schedule()
        step = batch.step({g: orders[g] for g in decoding})
        assert not step.failed
        sizes.append(step.batch_size)
    for g in gens:
        g.close()
    return sizes


# -- the model: pooled slots and the batched forward ---------------------------------------------

def test_forward_batch_matches_one_sequence_at_a_time(engine: SpecEngine) -> None:
    """Prefill chunks, decode rows, a verify chain and a draft tree in one forward, in slots that
    leave a gap: every sequence's logits and hidden states equal its own forward's."""
    model = engine.target.model
    g = torch.Generator().manual_seed(0)
    pool = model.new_pool(6, 64)
    caches = [pool.allocate() for _ in range(6)]
    pool.release(caches[2])  # a hole in the slot range
    caches = [caches[i] for i in (0, 1, 3, 5)]
    tree = DraftTree((-1, -1, 0, 1))
    contexts = [torch.randint(0, 1000, (n,), generator=g) for n in (9, 3, 20, 1)]
    news = [torch.randint(0, 1000, (n,), generator=g) for n in (1, 7, 5, 12)]
    trees = [None, None, tree, None]
    for cache, ctx in zip(caches, contexts):
        model.forward(ctx, cache)
    outs = model.forward_batch([SeqInput(new, cache, "all", t) for new, cache, t in zip(news, caches, trees)],
                               return_hidden=True)
    for ctx, new, t, out, cache in zip(contexts, news, trees, outs, caches):
        alone = model.new_cache(64)
        model.forward(ctx, alone)
        ref = model.forward(new, alone, tree=t, return_hidden=True)
        torch.testing.assert_close(out.logits, ref.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(out.hidden, ref.hidden, atol=1e-4, rtol=1e-4)
        assert cache.length == alone.length
        # the products' kernels differ by row count (workers/models/llama.py): rounding, not a bug
        torch.testing.assert_close(cache.k[:, :, : cache.length], alone.k[:, :, : alone.length], atol=1e-4, rtol=1e-4)


def test_forward_batch_returns_only_the_logits_asked_for(engine: SpecEngine) -> None:
    model = engine.target.model
    pool = model.new_pool(3, 32)
    caches = [pool.allocate() for _ in range(3)]
    outs = model.forward_batch([SeqInput(torch.arange(5), caches[0], "none"), SeqInput(torch.arange(4), caches[1], "last"),
                                SeqInput(torch.arange(3), caches[2], "all")])
    assert [o.logits.shape[0] for o in outs] == [0, 1, 3]
    assert [c.length for c in caches] == [5, 4, 3]


def test_pool_slots_are_reused_lowest_first_and_refuse_when_full(engine: SpecEngine) -> None:
    pool = engine.target.model.new_pool(2, 16)
    a, b = pool.allocate(), pool.allocate()
    assert (a.slot, b.slot, pool.num_free) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="all 2 KV slots"):
        pool.allocate()
    pool.release(a)
    with pytest.raises(ValueError, match="not allocated"):
        pool.release(a)
    assert pool.allocate().slot == 0


@pytest.mark.parametrize("offset,length", [(0, 3 << 12), (5, 3 << 12), (7, 100)])
def test_zeroing_kv_memory_zeroes_every_element_and_nothing_beside(offset: int, length: int) -> None:
    """Whole pages are handed back to the system, the partial pages at either end zeroed in place."""
    buf = torch.full((length + 64,), float("nan"))
    llama._zero_(buf[offset : offset + length])
    assert bool((buf[offset : offset + length] == 0).all())
    assert bool(buf[:offset].isnan().all()) and bool(buf[offset + length :].isnan().all())


def _resident() -> int:
    """This process's resident set, in bytes."""
    return psutil.Process().memory_info().rss


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads Linux's resident set")
def test_kv_zeros_take_memory_only_where_written() -> None:
    """A new cache or pool reads zeros (attention reads masked keys past the written ones) without
    holding its capacity resident: pages come from the shared zero page until a sequence writes."""
    before = _resident()
    kv = llama._zeros((64 << 20,), torch.float32, torch.device("cpu"))  # 256 MiB
    assert float(kv.sum()) == 0.0 and _resident() - before < (32 << 20)
    kv[: 32 << 20] = 1.0  # half written: half resident
    assert _resident() - before > (96 << 20)


@pytest.mark.skipif(getattr(LIBC, "malloc_trim", None) is None or not Path("/proc/self/statm").exists(),
                    reason="glibc's malloc_trim and Linux's resident set")
def test_memory_a_load_frees_goes_back_to_the_system() -> None:
    """Temporaries freed below a tensor that stays (a load's probes and dequantised copies below
    its packed weights) stay resident in glibc's heap until released."""
    temporaries = [torch.ones(16 << 10) for _ in range(3200)]  # 64 KiB each, 200 MiB: on the heap
    kept = torch.ones(16 << 10)  # above them
    full = _resident()
    del temporaries
    freed = _resident()
    release_freed_memory()
    assert freed - _resident() > (100 << 20), (full, freed, _resident())
    assert float(kept.sum()) == 16 << 10


# -- the scheduler --------------------------------------------------------------------------------

@pytest.mark.parametrize("mix", [MIX, [(PLAIN, 0)] * 5], ids=["mixed-drafters", "plain"])
def test_batched_greedy_equals_each_request_alone(engine: SpecEngine, prompts: list[list[int]], mix) -> None:
    """Every request of a batch (each with its own drafter and k, more requests than slots, so
    some wait and join mid-run) decodes what plain decoding alone decodes."""
    batch = BatchEngine(engine)
    gens = [batch.add(p, greedy()) for p in prompts]
    sizes = run_batch(batch, gens, {g: StepOrder(d, k) for g, (d, k) in zip(gens, mix)})
    assert max(sizes) == engine.config.scheduler.max_num_seqs  # the pool's 4 slots were all in use
    for gen, prompt in zip(gens, prompts):
        assert_same_or_tie(engine, prompt, gen.output_ids, engine.generate(prompt, greedy()).token_ids)
    assert batch.pool is not None and batch.pool.num_free == batch.pool.num_slots  # closing returned every slot
    drafted = {g.result().drafters[0] for g in gens if g.result().drafters}
    assert drafted >= ({d for d, k in mix if k} - {"ngram"})


def test_chunked_prefill_never_stalls_the_decoding_requests(engine: SpecEngine, prompts: list[list[int]]) -> None:
    """A prompt longer than the step's token budget is prefilled over several steps, while the
    requests already decoding emit a token in every one of them."""
    batch = BatchEngine(engine)
    budget = engine.config.scheduler.max_num_batched_tokens
    short = [batch.add(p, greedy(30)) for p in prompts[:2]]
    for _ in range(3):  # the short prompts are in and decoding
        batch.step({g: StepOrder() for g in batch.schedule()})
    long_prompt = (prompts[1] * 8)[: 5 * budget]
    late = batch.add(long_prompt, greedy(4))
    chunks = 0
    while late.num_to_prefill:
        step = batch.step({g: StepOrder() for g in batch.schedule()})
        assert step.num_rows <= budget
        assert {g for g, _ in step.stats} == {g for g in short if not g.finished or g in dict(step.stats)}
        chunks += any(g is late for g, _ in step.prefilled)
    assert chunks >= 4
    run_batch(batch, [*short, late], {g: StepOrder() for g in [*short, late]})
    assert_same_or_tie(engine, long_prompt, late.output_ids, engine.generate(long_prompt, greedy(4)).token_ids)


def test_sampled_requests_in_a_mixed_batch_follow_the_target(engine: SpecEngine, prompts: list[list[int]]) -> None:
    """Sampled requests drafting with every kind share batches with greedy ones: each still
    draws from the target's distribution (chi-square over seeds)."""
    case = TwoTokenCase.of(engine)
    drafters = [d for d, k in MIX]
    stream = with_draws(engine, "stream")  # rejection sampling

    def generate(seed: int):
        batch = BatchEngine(stream)
        drafter = drafters[seed % len(drafters)]
        sampled = batch.add(case.prompt, SamplingParams(seed=seed, **TWO_TOKEN_PARAMS))
        others = [batch.add(p, greedy(6)) for p in prompts[:2]]
        orders = {sampled: StepOrder(drafter, 2), others[0]: StepOrder("self", 3), others[1]: StepOrder("ngram", 3)}
        run_batch(batch, [sampled, *others], orders)
        return sampled.result()

    assert_follows_joint(case.joint, 300, generate)


def test_a_seeded_request_reproduces_its_output_in_the_same_batch(engine: SpecEngine, prompts: list[list[int]]) -> None:
    outs = []
    for _ in range(2):
        batch = BatchEngine(engine)
        gens = [batch.add(p, SamplingParams(max_tokens=16, temperature=0.9, seed=7)) for p in prompts[:3]]
        run_batch(batch, gens, {g: StepOrder(d, k) for g, (d, k) in zip(gens, MIX[1:])})
        outs.append([g.output_ids for g in gens])
    assert outs[0] == outs[1]


def test_a_failing_drafter_leaves_its_request_plain_and_the_batch_untouched(
    engine: SpecEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = {"n": 0}
    real = engine.drafters["self"].propose

    def flaky(state: Any, ctx: Any, k: int):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("drafter crashed")
        return real(state, ctx, k)

    monkeypatch.setattr(engine.drafters["self"], "propose", flaky)
    batch = BatchEngine(engine)
    gens = [batch.add(p, greedy()) for p in prompts[:3]]
    run_batch(batch, gens, dict(zip(gens, [StepOrder("self", 3), StepOrder("ngram", 3), StepOrder()])))
    for gen, prompt in zip(gens, prompts):
        assert_same_or_tie(engine, prompt, gen.output_ids, engine.generate(prompt, greedy()).token_ids)
    assert any(s.fallback_reason == "drafter_error" for s in gens[0].steps)


def test_a_removed_request_frees_its_slot_for_a_waiting_one(engine: SpecEngine, prompts: list[list[int]]) -> None:
    batch = BatchEngine(engine)
    gens = [batch.add(p, greedy(50)) for p in prompts]
    batch.schedule()
    assert (len(batch.running), len(batch.waiting)) == (4, 1)
    batch.remove(gens[0])
    gens[0].close()
    batch.schedule()
    assert gens[4] in batch.running and len(batch.running) == 4
    run_batch(batch, gens[1:], {g: StepOrder() for g in gens})
    assert batch.pool is not None and batch.pool.num_free == batch.pool.num_slots


def test_a_step_times_the_forward_until_the_device_finishes(
    engine: SpecEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU forward returns before it runs: the step's seconds (what the goodput rule prices the
    next steps by) must include the wait for the device. A stand-in wait of 20 ms is counted."""
    waits = slow_device_waits(monkeypatch, "workers.batch", 0.02)
    batch = BatchEngine(engine)
    gen = batch.add(prompts[0], greedy(4))
    step = batch.step({g: StepOrder() for g in batch.schedule()})
    gen.close()
    assert waits == [engine.target.model.device] and step.forward_s >= 0.02
    # two requests drafting with one batch drafter: one call, its wait shared between them
    batch = BatchEngine(engine)
    gens = [batch.add(p, greedy(8)) for p in prompts[:2]]
    drafted = []
    while batch.num_unfinished and not drafted:
        step = batch.step({g: StepOrder("other", 2) for g in batch.schedule()})
        drafted = [st for _, st in step.stats if st.draft_len] if len(step.stats) == 2 else []
    for g in gens:
        g.close()
    assert len(drafted) == 2 and min(st.draft_s for st in drafted) >= 0.01


# -- drafting in batch ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def with_features(engine: SpecEngine, tmp_path_factory: pytest.TempPathFactory) -> SpecEngine:
    """The module's engine plus Medusa heads and an EAGLE head: batch drafters of every kind
    ("other", "medusa", "eagle"); the "_case" ones draft only tokens of the sampled test's case,
    so they are accepted there."""
    vocab = TwoTokenCase.of(engine).draft_vocab(engine.target.model.info.vocab_size)
    configs = [
        MedusaDrafterConfig(name="medusa", path=str(write_medusa_heads(tmp_path_factory.mktemp("m"), engine))),
        MedusaDrafterConfig(name="medusa_case", path=str(write_medusa_heads(tmp_path_factory.mktemp("m"), engine,
                                                                              vocab))),
        EagleDrafterConfig(name="eagle", path=str(write_eagle(tmp_path_factory.mktemp("e"), engine))),
        EagleDrafterConfig(name="eagle_case", path=str(write_eagle(tmp_path_factory.mktemp("e"), engine, vocab))),
    ]
    extra = {c.name: build_drafter(c, engine.target) for c in configs}
    return SpecEngine(engine.target, {**engine.drafters, **extra}, engine.config)


def _started(engine: SpecEngine, prompts: list[list[int]], params: SamplingParams, steps: int) -> list[Generation]:
    """Requests alone, a few plain steps in: contexts with the target's features filled."""
    gens = [engine.start(p, params) for p in prompts]
    for g in gens:
        for _ in range(steps):
            g.step()
    return gens


@pytest.mark.parametrize("drafter", ["other", "medusa", "eagle"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_batch_drafter_proposes_what_it_proposes_alone(
    with_features: SpecEngine, prompts: list[list[int]], drafter: str, sampled: bool,
) -> None:
    """One `propose_batch` over three requests (different context lengths and k) gives each the
    draft its own `propose` gives, twice in a row (the second after a step that rejected it)."""
    impl = with_features.drafters[drafter]
    assert isinstance(impl, BatchDrafter)
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=3) if sampled else greedy(40)
    gens = _started(with_draws(with_features, "stream"), prompts[:3], params, 2)  # sampled: drawn drafts
    ks = [3, 1, 2]
    batched = [impl.begin(g.ctx) for g in gens]  # the model drafter's first three slots: pooled
    alone = [impl.begin(g.ctx) for g in gens]
    if isinstance(impl, ModelDrafter):
        assert all(s.cache.pool is impl._pool for s in batched)
    try:
        for _ in range(2):
            generators = [g.ctx.generator.get_state() for g in gens]
            drafts = impl.propose_batch([DraftRequest(s, g.ctx, k) for s, g, k in zip(batched, gens, ks)])
            for g, s, k, state, draft in zip(gens, alone, ks, generators, drafts):
                g.ctx.generator.set_state(state)
                ref = impl.propose(s, g.ctx, k)
                assert draft.token_ids.tolist() == ref.token_ids.tolist()
                assert (draft.probs is None) == (ref.probs is None) == (not sampled)
                if sampled:
                    torch.testing.assert_close(draft.probs, ref.probs, atol=1e-5, rtol=1e-4)
            for g, a, b in zip(gens, batched, alone):
                g.step()  # a plain step: the drafts were rejected, and the drafters catch up next time
                impl.commit(a, g.ctx, 1, 0)
                impl.commit(b, g.ctx, 1, 0)
    finally:
        for s in batched + alone:
            impl.end(s)
        for g in gens:
            g.close()
    if isinstance(impl, ModelDrafter):
        assert impl._pool is not None and impl._pool.num_free == impl._pool.num_slots  # end() gave the slots back


@pytest.mark.parametrize("mix", [[("other", 3)] * 4, [("medusa", 3), ("other", 2)] * 2 + [(PLAIN, 0)],
                                 [("eagle", 3), ("eagle", 2), ("medusa", 2), ("eagle", 4)]],
                         ids=["one-drafter", "two-drafters", "eagle"])
def test_requests_sharing_a_drafter_draft_in_one_call_and_decode_as_alone(
    with_features: SpecEngine, prompts: list[list[int]], mix, monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[str, list[int]] = {}
    for name in {d for d, _ in mix if d != PLAIN}:
        impl = with_features.drafters[name]
        real = impl.propose_batch

        def counted(requests, name=name, real=real):
            calls.setdefault(name, []).append(len(requests))  # Medusa's `propose` calls it too: 1
            return real(requests)

        monkeypatch.setattr(impl, "propose_batch", counted)
    batch = BatchEngine(with_features)
    gens = [batch.add(p, greedy()) for p in prompts[: len(mix)]]
    run_batch(batch, gens, {g: StepOrder(d, k) for g, (d, k) in zip(gens, mix)})
    for gen, prompt in zip(gens, prompts):
        assert_same_or_tie(with_features, prompt, gen.output_ids, with_features.generate(prompt, greedy()).token_ids)
    for name in calls:
        assert max(calls[name]) == sum(d == name for d, _ in mix)  # every request using it, in one call
    assert set(calls) == {d for d, _ in mix if d != PLAIN}
    for gen in gens:  # the drafted steps carry their share of the batched proposal's time
        assert all(s.draft_s > 0 for s in gen.steps if s.num_draft_tokens)
    other = with_features.drafters["other"]
    assert isinstance(other, ModelDrafter) and other._pool is not None
    assert other._pool.num_free == other._pool.num_slots
    assert other._pool.capacity == with_features.max_model_len  # slots as long as the target's context


@pytest.mark.parametrize("drafter", ["self", "medusa_case", "eagle_case"])
def test_sampled_requests_drafting_in_one_call_follow_the_target(
    with_features: SpecEngine, drafter: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampled request shares its drafter's batched proposal with a greedy one and another
    sampled one: it still draws from the target's distribution (chi-square over seeds)."""
    case = TwoTokenCase.of(with_features)
    impl = with_features.drafters[drafter]
    sizes: list[int] = []
    real = impl.propose_batch
    monkeypatch.setattr(impl, "propose_batch", lambda requests: sizes.append(len(requests)) or real(requests))

    stream = with_draws(with_features, "stream")  # rejection sampling

    def generate(seed: int):
        batch = BatchEngine(stream)
        gens = [batch.add(case.prompt, SamplingParams(seed=seed, **TWO_TOKEN_PARAMS)),
                batch.add(case.prompt, greedy(6)), batch.add(case.prompt, SamplingParams(max_tokens=6, seed=seed + 1))]
        run_batch(batch, gens, {g: StepOrder(drafter, 2) for g in gens})
        return gens[0].result()

    results = assert_follows_joint(case.joint, 300, generate)
    assert sizes.count(3) >= 300  # each run's first proposal was one call for all three
    assert sum(r.num_accepted_tokens for r in results) > 0  # drafts were accepted, so rejection ran on them


def test_a_failing_batch_proposal_leaves_its_requests_plain(
    with_features: SpecEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    def crash(requests):
        raise RuntimeError("drafter crashed")

    monkeypatch.setattr(with_features.drafters["medusa"], "propose_batch", crash)
    batch = BatchEngine(with_features)
    gens = [batch.add(p, greedy()) for p in prompts[:3]]
    run_batch(batch, gens, dict(zip(gens, [StepOrder("medusa", 3), StepOrder("medusa", 2), StepOrder("other", 2)])))
    for gen, prompt in zip(gens, prompts):
        assert_same_or_tie(with_features, prompt, gen.output_ids, with_features.generate(prompt, greedy()).token_ids)
    for gen in gens[:2]:
        assert gen.steps[0].fallback_reason == "drafter_error"
        assert not gen.result().drafters  # dropped for the rest of the request
    assert gens[2].result().drafters == ["other"]
