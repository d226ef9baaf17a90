"""PredictionDrafter (OpenAI's Predicted Outputs): following the prediction, finding its place again
after an edit, losslessness greedy and sampled, usage counts, routing only requests that predict."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import TWO_TOKEN_PARAMS, TwoTokenCase, assert_follows_joint
from workers.config import EngineConfig, PredictionDrafterConfig
from workers.drafters.base import DraftContext
from workers.drafters.prediction import PredictionDrafter
from workers.result import PredictionTokens, RequestError
from workers.sampling import SamplingParams, make_generator

PREDICTION = (10, 11, 12, 13, 14, 15, 16, 17)
PROMPT = [1, 2, 3]


class Drafting:
    """One request's context and the drafter's state over it."""

    def __init__(self, prediction: tuple[int, ...] = PREDICTION, min_n: int = 2, max_n: int = 4) -> None:
        self.drafter = PredictionDrafter(PredictionDrafterConfig(min_n=min_n, max_n=max_n))
        self.ctx = DraftContext(list(PROMPT), SamplingParams(prediction=prediction), make_generator(0), 256,
                                num_prompt=len(PROMPT))
        self.state = self.drafter.begin(self.ctx)

    def emit(self, *tokens: int) -> Drafting:
        self.ctx.token_ids.extend(tokens)
        return self

    def propose(self, k: int = 3) -> list[int]:
        draft = self.drafter.propose(self.state, self.ctx, k)
        assert draft.probs is None and draft.tree is None and draft.token_ids.dtype == torch.long
        return draft.token_ids.tolist()


def test_drafts_the_prediction_from_its_first_token() -> None:
    d = Drafting()
    assert d.propose(3) == [10, 11, 12]
    assert d.propose(3) == [10, 11, 12]  # proposing again (a shadow, then the step) changes nothing


def test_follows_the_output_while_it_agrees() -> None:
    d = Drafting()
    assert d.emit(10, 11).propose(3) == [12, 13, 14]
    assert d.emit(12, 13, 14, 15).propose(8) == [16, 17]  # up to the prediction's end
    assert d.emit(16, 17).propose(3) == []  # the prediction is used up


def test_finds_its_place_again_after_an_edit() -> None:
    d = Drafting()
    d.emit(10, 11, 99)  # the output parts from the prediction at its third token
    assert d.propose() == []  # no n-gram of the output's tail occurs in the prediction
    assert d.emit(13).propose() == []  # (99, 13) does not either; min_n = 2
    assert d.emit(14).propose() == [15, 16, 17]  # (13, 14) does: an edit replaced 12 by 99
    # an insertion, then the output continues where it left
    assert Drafting().emit(10, 11, 98, 97, 11, 12).propose() == [13, 14, 15]
    # a deletion: the output skips ahead
    assert Drafting().emit(10, 14, 15).propose() == [16, 17]


def test_prefers_the_place_after_the_output_so_far_where_the_prediction_repeats() -> None:
    prediction = (5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 9)
    d = Drafting(prediction)
    d.emit(5, 6, 7, 1, 5, 6, 8)  # followed to place 7
    d.emit(40, 5, 6)  # an edit: (5, 6) occurs three times, the one after place 7 is the place
    assert d.propose() == [9]
    # with no occurrence after the last place in sync, the latest before it
    d = Drafting(prediction).emit(5, 6, 7, 1, 5, 6, 8, 2, 5, 6, 9, 40, 1, 5)
    assert d.propose() == [6, 8, 2]


def test_no_prediction_proposes_nothing() -> None:
    d = Drafting(prediction=())
    assert d.propose() == [] and d.emit(10, 11).propose() == []


def test_catches_up_over_steps_another_drafter_ran() -> None:
    """Tokens appended without a proposal in between are followed all at once."""
    d = Drafting()
    d.emit(10, 11, 12, 13)
    assert d.propose(2) == [14, 15]


def test_config_is_checked() -> None:
    with pytest.raises(ValueError, match="min_n"):
        PredictionDrafterConfig(min_n=5, max_n=3)
    assert EngineConfig().drafters[1].kind == "prediction"  # every engine has one by default


# -- the engine ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def engine(tiny_config: EngineConfig):  # -> SpecEngine
    from workers.engine import SpecEngine

    return SpecEngine.from_config(tiny_config.model_copy(
        update={"drafters": [*tiny_config.drafters, PredictionDrafterConfig()]}))


def test_greedy_output_is_plain_output_whatever_the_prediction(engine) -> None:
    prompt = engine.encode("Write a story about a fox.")
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine.generate(prompt, params).token_ids
    assert engine.generate(prompt, params).prediction is None  # no prediction, nothing to report

    exact = engine.generate(prompt, SamplingParams(**{**params.__dict__, "prediction": tuple(plain)}), "prediction", 8)
    assert exact.token_ids == plain
    # every draft accepted whole: each step emits its draft and the token after it
    assert exact.prediction == PredictionTokens(len(plain) - exact.num_steps, 0)

    edited = [*plain[:10], (plain[10] + 1) % 100, *plain[11:20], 7, 8, *plain[20:30], *plain[33:]]
    result = engine.generate(prompt, SamplingParams(**{**params.__dict__, "prediction": tuple(edited)}),
                             "prediction", 8)
    assert result.token_ids == plain
    assert result.prediction is not None and result.prediction.rejected > 0
    # the drafts found their place after each edit: most of the output came from the prediction
    assert result.prediction.accepted > len(plain) // 2


def test_sampled_output_follows_target_distribution(engine) -> None:
    """Rejection sampling against the prediction's one-hot drafts: the first two sampled tokens
    follow the target's joint distribution (both the accept and the reject path taken)."""
    case = TwoTokenCase.of(engine)
    a, _, never = case.draft_vocab(engine.target.model.info.vocab_size)
    results = assert_follows_joint(case.joint, 800, lambda seed: engine.generate(
        case.prompt, SamplingParams(seed=seed, prediction=(a, never), **TWO_TOKEN_PARAMS), "prediction", 2))
    accepted = sum(r.prediction.accepted for r in results)
    assert 0 < accepted < len(results)
    # two tokens to generate: the step drafts one (a), its bonus token is the second
    assert all(r.steps[0].num_draft_tokens == 1 for r in results)


def test_a_prediction_beyond_the_context_or_the_vocabulary_is_refused(engine) -> None:
    prompt = engine.encode("hi")
    with pytest.raises(RequestError) as info:
        engine.generate(prompt, SamplingParams(prediction=(1,) * (engine.max_model_len + 1)))
    assert info.value.param == "prediction"
    with pytest.raises(RequestError) as info:
        engine.generate(prompt, SamplingParams(prediction=(engine.target.model.info.vocab_size,)))
    assert info.value.param == "prediction"


def test_the_router_drafts_from_predictions_only_for_requests_that_send_one(engine) -> None:
    """A request with a prediction takes its cheap-first steps from it, alone and in a batch; a
    request without one never plans, shadows or counts the prediction drafter; all lossless."""
    from policies.schema import load_policy
    from policies.stats import MemoryStats
    from workers.routing import RoutedBatch, Router, Speculation, generate

    policy = load_policy({
        "version": "t", "default_domain": "chat",
        "domains": {"chat": {"drafters": ["prediction", "ngram", "none"], "k_min": 1, "k_max": 8,
                             "priors": {"prediction": 0.8, "ngram": 0.5}, "cheap_first": True}},
        "classifier": {"rules": []},
    })
    store = MemoryStats()
    router = Router(engine, policy, store, seed=0)
    prompts = [engine.encode(f"Tell me about the number {i}.") for i in range(3)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plains = [engine.generate(p, params).token_ids for p in prompts]
    predicted = [SamplingParams(**{**params.__dict__, "prediction": tuple(plain)}) for plain in plains]

    for prompt, plain, with_prediction in zip(prompts, plains, predicted):
        bare = router.start(prompt, params, "text", Speculation())
        assert "prediction" not in bare.cheap.shadow and "prediction" not in bare.plan.estimates
        bare.close()
        result = generate(router, prompt, with_prediction, "text")
        assert result.token_ids == plain and "prediction" in result.drafters
        assert result.prediction is not None and result.prediction.accepted > 0
        assert generate(router, prompt, params, "text").token_ids == plain

    batch = RoutedBatch(router)
    running = [batch.add(p, q, "text", Speculation()) for p, q in zip(prompts * 2, predicted + [params] * 3)]
    while batch.num_running or batch.num_waiting:
        batch.step()
    for i, (routed, plain) in enumerate(zip(running, plains * 2)):
        result = routed.result()
        assert result.token_ids == plain
        assert ("prediction" in result.drafters) == (i < 3)
        routed.close()
