"""SuffixDrafter (suffix decoding): matching, frequency-ranked continuations, the per-domain
caches and their token budget, learning from finished requests, losslessness on an engine."""

from __future__ import annotations

import random

import pytest
from helpers import TWO_TOKEN_PARAMS, TwoTokenCase, assert_follows_joint, with_draws
from pydantic import ValidationError

from workers.config import NgramDrafterConfig, SuffixDrafterConfig, TreeConfig
from workers.drafters.base import DraftContext
from workers.drafters.ngram import NgramDrafter
from workers.drafters.suffix import SuffixCaches, SuffixDrafter
from workers.drafters.token_index import SEPARATOR, TokenIndex
from workers.sampling import PositionDraws, SamplingParams, make_generator


def ctx(ids: list[int], domain: str | None = None, num_prompt: int = 0) -> DraftContext:
    return DraftContext(ids, SamplingParams(), make_generator(0), max_len=len(ids) + 128,
                        num_prompt=num_prompt, domain=domain)


def propose(drafter: SuffixDrafter, ids: list[int], k: int, domain: str | None = None) -> list[int]:
    c = ctx(list(ids), domain)
    draft = drafter.propose(drafter.begin(c), c, k)
    assert draft.probs is None and draft.tree is None  # deterministic chain
    return draft.token_ids.tolist()


def make(**kw: object) -> SuffixDrafter:
    return SuffixDrafter(SuffixDrafterConfig(**kw))


def test_own_context_agrees_with_prompt_lookup_on_single_occurrences() -> None:
    """With every n-gram occurring once, the most frequent continuation is the only one: the
    proposal is prompt lookup's, up to the length the match allows."""
    rng = random.Random(0)
    drafter, ngram = make(min_n=2, max_spec_factor=100.0), NgramDrafter(NgramDrafterConfig())
    for _ in range(200):
        ids = [rng.randrange(12) for _ in range(rng.randrange(1, 30))]
        c = ctx(list(ids))
        expected = ngram.propose(ngram.begin(c), c, 5).token_ids.tolist()
        got = propose(drafter, ids, 5)
        if len(set(map(tuple, zip(ids, ids[1:], ids[2:])))) == len(ids) - 2:  # no repeated 3-gram
            assert got == expected, ids


def test_most_frequent_continuation_wins_over_the_latest() -> None:
    # (1, 2), each time after another token (matches of equal length), was followed by 3 twice,
    # then once by 9 (the latest)
    ids = [5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 9, 8, 1, 2]
    assert propose(make(), ids, 1) == [3]
    # a tie goes to the latest occurrence, as in prompt lookup
    assert propose(make(), [5, 1, 2, 3, 6, 1, 2, 9, 8, 1, 2], 1) == [9]


def test_the_longest_match_decides() -> None:
    # (0, 1, 2) occurred once, followed by 9; (1, 2) more often, followed by 3
    ids = [0, 1, 2, 9, 5, 1, 2, 3, 6, 1, 2, 3, 0, 1, 2]
    assert propose(make(), ids, 1) == [9]


def test_draft_length_follows_the_match_length() -> None:
    ids = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 0, 7, 8]  # a 2-token match
    assert propose(make(max_spec_factor=1.0), ids, 8) == [9, 10]
    assert propose(make(max_spec_factor=2.0), ids, 8) == [9, 10, 11, 12]
    assert propose(make(max_spec_factor=1.0, max_spec_offset=1.0), ids, 8) == [9, 10, 11]
    assert propose(make(max_spec_factor=100.0), ids, 3) == [9, 10, 11]  # never more than k


def test_stops_where_estimated_acceptance_falls_below_min_token_prob() -> None:
    # (0, 1, 2, 3) then 4 in all three occurrences, then 6, 7 or 8: a third each
    ids = [0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 7, 0, 1, 2, 3, 4, 8, 0, 1, 2, 3]
    assert propose(make(max_spec_factor=10.0, min_token_prob=0.4), ids, 5) == [4]
    # past the branch (1/3, the latest), one occurrence goes on: the estimate stays 1/3
    assert propose(make(max_spec_factor=10.0, min_token_prob=0.3), ids, 5) == [4, 8, 0, 1, 2]


def test_learns_from_finished_requests_of_the_same_domain_only() -> None:
    drafter = make()
    earlier = [100, 101, 102, 103, 104, 105, 106]
    prompt = [7, 8, 9]
    drafter.learn(ctx(prompt + earlier, "code", num_prompt=len(prompt)))
    assert drafter.memory().tokens == {"code": len(earlier) + 1}  # the output and its separator
    now = [50, 51, 100, 101, 102]
    assert propose(drafter, now, 4, "code") == [103, 104, 105, 106]
    assert propose(drafter, now, 4, "chat") == []  # another domain's memory
    assert propose(drafter, now, 4, None) == []  # not traffic: no memory read
    drafter.learn(ctx(prompt + [1, 2], None, num_prompt=len(prompt)))  # nor fed
    assert drafter.memory().tokens == {"code": len(earlier) + 1}
    # the prompt is not learned: its n-grams match nothing
    assert propose(drafter, [0, 7, 8], 4, "code") == []


def test_a_sampled_request_draws_its_chain_from_the_continuations_frequencies() -> None:
    """(1, 2) went on with 3 twice and 9 once: a sampled request's draft is 3 about two times in
    three, its first row of q (2/3, 1/3); past 3, the two occurrences went on with 6 and 7, a half
    each. Greedy requests, `sample_drafts: false` and a drafter that does not know the vocabulary
    propose the likeliest."""
    ids = [5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 9, 8, 1, 2]
    drafter = SuffixDrafter(SuffixDrafterConfig(max_spec_factor=1.0, sample_drafts=True), vocab_size=16)
    sampled = SamplingParams(temperature=1.0)
    drafts = []
    for seed in range(600):
        c = DraftContext(list(ids), sampled, make_generator(seed), max_len=64)
        drafts.append(drafter.propose(drafter.begin(c), c, 8))
    firsts = [d.token_ids[0].item() for d in drafts]
    assert set(firsts) == {3, 9} and abs(firsts.count(3) / len(firsts) - 2 / 3) < 0.06  # ~4.4 sigma
    for d in drafts:
        assert d.tree is None and d.probs is not None and d.probs.shape == (d.token_ids.shape[0], 16)
        assert d.token_ids.shape[0] == 2  # the likeliest chain's length (max_spec_factor 1, a 2-token match)
        assert d.probs[0].tolist() == pytest.approx([2 / 3 if t == 3 else 1 / 3 if t == 9 else 0 for t in range(16)])
        q = d.probs[1, d.token_ids[1]].item()
        assert q == (0.5 if d.token_ids[0] == 3 else 1.0)  # after 9, the one occurrence's 8
    assert {d.token_ids[1].item() for d in drafts if d.token_ids[0] == 3} == {6, 7}
    # routing scores a drawn draft's shadow by the likeliest chain (a tie: the latest occurrence's)
    assert all(d.likeliest == [3, 7] and d.scored_ids == [3, 7] for d in drafts)
    greedy = DraftContext(list(ids), SamplingParams(), make_generator(0), max_len=64)
    for other in (drafter, make(max_spec_factor=1.0, sample_drafts=True)):
        assert other.propose(other.begin(greedy), greedy, 8).probs is None
    fixed = SuffixDrafter(SuffixDrafterConfig(max_spec_factor=1.0), vocab_size=16)  # the default: the likeliest
    c = DraftContext(list(ids), sampled, make_generator(0), max_len=64)
    assert fixed.propose(fixed.begin(c), c, 8).probs is None


def test_a_seeded_request_races_its_chain_on_the_draws_the_target_draws_with() -> None:
    """With keyed draws each drafted token is the race of the continuations' counts at its
    position (the exponentials the target's own draw there races on), so a seed's draft is the
    same every time, 3 about two times in three over seeds; no q rides along (the step matches
    the draws exactly) and the shadow is the draft itself. Without `sample_drafts`: the likeliest."""
    ids = [5, 1, 2, 3, 6, 1, 2, 3, 7, 1, 2, 9, 8, 1, 2]
    drafter = SuffixDrafter(SuffixDrafterConfig(max_spec_factor=1.0, sample_drafts=True), vocab_size=16)
    fixed = SuffixDrafter(SuffixDrafterConfig(max_spec_factor=1.0), vocab_size=16)
    params = SamplingParams(temperature=0.7)
    firsts = []
    for seed in range(600):
        draws = PositionDraws(seed)
        c = DraftContext(list(ids), params, make_generator(seed), max_len=64, draws=draws)
        d = drafter.propose(drafter.begin(c), c, 8)
        assert d.probs is None and d.scored_ids == d.token_ids.tolist()
        assert d.token_ids.tolist() == drafter.propose(drafter.begin(c), c, 8).token_ids.tolist()
        first, second = d.token_ids.tolist()
        assert first == draws.race([3, 9], [2, 1], len(ids))
        assert second == (draws.race([7, 6], [1, 1], len(ids) + 1) if first == 3 else 8)
        assert fixed.propose(fixed.begin(c), c, 8).token_ids.tolist() == [3, 7]
        firsts.append(first)
    assert abs(firsts.count(3) / len(firsts) - 2 / 3) < 0.06  # ~4.4 sigma


def test_a_match_never_spans_two_requests() -> None:
    drafter = make(min_n=2)
    drafter.learn(ctx([1, 2, 3], "d"))
    drafter.learn(ctx([4, 5, 6], "d"))
    assert propose(drafter, [9, 3, 4], 3, "d") == []  # (3, 4) only across the boundary
    assert propose(drafter, [9, 2, 3], 3, "d") == []  # nothing followed 3 in its request
    assert propose(drafter, [9, 4, 5], 3, "d") == [6]


def test_salted_requests_read_and_feed_their_salt_s_memory_alone() -> None:
    drafter = make(min_n=2)
    salted = ctx([1, 2, 3, 4, 5], "d")
    salted.cache_salt = "tenant-a"
    drafter.learn(salted)
    assert propose(drafter, [9, 2, 3], 3, "d") == []  # unsalted: nothing learnt
    other = ctx([9, 2, 3], "d")
    other.cache_salt = "tenant-b"
    assert drafter.propose(drafter.begin(other), other, 3).token_ids.tolist() == []
    same = ctx([9, 2, 3], "d")
    same.cache_salt = "tenant-a"
    assert drafter.propose(drafter.begin(same), same, 3).token_ids.tolist() == [4, 5]
    assert drafter.memory().tokens == {"d": 6}  # reported per domain, over its salts


def test_budget_evicts_the_oldest_requests_across_domains() -> None:
    caches = SuffixCaches(2, 4, max_tokens=12)
    caches.add("a", [1, 2, 3, 4, 5])  # 6 with its separator
    caches.add("b", [6, 7, 8, 9, 10])  # 12
    assert caches.sizes() == {"a": 6, "b": 6}
    caches.add("a", [11, 12, 13])  # 16 > 12: the oldest ("a"'s first) goes
    assert caches.sizes() == {"a": 4, "b": 6} and caches.num_tokens == 10
    a = caches.index("a")
    assert all(p >= a.start for ps in a.after.values() for p in ps)
    assert (1, 2) not in a.after and a.after[(11, 12)] == [a.start + 2]
    caches.add("c", list(range(20, 40)))  # longer than the budget: its tail alone
    assert caches.sizes() == {"c": 12} and caches.num_tokens == 12
    caches.add("c", [1, 2, 3], salt="s")  # salts share the budget: the oldest request of any goes
    assert caches.sizes() == {"c": 4} and caches.index("c") is None and len(caches.index("c", "s")) == 4
    assert SuffixCaches(2, 4, max_tokens=0).sizes() == {}


def test_index_matches_a_brute_force_search() -> None:
    rng = random.Random(1)
    for _ in range(100):
        index = TokenIndex(2, 3)
        corpus: list[int] = []
        for _ in range(rng.randrange(1, 5)):
            doc = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            index.extend([*doc, SEPARATOR])
            corpus += [*doc, SEPARATOR]
        cut = rng.randrange(len(corpus))
        while cut and corpus[cut - 1] != SEPARATOR:  # evict whole requests
            cut -= 1
        index.evict(cut)
        context = [rng.randrange(5) for _ in range(rng.randrange(2, 6))]
        matches = index.matches(context, max_depth=8, max_occurrences=1000)
        want = []
        for n in (3, 2):
            want = [j for j in range(cut + n, len(corpus)) if corpus[j] != SEPARATOR
                    and corpus[j - n : j] == context[-n:] and len(context) >= n]
            if want:
                break
        assert sorted(m.pos for m in matches) == want
        for m in matches:
            assert corpus[m.pos - m.length : m.pos] == context[-m.length:]


def test_config_is_checked() -> None:
    with pytest.raises(ValidationError, match="min_n"):
        SuffixDrafterConfig(min_n=5, max_n=3)
    with pytest.raises(ValidationError, match="min_token_prob"):
        SuffixDrafterConfig(min_token_prob=1.5)


def suffix_engine(tiny_config, **kw: object):  # -> SpecEngine with the suffix drafter
    from workers.engine import SpecEngine

    drafters = [*tiny_config.drafters, SuffixDrafterConfig(**kw)]
    return SpecEngine.from_config(tiny_config.model_copy(update={"drafters": drafters}))


def test_tree_holds_the_likeliest_branches() -> None:
    # (1, 2) then 3 4 8 twice, 5 6 once: the chain follows 3 4 8; a tree also offers 5 (a third)
    ids = [7, 1, 2, 3, 4, 8, 1, 2, 5, 6, 9, 1, 2, 3, 4, 8, 0, 1, 2]
    drafter = make(max_spec_factor=10.0, tree=TreeConfig(topk=2, nodes=4))
    c = ctx(ids)
    draft = drafter.propose(drafter.begin(c), c, 3)
    assert draft.tree is not None and draft.probs is None
    assert list(zip(draft.token_ids.tolist(), draft.tree.parents)) == [(3, -1), (4, 0), (8, 1), (5, -1)]
    assert propose(make(max_spec_factor=10.0), ids, 3) == [3, 4, 8]
    # a step that verifies only a chain (a guided request, DraftContext.exact_tree): the chain
    c.exact_tree = False
    draft = drafter.propose(drafter.begin(c), c, 3)
    assert draft.tree is None and draft.token_ids.tolist() == [3, 4, 8]


@pytest.mark.parametrize("tree", [None, {"topk": 3, "nodes": 8}], ids=["chain", "tree"])
def test_greedy_output_is_plain_output_and_memory_is_learned(tiny_config, tree) -> None:
    engine = suffix_engine(tiny_config, tree=tree)
    prompts = [engine.encode(f"Write the list {i} {i} {i}, then repeat it.") for i in range(3)]
    params = SamplingParams(max_tokens=40)
    for prompt in prompts * 2:  # the second round reads the first round's outputs
        plain = engine.generate(prompt, params).token_ids
        result = engine.generate(prompt, params, "suffix", 6, domain="chat")
        assert result.token_ids == plain
    assert engine.drafters["suffix"].memory().tokens["chat"] > 0
    # the repeated requests drafted from the memory of the first round
    assert result.num_accepted_tokens > 0


def test_seeded_sampled_output_is_plain_samplings_when_drafts_race(tiny_config) -> None:
    """A seeded request under keyed draws (the default) whose suffix drafts race the
    continuations' counts: every output is plain sampling's with the same seed, and the drafts
    read from the first round's outputs are accepted."""
    engine = suffix_engine(tiny_config, sample_drafts=True)
    prompts = [engine.encode(f"Write the list {i} {i} {i}, then repeat it.") for i in range(3)]
    accepted = 0
    for prompt in prompts * 2:
        for seed in (1, 2):  # each seed's output joins the memory the other seed's request reads
            params = SamplingParams(max_tokens=40, temperature=0.7, seed=seed)
            plain = engine.generate(prompt, params).token_ids
            result = engine.generate(prompt, params, "suffix", 6, domain="chat")
            assert result.token_ids == plain
            accepted += result.num_accepted_tokens
    assert accepted > 0


@pytest.mark.parametrize("sample_drafts", [True, False])
def test_sampled_output_follows_target_distribution(tiny_config, sample_drafts: bool) -> None:
    """Rejection sampling against the continuations' frequencies (a drawn chain) or a one-hot q
    (the likeliest): the first two sampled tokens follow the target's joint distribution while
    the drafter proposes from its domain memory (both the accept and the reject path taken; a
    drawn draft also puts mass on a token the target never samples)."""
    engine = with_draws(suffix_engine(tiny_config, sample_drafts=sample_drafts), "stream")
    case = TwoTokenCase.of(engine)
    a, b, never = case.draft_vocab(engine.target.model.info.vocab_size)
    drafter = engine.drafters["suffix"]
    for first in (a, a, b, never):  # the memory: a after the prompt, more often than b
        drafter.learn(ctx([*case.prompt, first], "d"))
    results = assert_follows_joint(case.joint, 800, lambda seed: engine.generate(
        case.prompt, SamplingParams(seed=seed, **TWO_TOKEN_PARAMS), "suffix", 1, domain="d"))
    assert all(r.steps[0].num_draft_tokens == 1 for r in results)  # a, drafted every time
    accepted = sum(r.num_accepted_tokens for r in results)
    assert 0 < accepted < len(results)


def test_routed_requests_feed_their_domain_memory_and_stay_lossless(tiny_config) -> None:
    """Every request the router serves joins its domain's memory, whatever drafter ran it, alone
    and under continuous batching; the policy's cheap suffix drafter keeps outputs plain's."""
    from policies.schema import load_policy
    from policies.stats import MemoryStats
    from workers.routing import RoutedBatch, Router, Speculation, generate

    engine = suffix_engine(tiny_config)
    policy = load_policy({
        "version": "t", "default_domain": "chat",
        "domains": {"chat": {"drafters": ["suffix", "none"], "k_min": 1, "k_max": 6, "priors": {"suffix": 0.6},
                             "cheap_first": True},
                    "code": {"drafters": ["ngram", "none"], "priors": {"ngram": 0.5}}},
        "classifier": {"rules": []},
    })
    router = Router(engine, policy, MemoryStats(), seed=0)
    params = SamplingParams(max_tokens=24)
    prompts = [engine.encode(f"Repeat after me: {w} {w} {w}") for w in ("alpha", "beta", "gamma")]
    drafter = engine.drafters["suffix"]
    for prompt in prompts:
        result = generate(router, prompt, params, "text", Speculation(domain="code"))  # suffix not allowed there
        assert result.token_ids == engine.generate(prompt, params).token_ids
    learned = drafter.memory().tokens
    assert set(learned) == {"code"} and learned["code"] > 0

    batch = RoutedBatch(router)
    running = [batch.add(p, params, "text", Speculation(domain="chat")) for p in prompts * 2]
    while batch.num_running or batch.num_waiting:
        batch.step()
    for routed, prompt in zip(running, prompts * 2):
        assert routed.result().token_ids == engine.generate(prompt, params).token_ids
        routed.close()
    assert drafter.memory().tokens["chat"] > 0
