"""Logit bias and repetition penalties under speculation: each verified row is penalised by the
history on its own path, so greedy output equals plain decoding's with the same penalties and
sampled output follows the penalised distribution."""

from __future__ import annotations

import pytest
import torch
from helpers import TWO_TOKEN_PARAMS, TwoTokenCase, assert_follows_joint

from workers.batch import BatchEngine
from workers.config import PLAIN
from workers.drafters.base import Draft
from workers.engine import SpecEngine, StepOrder
from workers.penalties import path_counts, penalize
from workers.result import RequestError
from workers.sampling import SamplingParams, probs_from_logits
from workers.tree import DraftTree

TEXT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
BIASED = 1000  # a token outside TEXT: biased up, it recurs until its penalties outweigh the bias
# the tiny target's logits are decisive (tens apart): a bias this large makes BIASED recur, and
# the penalties then decide where
GREEDY_PENALTIES = {"presence_penalty": 2.0, "frequency_penalty": 2.0, "logit_bias": {BIASED: 40.0}}


@pytest.fixture(scope="module")
def engine(self_drafting_engine: SpecEngine) -> SpecEngine:
    return self_drafting_engine


def test_path_counts_give_each_row_its_own_history() -> None:
    output, draft = [5, 7, 5], torch.tensor([7, 9, 7])
    chain = path_counts(output, draft, DraftTree.chain(3).input_mask()[:, 1:], also=torch.tensor([2, 5]))
    assert chain.tokens.tolist() == [2, 5, 7, 9]
    assert chain.counts.T.tolist() == [[0, 0, 0, 0], [2, 2, 2, 2],
                                       [1, 2, 2, 3],  # row r has the draft's first r tokens behind it
                                       [0, 0, 1, 1]]
    tree = DraftTree((-1, -1, 0))  # two candidates for the first position, one child of the first
    counts = path_counts(output, draft, tree.input_mask()[:, 1:])
    assert counts.counts[:, 1].tolist() == [1, 2, 1, 3]  # node 1 (a 9) is not on node 2's path
    assert counts.counts[:, 2].tolist() == [0, 0, 1, 0]


def test_penalize_follows_vllms_formulas() -> None:
    """Token 0 occurs 3 times, token 1 once in the output; token 2 only in the prompt."""
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0], [2.0, -2.0, 1.0, 0.5, 3.0]])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0,
                            logit_bias={3: 1.5})
    sees = DraftTree.chain(1).input_mask()[:, 1:]  # row 1 has the draft's token 4 behind it
    out = penalize(logits, params, [0, 1, 0, 0], torch.tensor([4]), sees, prompt_ids=torch.tensor([2]))
    expected = [2.0 / 2 - 0.25 * 3 - 0.5, -2.0 * 2 - 0.25 - 0.5, 1.0 / 2, 0.5 + 1.5, 3.0]
    assert out[0].tolist() == pytest.approx(expected)
    assert out[1].tolist() == pytest.approx(expected[:4] + [3.0 / 2 - 0.25 - 0.5])
    assert logits[0].tolist() == [2.0, -2.0, 1.0, 0.5, 3.0]  # the forward's logits stay as they were
    only_bias = SamplingParams(logit_bias={1: -1.0})
    no_draft = torch.zeros(2, 0, dtype=torch.bool)
    assert penalize(logits, only_bias, [], torch.tensor([], dtype=torch.long), no_draft)[:, 1].tolist() == [-3.0, -3.0]


@pytest.mark.parametrize("drafter", ["ngram", "self", "self_tree"])
def test_greedy_penalised_output_equals_plain_decodings(engine: SpecEngine, drafter: str) -> None:
    ids = engine.encode(TEXT)
    unpenalised = engine.generate(ids, SamplingParams(max_tokens=40)).token_ids
    params = SamplingParams(max_tokens=40, **GREEDY_PENALTIES)
    plain = engine.generate(ids, params).token_ids
    assert 5 <= plain.count(BIASED) < 40 and plain != unpenalised  # the bias and the penalties both act
    out = engine.generate(ids, params, drafter, 3)
    assert out.token_ids == plain
    if drafter != "ngram":
        assert 0 < out.num_accepted_tokens < out.num_draft_tokens  # kept and rejected drafts


def test_a_draft_of_plain_decodings_tokens_is_accepted_whole(engine: SpecEngine) -> None:
    """Each row is penalised by the draft tokens before it: the rows after a drafted BIASED see it."""
    ids = engine.encode(TEXT)
    params = SamplingParams(max_tokens=40, **GREEDY_PENALTIES)
    plain = engine.generate(ids, params).token_ids
    gen = engine.start(ids, params)
    k, inside = 6, 0
    while not gen.finished:
        draft = plain[len(gen.output_ids) :][: gen.clip(k)]
        stats = gen.run(StepOrder("ngram", k, draft=Draft(torch.tensor(draft))))
        assert stats.num_accepted == len(draft)
        inside += BIASED in draft[:-1]  # a row after it had it in its history
    gen.close()
    assert gen.output_ids == plain and inside > 0


def test_penalised_requests_in_a_batch_are_each_their_own(engine: SpecEngine) -> None:
    ids = engine.encode(TEXT)
    params = [SamplingParams(max_tokens=30, **GREEDY_PENALTIES), SamplingParams(max_tokens=30)]
    expected = [engine.generate(ids, p).token_ids for p in params]
    batch = BatchEngine(engine)
    gens = [batch.add(ids, params[i % 2]) for i in range(4)]
    orders = [StepOrder("self", 3), StepOrder("self_tree", 2), StepOrder(PLAIN), StepOrder("self", 4)]
    while batch.num_unfinished:
        step = batch.step({g: orders[gens.index(g)] for g in batch.schedule()})
        assert not step.failed
    assert [g.output_ids for g in gens] == [expected[i % 2] for i in range(4)]


def _penalised_reference(logits: torch.Tensor, prompt: list[int], output: list[int],
                         params: SamplingParams) -> torch.Tensor:
    """The distribution plain decoding samples from after `output`, penalised token by token."""
    logits = logits.clone()
    for token, bias in params.logit_bias.items():
        logits[token] += bias
    for token in set(prompt) | set(output):
        r = params.repetition_penalty
        logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= params.presence_penalty + params.frequency_penalty * output.count(token)
    return probs_from_logits(logits[None], SamplingParams(**TWO_TOKEN_PARAMS))[0]


@pytest.mark.parametrize("drafter", [PLAIN, "self", "self_tree"])
def test_sampled_penalised_output_follows_the_penalised_distribution(engine: SpecEngine, drafter: str) -> None:
    """Presence and frequency penalties make the second token depend on the first: the case's
    pair of one token twice (~9% unpenalised) cannot occur."""
    case = TwoTokenCase.of(engine)
    penalties = {"presence_penalty": 2.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    penalties["logit_bias"] = {max(case.joint, key=case.joint.get)[0]: -0.5}
    params = SamplingParams(**TWO_TOKEN_PARAMS, **penalties)
    model, prompt = engine.target.model, case.prompt
    cache = model.new_cache(len(prompt) + 2)
    p1 = _penalised_reference(model.forward(torch.tensor(prompt), cache, last_only=True).logits[0], prompt, [], params)
    joint = {}
    for a in p1.nonzero().flatten().tolist():
        cache.truncate(len(prompt))
        p2 = _penalised_reference(model.forward(torch.tensor([a]), cache).logits[0], prompt, [a], params)
        joint |= {(a, b): p1[a].item() * p2[b].item() for b in p2.nonzero().flatten().tolist()}
    assert any(a == b for a, b in case.joint) and not any(a == b for a, b in joint)
    results = assert_follows_joint(joint, 600, lambda seed: engine.generate(
        prompt, SamplingParams(**{**TWO_TOKEN_PARAMS, **penalties, "seed": seed}), drafter, 2))
    if drafter != PLAIN:
        assert 0 < sum(r.num_accepted_tokens for r in results) < sum(r.num_draft_tokens for r in results)


def test_penalised_params_stay_hashable_and_compare_by_value() -> None:
    a, b = SamplingParams(logit_bias={1: 1.0}), SamplingParams(logit_bias={1: 2.0})
    assert {a: "a"}[SamplingParams(logit_bias={1: 1.0})] == "a" and a != b


def test_bad_penalties_are_refused(engine: SpecEngine) -> None:
    for bad, field in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                       ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {3: 101}}, "logit_bias")]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)
    with pytest.raises(RequestError, match="not in the vocabulary") as e:
        engine.start(engine.encode(TEXT), SamplingParams(logit_bias={10**6: 1.0}))
    assert e.value.param == "logit_bias"
