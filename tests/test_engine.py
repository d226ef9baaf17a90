"""The speculative loop on the tiny engine: losslessness, accounting, trimming, errors.

tiny_engine's drafters: "ngram"; "self" (the target itself: accepts everything under greedy);
"other" (an unrelated random model: rarely accepted). Tests add their own drafters to a
SpecEngine over the same target: a perturbed copy of the target (mixed acceptance), a scripted
drafter that proposes plain decoding's own continuation with chosen mistakes, failing drafters.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers import TwoTokenCase, slow_device_waits, with_draws

from policies.controller import FirstTry, StepChoice
from workers.config import EngineConfig, ModelConfig, ModelDrafterConfig, NgramDrafterConfig
from workers.drafters.base import Draft, DraftContext
from workers.drafters.model import ModelDrafter
from workers.engine import PLAIN, Generation, GenerationResult, RequestError, SpecEngine, StepStats
from workers.models.llama import FastLlama, LlamaWeights
from workers.sampling import SamplingParams
from workers.shadows import CheapDrafters, ShadowScore
from workers.target import eos_token_ids, load_hf

MAX_TOKENS = 40
TEXTS = [
    "Tell me a story about a cat and a dog.",
    "Summarize: the committee met on Tuesday and agreed to postpone the vote until March.",
    "Write a Python function that reverses a linked list.",
]
# a raw (non-chat) prompt ending in a repeated bigram, so the n-gram drafter proposes at once
RAW_REPEAT = "Count: one two three four five six seven eight nine ten one two"


# ---------------------------------------------------------------------------------------------
# helpers and drafters built by the tests


def greedy(max_tokens: int = MAX_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def choice(drafter: str, k: int, first: list[FirstTry] | tuple[FirstTry, ...] = ()) -> StepChoice:
    """A controller's choice of drafter and k, with cheap drafters to try first."""
    return StepChoice(drafter, k, "forced", 1.0, tuple(first))


class ScriptedDrafter:
    """Proposes the reference continuation (plain decoding's output) with chosen output
    positions replaced by a wrong token; records every commit."""

    needs_hidden_states: ClassVar[bool] = False
    cheap: ClassVar[bool] = True

    def __init__(self, name: str, prompt: list[int], reference: list[int], wrong_at: set[int]) -> None:
        self.name = name
        self.config = NgramDrafterConfig(name=name, draft_len=4)
        self.prompt, self.reference, self.wrong_at = prompt, reference, wrong_at
        self.commits: list[tuple[int, int]] = []
        self.num_begin = self.num_end = 0

    def begin(self, ctx: DraftContext) -> dict:
        assert ctx.token_ids[: len(self.prompt)] == self.prompt
        self.num_begin += 1
        return {"last_k": 0}

    def propose(self, state: dict, ctx: DraftContext, k: int) -> Draft:
        pos = len(ctx.token_ids) - len(self.prompt)
        ids = [
            (t + 1) % 1000 if pos + i in self.wrong_at else t
            for i, t in enumerate(self.reference[pos : pos + k])
        ]
        state["last_k"] = len(ids)
        return Draft(torch.tensor(ids, dtype=torch.long))

    def commit(self, state: dict, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        assert num_accepted <= state["last_k"]
        self.commits.append((num_new, num_accepted))

    def end(self, state: dict) -> None:
        self.num_end += 1


class FailingDrafter(ScriptedDrafter):
    """A scripted drafter whose method `where` raises on call number `on_call` (1-based)."""

    def __init__(self, *args: Any, where: str = "propose", on_call: int = 1, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.where, self.on_call, self.calls = where, on_call, {"begin": 0, "propose": 0, "commit": 0}

    def _maybe_fail(self, where: str) -> None:
        self.calls[where] += 1
        if where == self.where and self.calls[where] >= self.on_call:
            raise RuntimeError(f"injected {where} failure")

    def begin(self, ctx: DraftContext) -> dict:
        self._maybe_fail("begin")
        return super().begin(ctx)

    def propose(self, state: dict, ctx: DraftContext, k: int) -> Draft:
        self._maybe_fail("propose")
        return super().propose(state, ctx, k)

    def commit(self, state: dict, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        self._maybe_fail("commit")
        super().commit(state, ctx, num_new, num_accepted)


def with_drafters(engine: SpecEngine, config: EngineConfig | None = None, **extra: Any) -> SpecEngine:
    """A SpecEngine over the same loaded target with extra drafters."""
    return SpecEngine(engine.target, {**engine.drafters, **extra}, config or engine.config)


@pytest.fixture(scope="module")
def perturbed_drafter(tiny_llama_dir: Path) -> ModelDrafter:
    """The tiny target with noise added to its second layer: agrees often, not always."""
    hf_model, tokenizer, _ = load_hf(ModelConfig(model=str(tiny_llama_dir)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "layers.1.mlp" in name or "layers.1.self_attn.o_proj" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.15 * p.std())
    model = FastLlama(LlamaWeights.of(hf_model), eos_token_ids(hf_model.generation_config, tokenizer))
    config = ModelDrafterConfig(name="perturbed", model=ModelConfig(model=str(tiny_llama_dir)), draft_len=3)
    return ModelDrafter(config, model)


@pytest.fixture(scope="module")
def engine(tiny_engine: SpecEngine, perturbed_drafter: ModelDrafter) -> SpecEngine:
    return with_drafters(tiny_engine, perturbed=perturbed_drafter)


@pytest.fixture(scope="module")
def prompts(tiny_engine: SpecEngine) -> list[list[int]]:
    return [tiny_engine.encode(t) for t in TEXTS] + [tiny_engine.encode(RAW_REPEAT, chat=False)]


_plain_cache: dict[tuple, GenerationResult] = {}


def plain(engine: SpecEngine, prompt: list[int], params: SamplingParams | None = None) -> GenerationResult:
    params = params or greedy()
    key = (id(engine.target), tuple(prompt), params)
    if key not in _plain_cache:
        _plain_cache[key] = engine.generate(prompt, params)
    return _plain_cache[key]


def assert_same_output(got: GenerationResult, expected: GenerationResult) -> None:
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason


def check_step_accounting(result: GenerationResult, prompt: list[int], steps: list[StepStats] | None = None) -> None:
    steps = result.steps if steps is None else steps
    assert steps == result.steps
    assert result.num_steps == len(steps)
    assert sum(s.num_emitted for s in steps) == len(result.token_ids)
    assert result.num_draft_tokens == sum(s.num_draft_tokens for s in steps)
    assert result.num_accepted_tokens == sum(s.num_accepted for s in steps)
    context = len(prompt)
    for s in steps:
        assert 0 <= s.num_accepted <= s.num_draft_tokens <= s.draft_len
        assert 1 <= s.num_emitted <= s.num_accepted + 1
        assert s.context_len == context
        context += s.num_emitted
        assert s.draft_s >= 0 and s.verify_s >= 0
        if s.drafter == PLAIN:
            assert s.num_draft_tokens == 0
    assert all(s.num_emitted == s.num_accepted + 1 for s in steps[:-1])  # only the last is trimmed
    per_pos = result.accepted_per_position
    assert sum(per_pos) == result.num_accepted_tokens
    assert all(a >= b for a, b in pairwise(per_pos))
    assert result.mean_acceptance_length == pytest.approx(len(result.token_ids) / len(steps))
    assert result.prompt_token_ids == prompt


# ---------------------------------------------------------------------------------------------
# losslessness under greedy decoding


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("drafter", ["ngram", "self", "other", "perturbed"])
def test_greedy_identical_to_plain(engine: SpecEngine, prompts: list[list[int]], drafter: str, k: int) -> None:
    drafted = 0
    for prompt in prompts:
        steps: list[StepStats] = []
        result = engine.generate(prompt, greedy(), drafter, k, on_step=steps.append)
        assert_same_output(result, plain(engine, prompt))
        check_step_accounting(result, prompt, steps)
        drafted += result.num_draft_tokens
        if drafter == "self":
            assert result.num_accepted_tokens == result.num_draft_tokens  # the target drafting itself
    assert drafted > 0  # every drafter really proposed on some prompt


def test_timed_forwards_wait_for_the_device(
    engine: SpecEngine, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A GPU forward (or a drafter on the GPU) returns at launch: the prefill's, each draft's and
    each verify's seconds are read after waiting for the device. A stand-in wait of 10 ms shows
    in each."""
    waits = slow_device_waits(monkeypatch, "workers.engine", 0.01)
    result = engine.generate(prompts[0], greedy(3), "ngram", 2)
    drafted = [s for s in result.steps if s.draft_len]  # the last step's k is clipped to 0: no draft
    assert drafted and set(waits) == {engine.target.model.device}
    assert len(waits) == 1 + len(result.steps) + len(drafted)
    assert result.prefill_s >= 0.01 and min(s.verify_s for s in result.steps) >= 0.01
    assert min(s.draft_s for s in drafted) >= 0.01


def test_perturbed_drafter_has_mixed_acceptance(engine: SpecEngine, prompts: list[list[int]]) -> None:
    result = engine.generate(prompts[0], greedy(), "perturbed", 4)
    assert_same_output(result, plain(engine, prompts[0]))
    assert 0 < result.num_accepted_tokens < result.num_draft_tokens
    assert any(s.num_accepted == 0 for s in result.steps)
    assert any(0 < s.num_accepted < s.num_draft_tokens for s in result.steps)
    assert result.drafters == ["perturbed"]


def test_scripted_mistakes_give_exact_acceptance(engine: SpecEngine, prompts: list[list[int]]) -> None:
    """Drafts equal to plain decoding except at chosen positions: each step accepts exactly up
    to the first mistake, and the drafter is told so in commit."""
    prompt = prompts[1]
    reference = plain(engine, prompt).token_ids
    scripted = ScriptedDrafter("scripted", prompt, reference, wrong_at={2, 3, 9, 20})
    eng = with_drafters(engine, scripted=scripted)
    result = eng.generate(prompt, greedy(), "scripted", 4)
    assert_same_output(result, plain(engine, prompt))
    pos = 0
    for s in result.steps:
        wrong = [i for i in range(s.num_draft_tokens) if pos + i in scripted.wrong_at]
        assert s.num_accepted == (wrong[0] if wrong else s.num_draft_tokens)
        pos += s.num_emitted
    assert [s.num_accepted for s in result.steps[:4]] == [2, 0, 4, 0]  # positions 0-2, 3, 4-8, 9
    assert scripted.commits == [(s.num_emitted, s.num_accepted) for s in result.steps]
    assert scripted.num_begin == scripted.num_end == 1  # state released when the request ends


@pytest.mark.parametrize("drafter, k", [(PLAIN, 0), ("scripted", 2), ("perturbed", 3)])
def test_shadow_scores_are_exact_and_change_nothing(
    engine: SpecEngine, prompts: list[list[int]], drafter: str, k: int,
) -> None:
    """A shadow drafter is scored on the tokens the target emitted: accepted up to its first
    mistake, every proposal scored once, and the output stays plain decoding's. When it is the
    drafter that runs, only the positions past its real draft are scored."""
    prompt = prompts[1]
    reference = plain(engine, prompt).token_ids
    wrong_at = {2, 3, 9, 20}
    scripted = ScriptedDrafter("scripted", prompt, reference, wrong_at)
    eng = with_drafters(engine, scripted=scripted)
    gen = eng.start(prompt, greedy())
    cheap = CheapDrafters(gen, ["scripted"])
    scores: list[ShadowScore] = []
    while not gen.finished:
        gen.run(cheap.order(choice(drafter, k)))
        scores += cheap.scores()
    result = gen.result()
    gen.close()
    assert_same_output(result, plain(engine, prompt))
    assert sorted(score.context_len for score in scores) == [s.context_len for s in result.steps]
    limit = eng.config.max_draft_len
    for score in scores:
        pos = score.context_len - len(prompt)
        known = min(limit, len(reference) - pos)
        first_wrong = min([i - pos for i in wrong_at if pos <= i < pos + known] + [known])
        assert score.num_accepted == first_wrong
        assert score.num_proposed == (known if first_wrong == known else min(limit, len(reference) - pos))
        real = next(s for s in result.steps if s.context_len == score.context_len)
        assert score.start == (real.num_draft_tokens if real.drafter == "scripted" else 0)
    if drafter == "scripted":
        assert any(score.start == 2 and score.num_accepted > 2 for score in scores)  # tails are scored


def test_one_token_prompt(engine: SpecEngine) -> None:
    prompt = [engine.tokenizer.bos_token_id or 1]
    for drafter in ("self", "perturbed"):
        assert_same_output(engine.generate(prompt, greedy(20), drafter, 3), plain(engine, prompt, greedy(20)))


# ---------------------------------------------------------------------------------------------
# accounting: MAT, budget clipping


def test_mean_acceptance_length(engine: SpecEngine, prompts: list[list[int]]) -> None:
    params = greedy(42, ignore_eos=True)
    base = engine.generate(prompts[0], params)
    assert base.mean_acceptance_length == 1.0
    assert base.num_steps == 42 and base.num_draft_tokens == 0
    assert base.accepted_per_position == [] and base.drafters == []

    spec = engine.generate(prompts[0], params, "self", 4)
    assert spec.token_ids == base.token_ids
    # 8 full steps of 4 accepted + bonus, then the budget leaves room for 2 tokens (k = 1)
    assert [s.num_emitted for s in spec.steps] == [5] * 8 + [2]
    assert [s.draft_len for s in spec.steps] == [4] * 8 + [1]
    assert all(s.num_accepted == s.draft_len for s in spec.steps)
    assert spec.mean_acceptance_length == pytest.approx(42 / 9)
    assert all(s.num_emitted == 5 for s in spec.steps[:-1])  # MAT 5.0 except the clipped step
    assert spec.accepted_per_position == [9, 8, 8, 8]
    assert spec.num_accepted_tokens == 33


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 9])
@pytest.mark.parametrize("drafter", ["self", "perturbed", "other"])
def test_max_tokens_clipping_is_exact(engine: SpecEngine, prompts: list[list[int]], drafter: str, max_tokens: int) -> None:
    params = greedy(max_tokens, ignore_eos=True)
    result = engine.generate(prompts[2], params, drafter, 8)
    assert len(result.token_ids) == max_tokens
    assert result.finish_reason == "length"
    assert result.token_ids == engine.generate(prompts[2], params).token_ids
    produced = 0
    for s in result.steps:
        assert s.draft_len <= max_tokens - produced - 1  # room for the bonus token is kept
        produced += s.num_emitted
    assert result.steps[0].draft_len == min(8, max_tokens - 1)
    check_step_accounting(result, prompts[2])


def test_k_is_capped_by_max_draft_len(engine: SpecEngine, prompts: list[list[int]]) -> None:
    result = engine.generate(prompts[0], greedy(), "self", 100)
    assert result.steps[0].draft_len == engine.config.max_draft_len
    assert result.steps[0].num_draft_tokens == engine.config.max_draft_len
    assert_same_output(result, plain(engine, prompts[0]))


# ---------------------------------------------------------------------------------------------
# stopping: EOS (or any stop token) inside a draft, stop strings


def first_new_token_at(tokens: list[int], start: int) -> int:
    """The first position >= start whose token does not occur earlier."""
    return next(j for j in range(start, len(tokens)) if tokens[j] not in tokens[:j])


@pytest.mark.parametrize("drafter", [PLAIN, "self", "perturbed", "other", "ngram"])
def test_stop_token_inside_a_draft(engine: SpecEngine, prompts: list[list[int]], drafter: str) -> None:
    prompt = prompts[0]
    reference = plain(engine, prompt).token_ids
    j = first_new_token_at(reference, 5)
    params = greedy(extra_stop_token_ids=frozenset({reference[j]}))
    result = engine.generate(prompt, params, drafter, 8)
    assert result.token_ids == reference[: j + 1]
    assert result.finish_reason == "stop"
    check_step_accounting(result, prompt)
    if drafter == "self":
        # the stop token came in the middle of a fully accepted draft: the rest was dropped
        last = result.steps[-1]
        assert last.num_emitted < last.num_accepted + 1


def text_of(engine: SpecEngine, ids: list[int]) -> str:
    return engine.tokenizer.decode(ids, skip_special_tokens=True)


def stop_string_cases(engine: SpecEngine, tokens: list[int]) -> tuple[tuple[str, int], tuple[str, int]]:
    """(a word that is one whole token, the index of that token) and (a string spanning the
    boundary between two tokens, the index of the token that completes it)."""
    full = text_of(engine, tokens)
    word = across = None
    for j in range(4, len(tokens) - 1):
        before, upto = text_of(engine, tokens[:j]), text_of(engine, tokens[: j + 1])
        if not (full.startswith(upto) and upto.startswith(before)):
            continue  # a partial UTF-8 character: skip
        piece, nxt = upto[len(before) :], text_of(engine, tokens[: j + 2])[len(upto) :]
        if word is None and piece.strip().isalpha() and len(piece.strip()) >= 3 and full.find(piece.strip()) == len(before) + piece.index(piece.strip()[0]):
            word = (piece.strip(), j)
        if across is None and len(piece) >= 2 and len(nxt) >= 2 and nxt.isprintable() and piece.isprintable():
            s = piece[-2:] + nxt[:2]
            if full.find(s) == len(upto) - 2:
                across = (s, j + 1)
        if word and across:
            return word, across
    raise AssertionError("no suitable stop strings in the reference output")


@pytest.mark.parametrize("drafter", ["self", "perturbed", "other"])
def test_stop_strings(engine: SpecEngine, prompts: list[list[int]], drafter: str) -> None:
    prompt = prompts[0]
    reference = plain(engine, prompt).token_ids
    full = text_of(engine, reference)
    for stop, j in stop_string_cases(engine, reference):
        params = greedy(stop=(stop, "a stop string that never occurs"))
        base = engine.generate(prompt, params)
        spec = engine.generate(prompt, params, drafter, 8)
        for result in (base, spec):
            assert result.text == full[: full.find(stop)]
            assert stop not in result.text
            assert result.token_ids == reference[: j + 1]  # up to the token completing the string
            assert result.finish_reason == "stop"
        check_step_accounting(spec, prompt)


# ---------------------------------------------------------------------------------------------
# request validation


def test_context_limit(engine: SpecEngine, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    limit = engine.max_model_len
    assert limit == 1024
    too_many = limit - len(prompt) + 1
    for call in (
        lambda: engine.generate(prompt, greedy(too_many)),
        lambda: engine.generate(prompt, greedy(too_many), "self", 4),
        lambda: engine.start(prompt, greedy(too_many)),
        lambda: next(engine.stream(prompt, greedy(too_many), "ngram")),
    ):
        with pytest.raises(RequestError) as info:
            call()
        message = str(info.value)
        assert str(limit) in message
        assert str(len(prompt)) in message
        assert str(too_many) in message
    gen = engine.start(prompt, greedy(limit - len(prompt)))  # exactly at the limit is fine
    gen.step("self", 4)
    gen.close()


def test_empty_prompt_and_unknown_drafter(engine: SpecEngine, prompts: list[list[int]]) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.generate([], greedy())
    with pytest.raises(RequestError, match="empty"):
        engine.start([], greedy())
    with pytest.raises(RequestError, match="no-such-drafter") as info:
        engine.generate(prompts[0], greedy(), "no-such-drafter", 3)
    assert "ngram" in str(info.value)  # the message lists what is configured
    with pytest.raises(RequestError, match="no-such-drafter"):
        next(engine.stream(prompts[0], greedy(), "no-such-drafter"))
    gen = engine.start(prompts[0], greedy())  # a step naming an unknown drafter: same error
    with pytest.raises(RequestError, match="no-such-drafter"):
        gen.step("no-such-drafter", 3)
    gen.close()


def test_step_after_finish_raises(engine: SpecEngine, prompts: list[list[int]]) -> None:
    gen = engine.start(prompts[0], greedy(2))
    while not gen.finished:
        gen.step("self", 4)
    with pytest.raises(RuntimeError):
        gen.step()
    gen.close()


# ---------------------------------------------------------------------------------------------
# drafter failures


@pytest.mark.parametrize(("where", "on_call"), [("propose", 1), ("propose", 3), ("begin", 1)])
def test_failing_drafter_falls_back_to_plain(engine: SpecEngine, prompts: list[list[int]], where: str, on_call: int) -> None:
    prompt = prompts[1]
    reference = plain(engine, prompt)
    failing = FailingDrafter("flaky", prompt, reference.token_ids, set(), where=where, on_call=on_call)
    eng = with_drafters(engine, flaky=failing)
    steps: list[StepStats] = []
    result = eng.generate(prompt, greedy(), "flaky", 3, on_step=steps.append)
    assert_same_output(result, reference)
    check_step_accounting(result, prompt, steps)
    num_ok = on_call - 1 if where == "propose" else 0  # proposals before the failure
    assert [s.drafter for s in steps[:num_ok]] == ["flaky"] * num_ok
    assert all(s.fallback_reason is None for s in steps[:num_ok])
    assert all(s.num_accepted == 3 for s in steps[:num_ok])
    for s in steps[num_ok:]:  # the failing step and every later one decode plainly
        assert s.drafter == PLAIN
        assert s.fallback_reason == "drafter_error"
        assert s.num_draft_tokens == 0
    assert failing.calls[where] == on_call  # never asked again after it failed in this request
    # the next request gets the drafter back
    failing.on_call = 10**9
    again = eng.generate(prompt, greedy(), "flaky", 3)
    assert_same_output(again, reference)
    assert all(s.fallback_reason is None for s in again.steps)
    assert again.num_accepted_tokens > 0


def test_drafter_commit_error_does_not_fail_the_request(engine: SpecEngine, prompts: list[list[int]]) -> None:
    prompt = prompts[1]
    reference = plain(engine, prompt)
    failing = FailingDrafter("flaky-commit", prompt, reference.token_ids, set(), where="commit", on_call=2)
    result = with_drafters(engine, **{"flaky-commit": failing}).generate(prompt, greedy(), "flaky-commit", 3)
    assert_same_output(result, reference)
    check_step_accounting(result, prompt)
    assert failing.calls["commit"] == 2  # dropped after its failure
    assert [s.num_draft_tokens for s in result.steps[:2]] == [3, 3]
    later = result.steps[2:]
    assert later and all(s.drafter == PLAIN and s.fallback_reason == "drafter_error" for s in later)


def test_model_drafter_first_used_late_in_a_long_request(engine: SpecEngine) -> None:
    config = engine.config.model_copy(update={"target": engine.config.target.model_copy(update={"max_model_len": 2048})})
    eng = with_drafters(engine, config)
    assert eng.max_model_len == 2048  # == the tiny model's max_position
    prompt = eng.encode("hello world " * 600, chat=False)[:1000]
    gen = eng.start(prompt, greedy(1000, ignore_eos=True))
    for _ in range(100):
        gen.step()
    stats = gen.step("self", 4)
    gen.close()
    assert stats.fallback_reason is None
    assert stats.num_draft_tokens == 4


# ---------------------------------------------------------------------------------------------
# on_step, mid-request switching, streaming


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_on_step_receives_every_step(engine: SpecEngine, prompts: list[list[int]], temperature: float) -> None:
    for drafter, k in [(PLAIN, 0), ("ngram", 5), ("self", 4), ("other", 2), ("perturbed", 6)]:
        for prompt in prompts[2:]:
            steps: list[StepStats] = []
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=1)
            result = engine.generate(prompt, params, drafter, k, on_step=steps.append)
            assert steps and all(isinstance(s, StepStats) for s in steps)
            check_step_accounting(result, prompt, steps)
            assert {s.drafter for s in steps} <= {PLAIN, drafter}


SCHEDULE = [("self", 3), ("other", 2), (PLAIN, 0), ("perturbed", 5), ("ngram", 4), ("self", 1),
            ("perturbed", 8), ("other", 0), (PLAIN, 4), ("self", 6)]


def run_schedule(engine: SpecEngine, prompt: list[int], params: SamplingParams) -> tuple[GenerationResult, list[str]]:
    gen = engine.start(prompt, params)
    assert isinstance(gen, Generation)
    used = []
    i = 0
    while not gen.finished:
        drafter, k = SCHEDULE[i % len(SCHEDULE)]
        stats = gen.step(drafter, k)
        if stats.num_draft_tokens:
            assert stats.drafter == drafter
            used.append(drafter)
        else:  # no draft: k = 0, plain asked for, or the drafter proposed nothing
            assert stats.drafter in (PLAIN, drafter)
        i += 1
    result = gen.result()
    gen.close()
    return result, used


def test_switching_drafter_and_k_mid_request_stays_lossless(engine: SpecEngine, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        result, used = run_schedule(engine, prompt, greedy(60))
        assert_same_output(result, plain(engine, prompt, greedy(60)))
        check_step_accounting(result, prompt)
        assert result.drafters == list(dict.fromkeys(used))
        assert {"self", "other", "perturbed"} <= set(used)  # each was used, most of them repeatedly


def test_a_cheap_drafter_tried_first_takes_only_the_steps_it_proposes_on(
    engine: SpecEngine, prompts: list[list[int]],
) -> None:
    """`first`: prompt lookup runs the steps where it finds a match, the named drafter the rest;
    greedy output stays plain decoding's, and a silent lookup is still scored as a shadow."""
    repeat = prompts[-1]  # ends with "one two": lookup proposes at once

    def step(gen: Generation, first: list[FirstTry], shadow: tuple[str, ...] = ("ngram",)) -> tuple[StepStats, tuple]:
        cheap = CheapDrafters(gen, shadow)
        stats = gen.run(cheap.order(choice("perturbed", 3, first)))
        return stats, cheap.scores()

    gen = engine.start(repeat, greedy(8))
    stats, _ = step(gen, [FirstTry("ngram", 2)])
    assert stats.drafter == "ngram" and stats.draft_len == 2 and 1 <= stats.num_draft_tokens <= 2
    gen.close()
    novel = engine.encode("Zebra quantum", chat=False)  # nothing to look up
    gen = engine.start(novel, greedy(8))
    stats, scores = step(gen, [FirstTry("ngram", 2)])
    assert stats.drafter == "perturbed" and stats.num_draft_tokens == 3
    assert [(s.drafter, s.num_proposed) for s in scores] == [("ngram", 0)]  # the silent step counts
    gen.close()
    # a silent first try falls through to the next one, and only then to the step's drafter
    gen = engine.start(novel, greedy(8))
    stats, scores = step(gen, [FirstTry("ngram", 2), FirstTry("self", 2)])
    assert stats.drafter == "self" and stats.draft_len == 2 and stats.num_draft_tokens == 2
    assert [(s.drafter, s.num_proposed) for s in scores] == [("ngram", 0)]
    gen.close()
    gen = engine.start(repeat, greedy(8))
    assert step(gen, [FirstTry("ngram", 2), FirstTry("self", 2)], shadow=())[0].drafter == "ngram"
    gen.close()
    for prompt in prompts:
        gen = engine.start(prompt, greedy(60))
        cheap = CheapDrafters(gen, ("ngram",))
        while not gen.finished:
            gen.run(cheap.order(choice("perturbed", 3, [FirstTry("ngram", 4)])))
        result = gen.result()
        gen.close()
        assert_same_output(result, plain(engine, prompt, greedy(60)))
        check_step_accounting(result, prompt)
        assert set(result.drafters) <= {"ngram", "perturbed"} and "perturbed" in result.drafters
        if prompt is repeat:
            assert "ngram" in result.drafters


def test_a_later_try_that_repeats_the_leading_draft_and_goes_on_takes_the_step(
    engine: SpecEngine, prompts: list[list[int]],
) -> None:
    """Two cheap drafters that propose the same run, one asked for more of it: the longer draft
    takes the step (the same tokens first), the other is scored as a shadow from the start; a
    later draft that is not longer, or says something else, leaves the lead alone."""
    from workers.drafters.ngram import NgramDrafter

    both = with_drafters(engine, long=NgramDrafter(NgramDrafterConfig(name="long")))
    repeat = prompts[-1]  # ends with "one two": lookup proposes at once
    gen = both.start(repeat, greedy(8))
    cheap = CheapDrafters(gen, ("ngram", "long"))
    stats = gen.run(cheap.order(choice("perturbed", 3, [FirstTry("ngram", 2), FirstTry("long", 4)])))
    assert stats.drafter == "long" and stats.draft_len == 4 and stats.num_draft_tokens > 2
    shadows = {s.drafter: s for s in cheap.scores()}
    assert shadows["ngram"].start == 0 and shadows["ngram"].num_proposed > 2  # its whole proposal, scored
    gen.close()
    gen = both.start(repeat, greedy(8))
    stats = gen.run(CheapDrafters(gen, ("ngram", "long")).order(
        choice("perturbed", 3, [FirstTry("long", 4), FirstTry("ngram", 2)])))
    assert stats.drafter == "long" and stats.draft_len == 4
    gen.close()
    for prompt in prompts:  # lossless whichever runs
        gen = both.start(prompt, greedy(40))
        cheap = CheapDrafters(gen, ("ngram", "long"))
        while not gen.finished:
            gen.run(cheap.order(choice("perturbed", 3, [FirstTry("ngram", 2), FirstTry("long", 5)])))
        result = gen.result()
        gen.close()
        assert_same_output(result, plain(both, prompt, greedy(40)))
        check_step_accounting(result, prompt)


def test_sampled_switching_is_reproducible(engine: SpecEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=40, temperature=0.9, top_k=50, seed=7)
    a, _ = run_schedule(engine, prompts[0], params)
    b, _ = run_schedule(engine, prompts[0], params)
    assert a.token_ids == b.token_ids
    check_step_accounting(a, prompts[0])


def test_stream_yields_every_step_and_closing_releases_state(engine: SpecEngine, prompts: list[list[int]]) -> None:
    prompt = prompts[0]
    seen = []
    for gen, stats in engine.stream(prompt, greedy(), "self", 4):
        seen.append(stats)
        assert gen.steps[-1] is stats
    assert gen.finished and gen.cache is None
    assert gen.result().token_ids == plain(engine, prompt).token_ids

    reference = plain(engine, prompt).token_ids
    scripted = ScriptedDrafter("scripted", prompt, reference, wrong_at={1})
    stream = with_drafters(engine, scripted=scripted).stream(prompt, greedy(), "scripted", 4)
    gen, _ = next(stream)
    assert not gen.finished
    assert scripted.num_begin == 1 and scripted.num_end == 0
    stream.close()  # abandoning the request releases the cache and the drafter's state
    assert gen.cache is None
    assert scripted.num_end == 1


def test_default_draft_len_comes_from_the_drafter_config(engine: SpecEngine, prompts: list[list[int]]) -> None:
    result = engine.generate(prompts[0], greedy(), "self")  # draft_len 4 in tiny_config
    assert result.steps[0].draft_len == 4
    result = engine.generate(prompts[0], greedy(), "other")  # draft_len 3
    assert result.steps[0].draft_len == 3
    assert engine.default_draft_len(PLAIN) == 0


# ---------------------------------------------------------------------------------------------
# sampling


@pytest.mark.parametrize("drafter", [PLAIN, "ngram", "self", "other", "perturbed"])
def test_sampled_decoding_is_reproducible_with_a_seed(engine: SpecEngine, prompts: list[list[int]], drafter: str) -> None:
    prompt = prompts[3]
    k = 0 if drafter == PLAIN else 4

    def run(seed: int) -> GenerationResult:
        params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)
        return engine.generate(prompt, params, drafter, k)

    first, again, other = run(123), run(123), run(124)
    assert first.token_ids == again.token_ids
    assert [s.num_accepted for s in first.steps] == [s.num_accepted for s in again.steps]
    assert first.token_ids != other.token_ids
    check_step_accounting(first, prompt)


def test_sampled_self_drafting_is_almost_always_accepted(engine: SpecEngine, prompts: list[list[int]]) -> None:
    """q = p when the drafter is the target with the same temperature, top-k and top-p: the
    acceptance probability min(1, p/q) is 1 up to rounding. A drafter that sampled from a
    different distribution than it reports (or a target side with other settings) would not."""
    params = SamplingParams(max_tokens=40, temperature=0.7, top_k=40, top_p=0.9, seed=3, ignore_eos=True)
    engine = with_draws(engine, "stream")  # rejection sampling
    result = engine.generate(prompts[0], params, "self", 4)
    assert result.num_accepted_tokens >= 0.95 * result.num_draft_tokens
    # not a degenerate distribution where anything is accepted: a near drafter is often rejected
    near = engine.generate(prompts[0], params, "perturbed", 4)
    assert near.num_accepted_tokens < 0.8 * near.num_draft_tokens


@pytest.mark.parametrize("draws", ["stream", "position"])
def test_sampled_output_follows_target_distribution(engine: SpecEngine, draws: str) -> None:
    """End to end: the first two sampled tokens (top-k 3, so 9 possible pairs) of speculative
    decoding with the perturbed drafter follow the target's exact joint distribution, by
    rejection sampling and by exact match against draws keyed by position."""
    num_trials = 800
    results = TwoTokenCase.of(engine).check(engine, "perturbed", 1, num_trials, draws)
    accepted = sum(r.num_accepted_tokens for r in results)
    assert 0 < accepted < num_trials  # both the accept and the reject path were taken


# ---------------------------------------------------------------------------------------------
# the transformers backend under the same loop


@pytest.fixture(scope="module")
def hf_engine(tiny_llama_dir: Path) -> SpecEngine:
    return SpecEngine.from_config(EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 1024, "backend": "hf"},
        "drafters": [
            NgramDrafterConfig().model_dump(),
            {"kind": "model", "name": "self", "model": {"model": str(tiny_llama_dir), "backend": "hf"}, "draft_len": 4},
        ],
    }))


def test_hf_backend_engine_matches_fast_backend(hf_engine: SpecEngine, engine: SpecEngine, prompts: list[list[int]]) -> None:
    from workers.models.hf import HFCausalLM

    assert isinstance(hf_engine.target.model, HFCausalLM)
    for prompt in prompts[::2]:
        expected = plain(engine, prompt, greedy(30))
        for drafter, k in [(PLAIN, 0), ("self", 3), ("ngram", 4)]:
            result = hf_engine.generate(prompt, greedy(30), drafter, k)
            assert_same_output(result, expected)
            check_step_accounting(result, prompt)
        with_perturbed = with_drafters(hf_engine, perturbed=engine.drafters["perturbed"])
        result = with_perturbed.generate(prompt, greedy(30), "perturbed", 5)
        assert_same_output(result, expected)
        assert 0 < result.num_accepted_tokens < result.num_draft_tokens


# ---------------------------------------------------------------------------------------------
# prompts


def test_encode_applies_the_chat_template(engine: SpecEngine) -> None:
    tok = engine.tokenizer
    ids = engine.encode("Hello there")
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert tok.decode(ids).rstrip().endswith("assistant")
    assert "Hello there" in tok.decode(ids)
    assert engine.encode([{"role": "user", "content": "Hello there"}]) == ids
    raw = engine.encode("Hello there", chat=False)
    assert raw == tok.encode("Hello there")
    assert len(raw) < len(ids)


def test_encode_continues_a_started_assistant_message(engine: SpecEngine) -> None:
    """vLLM's continue_final_message: the assistant's message the client started stays open (its
    end token cut), so the output continues it; without the generation prompt the chat just ends."""
    tok = engine.tokenizer
    chat = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "My favourite is"}]
    continued = tok.decode(engine.encode(chat, generation_prompt=False, continue_final_message=True))
    assert continued.endswith("<|im_start|>assistant\nMy favourite is")
    closed = tok.decode(engine.encode(chat, generation_prompt=False))
    assert closed.rstrip().endswith("My favourite is<|im_end|>")
    assert tok.decode(engine.encode(chat)).rstrip().endswith("<|im_end|>\n<|im_start|>assistant")
