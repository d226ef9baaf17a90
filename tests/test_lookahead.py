"""LookaheadDrafter (Lookahead decoding): the window's tree and its Jacobi update, the n-gram pool
(from the prompt and from a suffix drafter's memory of served traffic), losslessness on an engine
(greedy alone and in a batch, sampled against the target's joint distribution), the router's
pricing of its rows."""

from __future__ import annotations

import pytest
import torch
from helpers import TWO_TOKEN_PARAMS, TwoTokenCase, assert_follows_joint, assert_same_or_tie, with_draws
from pydantic import ValidationError

from workers.config import EngineConfig, LookaheadDrafterConfig, NgramDrafterConfig, SuffixDrafterConfig, TreeConfig
from workers.drafters.base import DraftContext
from workers.drafters.lookahead import LookaheadDrafter, LookaheadState, NgramPool
from workers.drafters.suffix import SuffixDrafter
from workers.sampling import SamplingParams, make_generator

VOCAB = 50


def ctx(ids: list[int], domain: str | None = None) -> DraftContext:
    return DraftContext(list(ids), SamplingParams(), make_generator(0), max_len=len(ids) + 64, num_prompt=len(ids),
                        domain=domain)


def logits_for(tokens: list[int]) -> torch.Tensor:
    """[n, VOCAB] logits whose argmax at row i is tokens[i]."""
    out = torch.zeros(len(tokens), VOCAB)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 1.0
    return out


def test_the_draft_is_the_window_and_the_guesses_as_one_tree() -> None:
    drafter = LookaheadDrafter(LookaheadDrafterConfig(window=3, ngram=3, guesses=2))
    c = ctx([9, 9, 7])
    state = LookaheadState([[1, 2, 3], [4, 5, 6]], NgramPool(2))
    state.pool.add(7, (1, 8))  # shares its first token with the window's first column
    state.pool.add(7, (20, 21))
    state.pool.add(6, (30, 31))  # keyed by another token: not this step's
    draft = drafter.propose(state, c, 2)
    pairs = list(zip(draft.token_ids.tolist(), draft.tree.parents))
    # guesses first (the latest first), then level 0 left to right, each column upwards
    assert pairs == [(20, -1), (21, 0), (1, -1), (8, 2), (4, 2), (2, 2), (5, 5), (3, 5), (6, 7)]
    assert state.columns == [4, 6, 8]  # the node atop each column
    assert draft.tree.depths[8] == 4  # column 2: 1, 2, 3 then 6, at positions root + 1..4
    # k caps the guesses' length
    assert drafter.propose(state, c, 1).token_ids.tolist()[:2] == [20, 1]
    # a step that verifies only a tree's leading chain (a guided request): the latest guess leads
    # it, the other would never be read, so it is not drafted
    c.exact_tree = False
    draft = drafter.propose(state, c, 2)
    pairs = list(zip(draft.token_ids.tolist(), draft.tree.parents))
    assert pairs == [(20, -1), (21, 0), (1, -1), (4, 2), (2, 2), (5, 4), (3, 4), (6, 6)]
    assert draft.tree.leading_chain == 2 and state.columns == [3, 5, 7]


def test_reading_logits_fills_the_window_then_collects_ngrams() -> None:
    drafter = LookaheadDrafter(LookaheadDrafterConfig(window=2, ngram=3, guesses=4, pool_from_prompt=False))
    c = ctx([5, 6, 7])
    state = drafter.begin(c)
    assert len(state.levels) == 1 and set(state.levels[0]) <= {5, 6, 7}
    state.levels = [[1, 2]]
    draft = drafter.propose(state, c, 2)  # nodes 1, 2 (no guesses yet)
    drafter.read_logits(state, c, logits_for([0, 11, 12]))  # root, then the column tops
    assert state.levels == [[1, 2], [11, 12]] and state.pool.grams == {}  # still filling
    draft = drafter.propose(state, c, 2)  # 1, 11 | 2, 12 above 1
    assert list(zip(draft.token_ids.tolist(), draft.tree.parents)) == [(1, -1), (11, 0), (2, 0), (12, 2)]
    drafter.read_logits(state, c, logits_for([0, 0, 21, 0, 22]))
    assert state.levels == [[11, 12], [21, 22]]  # the oldest level dropped
    assert state.pool.after(1) == [(11, 21)] and state.pool.after(2) == [(12, 22)]
    # a tree cut by the token budget: the window waits for a whole step
    drafter.propose(state, c, 2)
    drafter.read_logits(state, c, logits_for([0, 0]))
    assert state.levels == [[11, 12], [21, 22]]


def test_the_pool_keeps_the_latest_guesses_per_token() -> None:
    pool = NgramPool(2)
    for rest in [(1,), (2,), (1,), (3,)]:
        pool.add(0, rest)
    assert pool.after(0) == [(3,), (1,)]
    NgramPool(0).add(0, (1,))  # no guesses: nothing kept, nothing fails


def test_pool_from_prompt() -> None:
    drafter = LookaheadDrafter(LookaheadDrafterConfig(ngram=3, guesses=4, pool_from_prompt=True))
    state = drafter.begin(ctx([4, 5, 6, 4, 7, 8]))
    assert state.pool.after(4) == [(7, 8), (5, 6)]


@pytest.mark.parametrize("tree", [None, TreeConfig(topk=2, nodes=4)], ids=["chain", "tree"])
def test_pool_from_traffic_guesses_what_the_domain_served_first(tree: TreeConfig | None) -> None:
    suffix = SuffixDrafter(SuffixDrafterConfig(tree=tree))
    suffix.caches.add("sql", [40, 41, 42, 43, 44])
    drafter = LookaheadDrafter(LookaheadDrafterConfig(window=1, ngram=3, guesses=2, pool_from_prompt=False), suffix)
    c = ctx([7, 40, 41], domain="sql")
    state = drafter.begin(c)
    state.pool.add(41, (9, 9))  # a Jacobi n-gram: guessed after the traffic's
    draft = drafter.propose(state, c, 2)
    assert list(zip(draft.token_ids.tolist(), draft.tree.parents))[:4] == [(42, -1), (43, 0), (9, -1), (9, 2)]
    # another domain's request finds nothing of it
    other = ctx([7, 40, 41], domain="chat")
    assert 42 not in drafter.propose(drafter.begin(other), other, 2).token_ids.tolist()


def test_pool_from_traffic_must_name_a_suffix_drafter() -> None:
    lookahead = LookaheadDrafterConfig(pool_from_traffic="suffix")
    assert EngineConfig(drafters=[SuffixDrafterConfig(), lookahead]).drafters[1] == lookahead
    for drafters in ([lookahead], [NgramDrafterConfig(name="suffix"), lookahead]):
        with pytest.raises(ValidationError, match="pool_from_traffic 'suffix' names no suffix drafter"):
            EngineConfig(drafters=drafters)


def test_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="ngram"):
        LookaheadDrafterConfig(ngram=1)
    assert LookaheadDrafterConfig(window=4, ngram=3, guesses=4).size(1) == 4 * 2 + 4
    assert LookaheadDrafterConfig(window=4, ngram=3, guesses=4).size(5) == 4 * 2 + 4 * 2
    assert LookaheadDrafterConfig(window=4, ngram=3, guesses=4).size(5, exact_tree=False) == 4 * 2 + 1 * 2
    assert LookaheadDrafterConfig().size(0) == 0


def lookahead_engine(tiny_config, **kw: object):  # -> SpecEngine
    from workers.engine import SpecEngine

    drafters = [*tiny_config.drafters, LookaheadDrafterConfig(**kw)]
    return SpecEngine.from_config(tiny_config.model_copy(update={"drafters": drafters}))


@pytest.mark.parametrize("shape", [{}, {"window": 6, "ngram": 2, "guesses": 2},
                                   {"window": 3, "ngram": 5, "guesses": 6, "pool_from_prompt": True}],
                         ids=["default", "bigrams", "5-grams-prompt-pool"])
def test_greedy_output_is_plain_output(tiny_config, shape) -> None:
    engine = lookahead_engine(tiny_config, **shape)
    for text in ["Count: one two three four five", "Tell me a story about a cat.", "hi"]:
        prompt = engine.encode(text)
        params = SamplingParams(max_tokens=40)
        result = engine.generate(prompt, params, "lookahead", 3)
        assert_same_or_tie(engine, prompt, result.token_ids, engine.generate(prompt, params).token_ids)
        assert result.drafters == ["lookahead"]


def test_guesses_the_target_agrees_with_are_accepted(tiny_config) -> None:
    """A pool holding the plain continuation's n-grams (and a wrong one beside each): the tree
    keeps the right guess's path, so steps emit several tokens, and the output stays plain's."""
    engine = lookahead_engine(tiny_config, window=2, ngram=4, guesses=2)
    prompt, params = engine.encode("Tell me a story about a cat."), SamplingParams(max_tokens=40)
    plain = engine.generate(prompt, params).token_ids
    drafter = engine.drafters["lookahead"]
    begin = drafter.begin

    def seeded(c: DraftContext) -> LookaheadState:
        state = begin(c)
        text = [*prompt, *plain]
        for j in range(len(prompt), len(text) - 3):
            state.pool.add(text[j - 1], tuple(text[j : j + 3]))
            state.pool.add(text[j - 1], (text[j], text[j + 1] + 1, 0))
        return state

    drafter.begin = seeded  # type: ignore[method-assign]
    result = engine.generate(prompt, params, "lookahead", 3)
    assert result.token_ids == plain
    assert result.num_accepted_tokens >= len(plain) // 2 and result.accepted_per_position[2] > 0


def test_guesses_from_traffic_are_accepted_and_the_output_stays_plain(tiny_config) -> None:
    """A domain's second request of the same prompt: the suffix memory holds the first's output,
    so the guesses follow it; greedy output is plain output either way."""
    lookahead = LookaheadDrafterConfig(window=1, ngram=4, guesses=1, pool_from_prompt=False, pool_from_traffic="suffix")
    drafters = [*tiny_config.drafters, SuffixDrafterConfig(), lookahead]
    from workers.engine import SpecEngine

    engine = SpecEngine.from_config(tiny_config.model_copy(update={"drafters": drafters}))
    assert engine.drafters["lookahead"].traffic is engine.drafters["suffix"]
    prompt, params = engine.encode("Tell me a story about a cat."), SamplingParams(max_tokens=40)
    plain = engine.generate(prompt, params).token_ids
    first = engine.generate(prompt, params, "lookahead", 3, domain="story")
    second = engine.generate(prompt, params, "lookahead", 3, domain="story")
    assert first.token_ids == second.token_ids == plain
    assert second.num_accepted_tokens >= len(plain) // 2 > first.num_accepted_tokens


def test_batched_with_other_drafters_stays_plain(tiny_config) -> None:
    from workers.batch import BatchEngine
    from workers.engine import StepOrder

    engine = lookahead_engine(tiny_config)
    prompts = [engine.encode(t) for t in ["Count: one two three", "Write a haiku", "hi there", "List colours"]]
    batch = BatchEngine(engine)
    params = SamplingParams(max_tokens=30)
    gens = [batch.add(p, params) for p in prompts]
    orders = dict(zip(gens, [StepOrder("lookahead", 2), StepOrder("ngram", 4), StepOrder("lookahead", 1),
                             StepOrder()]))
    while batch.num_unfinished:
        step = batch.step({g: orders[g] for g in batch.schedule()})
        assert not step.failed
    for gen, prompt in zip(gens, prompts):
        assert_same_or_tie(engine, prompt, gen.output_ids, engine.generate(prompt, params).token_ids)
        gen.close()


def test_sampled_output_follows_target_distribution(tiny_config) -> None:
    """The tree's multi-candidate rejection rule, with the two likeliest first tokens guessed (both
    the accept and the reject path taken) beside the window."""
    engine = with_draws(lookahead_engine(tiny_config, window=2, ngram=3, guesses=2), "stream")
    case = TwoTokenCase.of(engine)
    a, b, _ = case.draft_vocab(engine.target.model.info.vocab_size)
    drafter = engine.drafters["lookahead"]
    begin = drafter.begin

    def seeded(c: DraftContext) -> LookaheadState:
        state = begin(c)
        state.pool.add(c.token_ids[-1], (a, a))
        state.pool.add(c.token_ids[-1], (b, a))
        return state

    drafter.begin = seeded  # type: ignore[method-assign]
    results = assert_follows_joint(case.joint, 800, lambda seed: engine.generate(
        case.prompt, SamplingParams(seed=seed, **TWO_TOKEN_PARAMS), "lookahead", 2))
    accepted = sum(r.num_accepted_tokens for r in results)
    assert 0 < accepted < len(results) * 2


def test_the_router_prices_the_window_and_guesses_as_a_tree(tiny_config) -> None:
    from workers.routing import tree_sizes

    engine = lookahead_engine(tiny_config, window=3, ngram=4, guesses=2)
    sizes = tree_sizes(engine)["lookahead"]
    assert sizes[:5] == (0, 9 + 2, 9 + 4, 9 + 6, 9 + 6)
    assert len(sizes) == engine.config.max_draft_len + 1


def test_a_backend_without_trees_refuses_it_by_name(tiny_config) -> None:
    from workers.target import ModelLoadError

    target = tiny_config.target.model_copy(update={"backend": "hf"})
    with pytest.raises(ModelLoadError, match="'lookahead'.*fast Llama"):
        lookahead_engine(tiny_config.model_copy(update={"target": target, "drafters": []}))
