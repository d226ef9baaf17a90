"""vLLM's bans under speculation (`allowed_token_ids`, `min_tokens`, `bad_words`), min-p, and the
stop options (`include_stop_str_in_output`, stop strings after `min_tokens`, `skip_special_tokens`):
each verified row is masked by the history on its own path, so greedy output equals plain
decoding's with the same settings and sampled output follows the masked distribution."""

from __future__ import annotations

import pytest
import torch
from helpers import TWO_TOKEN_PARAMS, TwoTokenCase, assert_follows_joint

from workers.bans import Bans, ban
from workers.batch import BatchEngine
from workers.config import PLAIN
from workers.drafters.base import Draft
from workers.engine import SpecEngine, StepOrder
from workers.result import RequestError
from workers.sampling import SamplingParams, probs_from_logits
from workers.structured import OutputFormat
from workers.tree import DraftTree

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
NO_DRAFT = torch.zeros(0, dtype=torch.long)


@pytest.fixture(scope="module")
def engine(self_drafting_engine: SpecEngine) -> SpecEngine:
    return self_drafting_engine


@pytest.fixture(scope="module")
def reference(engine: SpecEngine) -> list[int]:
    """Plain decoding's 40 tokens after TEXT, without bans."""
    return engine.generate(engine.encode(TEXT), SamplingParams(max_tokens=40, ignore_eos=True)).token_ids


def test_ban_masks_each_row_by_its_own_history() -> None:
    logits = torch.zeros(4, 8)
    bans = Bans.of(SamplingParams(min_tokens=3, bad_words=((1, 2), (5,))), stop_ids={7}, vocab_size=8)
    chain = DraftTree.chain(3).input_mask()[:, 1:]
    out = ban(logits, bans, [4, 1], torch.tensor([2, 1, 3]), chain)
    banned = [sorted(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in out]
    # row r follows the output [4, 1] and the draft's first r tokens: 2 is banned after a 1, 5
    # always, the stop token 7 while fewer than 3 tokens precede the row
    assert banned == [[2, 5, 7], [5], [2, 5], [5]]
    assert logits.eq(0).all()  # the forward's logits stay as they were
    tree = DraftTree((-1, -1, 0))  # two candidates for the first position, one child of the first
    out = ban(logits, bans, [4], torch.tensor([1, 6, 3]), tree.input_mask()[:, 1:])
    banned = [sorted(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in out]
    assert banned == [[5, 7], [2, 5, 7], [5, 7], [5]]  # node 1 (a 6) is not on node 2's path


def test_ban_keeps_only_the_allowed_tokens() -> None:
    bans = Bans.of(SamplingParams(allowed_token_ids=frozenset({1, 3})), stop_ids=set(), vocab_size=5)
    out = ban(torch.zeros(2, 5), bans, [], NO_DRAFT, torch.zeros(2, 0, dtype=torch.bool))
    assert (out != float("-inf")).nonzero()[:, 1].tolist() == [1, 3, 1, 3]


def _settings(reference: list[int]) -> dict[str, dict]:
    """Each setting changes plain decoding's output within its 40 tokens (the test checks)."""
    return {
        "min_tokens": {"min_tokens": 20, "extra_stop_token_ids": frozenset({reference[5]})},
        "bad_words": {"bad_words": ((reference[3], reference[4]), (reference[12],))},
        "allowed_token_ids": {"allowed_token_ids": frozenset(range(300)) | set(reference) - {reference[8]}},
    }


@pytest.mark.parametrize("drafter", ["ngram", "self", "self_tree"])
@pytest.mark.parametrize("setting", ["min_tokens", "bad_words", "allowed_token_ids"])
def test_greedy_output_with_bans_equals_plain_decodings(
    engine: SpecEngine, reference: list[int], drafter: str, setting: str,
) -> None:
    ids = engine.encode(TEXT)
    params = SamplingParams(max_tokens=40, **_settings(reference)[setting])
    plain = engine.generate(ids, params)
    assert plain.token_ids != reference[: len(plain.token_ids)] or len(plain.token_ids) != 40
    if setting == "min_tokens":
        assert len(plain.token_ids) >= 20 and reference[5] not in plain.token_ids[:20]
    out = engine.generate(ids, params, drafter, 3)
    assert out.token_ids == plain.token_ids and out.finish_reason == plain.finish_reason
    if drafter != "ngram":
        assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # kept and rejected drafts


@pytest.mark.parametrize("setting", ["min_tokens", "bad_words", "allowed_token_ids"])
def test_a_draft_of_plain_decodings_tokens_is_accepted_whole(
    engine: SpecEngine, reference: list[int], setting: str,
) -> None:
    """Rows after drafted tokens see them: the bad word's first token is drafted at position 3 of
    a 7-token step, and the row after it must ban the word's end."""
    ids = engine.encode(TEXT)
    params = SamplingParams(max_tokens=40, **_settings(reference)[setting])
    plain = engine.generate(ids, params).token_ids
    gen = engine.start(ids, params)
    while not gen.finished:
        draft = plain[len(gen.output_ids) :][: gen.clip(6)]
        stats = gen.run(StepOrder("ngram", 6, draft=Draft(torch.tensor(draft))))
        assert stats.num_accepted == len(draft)
    gen.close()
    assert gen.output_ids == plain


def test_a_drafted_bad_word_is_cut_before_its_last_token(engine: SpecEngine, reference: list[int]) -> None:
    ids = engine.encode(TEXT)
    params = SamplingParams(max_tokens=40, bad_words=((reference[3], reference[4]),))
    gen = engine.start(ids, params)
    gen.run(StepOrder("ngram", 2, draft=Draft(torch.tensor(reference[:2]))))
    stats = gen.run(StepOrder("ngram", 4, draft=Draft(torch.tensor(reference[3:7]))))
    assert stats.num_accepted == 1 and gen.output_ids[3] == reference[3] and gen.output_ids[4] != reference[4]
    gen.close()


def test_requests_with_bans_in_a_batch_are_each_their_own(engine: SpecEngine, reference: list[int]) -> None:
    ids = engine.encode(TEXT)
    params = [SamplingParams(max_tokens=30, **s) for s in _settings(reference).values()]
    expected = [engine.generate(ids, p).token_ids for p in params]
    batch = BatchEngine(engine)
    gens = [batch.add(ids, p) for p in params]
    orders = [StepOrder("self", 3), StepOrder("self_tree", 2), StepOrder(PLAIN)]
    while batch.num_unfinished:
        step = batch.step({g: orders[gens.index(g)] for g in batch.schedule()})
        assert not step.failed
    assert [g.output_ids for g in gens] == expected


def _masked_reference(logits: torch.Tensor, output: list[int], params: SamplingParams, stop: int) -> torch.Tensor:
    """The distribution plain decoding samples from after `output`, banned token by token."""
    logits = logits.clone()
    if params.allowed_token_ids is not None:
        outside = torch.ones_like(logits, dtype=torch.bool)
        outside[sorted(params.allowed_token_ids)] = False
        logits[outside] = float("-inf")
    if len(output) < params.min_tokens:
        logits[stop] = float("-inf")
    for word in params.bad_words:
        if tuple(output[len(output) - len(word) + 1 :]) == word[:-1]:
            logits[word[-1]] = float("-inf")
    return probs_from_logits(logits[None], params)[0]


@pytest.mark.parametrize("drafter", [PLAIN, "self", "self_tree"])
def test_sampled_output_follows_the_masked_distribution(engine: SpecEngine, drafter: str) -> None:
    """The case's likeliest pair is a bad word, its likeliest second token a stop token before
    min_tokens, one of its first tokens outside the allowed ones, and min-p cuts the rest."""
    case = TwoTokenCase.of(engine)
    (a, b), firsts = max(case.joint, key=case.joint.get), sorted({x for x, _ in case.joint})
    seconds = {}
    for (_, y), p in case.joint.items():
        seconds[y] = seconds.get(y, 0.0) + p
    stop = max((y for y in seconds if y not in firsts), key=seconds.get)
    vocab = engine.target.model.info.vocab_size
    bans = {"bad_words": ((a, b),), "min_tokens": 2, "extra_stop_token_ids": frozenset({stop}), "min_p": 0.05,
            "allowed_token_ids": frozenset(range(vocab)) - {next(x for x in firsts if x != a)}}
    params = SamplingParams(**{**TWO_TOKEN_PARAMS, "ignore_eos": False, **bans})
    model, prompt = engine.target.model, case.prompt
    cache = model.new_cache(len(prompt) + 2)
    p1 = _masked_reference(model.forward(torch.tensor(prompt), cache, last_only=True).logits[0], [], params, stop)
    joint = {}
    for x in p1.nonzero().flatten().tolist():
        cache.truncate(len(prompt))
        p2 = _masked_reference(model.forward(torch.tensor([x]), cache).logits[0], [x], params, stop)
        joint |= {(x, y): p1[x].item() * p2[y].item() for y in p2.nonzero().flatten().tolist()}
    assert (a, b) not in joint and not any(stop in pair for pair in joint) and set(joint) != set(case.joint)
    eos = set(engine.target.model.info.eos_token_ids)
    assert not any(y in eos for _, y in joint)  # two tokens each: a stop would end a result early
    results = assert_follows_joint(joint, 600, lambda seed: engine.generate(
        prompt, SamplingParams(**{**TWO_TOKEN_PARAMS, "ignore_eos": False, **bans, "seed": seed}), drafter, 2))
    if drafter != PLAIN:
        assert 0 < sum(r.num_accepted_tokens for r in results) < sum(r.num_draft_tokens for r in results)


def _stop_case(engine: SpecEngine, reference: list[int]) -> tuple[str, int]:
    """A stop string (a word the output writes once) and the token that completes it."""
    full = engine.tokenizer.decode(reference, skip_special_tokens=True)
    for j in range(2, len(reference) - 10):
        before, upto = (engine.tokenizer.decode(reference[:i], skip_special_tokens=True) for i in (j, j + 1))
        word = upto[len(before) :].strip()
        if len(word) >= 3 and full.count(word) == 1 and upto.endswith(word):
            return word, j
    raise AssertionError("no suitable stop string in the reference output")


@pytest.mark.parametrize("drafter", [PLAIN, "self"])
def test_stop_strings_kept_or_waiting_for_min_tokens(engine: SpecEngine, reference: list[int], drafter: str) -> None:
    ids = engine.encode(TEXT)
    full = engine.tokenizer.decode(reference, skip_special_tokens=True)
    stop, j = _stop_case(engine, reference)
    base = {"max_tokens": 40, "ignore_eos": True, "stop": (stop,)}
    kept = engine.generate(ids, SamplingParams(**base, include_stop_str_in_output=True), drafter, 4)
    assert kept.text == full[: full.find(stop) + len(stop)] and kept.token_ids == reference[: j + 1]
    assert kept.finish_reason == "stop"
    # the string ends inside the first min_tokens tokens: it does not count, the output runs on
    waited = engine.generate(ids, SamplingParams(**base, min_tokens=j + 1), drafter, 4)
    assert waited.token_ids == reference and waited.text == full and waited.finish_reason == "length"


def test_special_tokens_kept_in_the_text_when_asked(engine: SpecEngine) -> None:
    eos = min(engine.target.model.info.eos_token_ids)
    params = {"max_tokens": 3, "ignore_eos": True, "logit_bias": {eos: 100.0}}
    ids = engine.encode(TEXT)
    skipped = engine.generate(ids, SamplingParams(**params))
    kept = engine.generate(ids, SamplingParams(**params, skip_special_tokens=False))
    assert skipped.token_ids == kept.token_ids == [eos] * 3
    assert skipped.text == "" and kept.text == engine.tokenizer.decode([eos]) * 3 != ""


def test_bans_that_cannot_be_served_are_refused_naming_the_field(engine: SpecEngine) -> None:
    ids = engine.encode(TEXT)
    eos = min(engine.target.model.info.eos_token_ids)
    vocab = engine.target.model.info.vocab_size
    schema = OutputFormat.json_schema({"type": "object"})
    cases = [
        (SamplingParams(allowed_token_ids=frozenset({vocab})), "allowed_token_ids", "not in the vocabulary"),
        (SamplingParams(extra_stop_token_ids=frozenset({-1})), "stop_token_ids", "not in the vocabulary"),
        (SamplingParams(bad_words=((5, vocab + 3),)), "bad_words", "not in the vocabulary"),
        (SamplingParams(allowed_token_ids=frozenset({eos}), min_tokens=1), "allowed_token_ids", "every allowed"),
        (SamplingParams(allowed_token_ids=frozenset({5}), bad_words=((5, 5),)), "allowed_token_ids", "every allowed"),
        (SamplingParams(bad_words=((5,),), output_format=schema), "bad_words", "response format"),
    ]
    for params, field, message in cases:
        with pytest.raises(RequestError, match=message) as e:
            engine.start(ids, params)
        assert e.value.param == field
    engine.start(ids, SamplingParams(allowed_token_ids=frozenset({eos}), ignore_eos=True, min_tokens=1)).close()
