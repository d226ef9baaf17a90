"""Greedy losslessness on the shipped target (SmolLM2-135M-Instruct) with Spec-Bench prompts.

Speculative decoding verifies several tokens in one forward, whose matrix products may round
differently from plain decoding's one-token forwards; on a real model near-ties exist, so this is
where token identity is really at stake. A mismatch is reported with its position and the
target's logit gap there.
"""

from __future__ import annotations

import pytest
import torch
from helpers import chain_accepts

from bench.agreement import position_hits
from policies.paths import REPO_ROOT
from workers.config import EagleDrafterConfig, MedusaDrafterConfig, ModelConfig, ModelDrafterConfig, TreeConfig
from workers.drafters.registry import build_drafter
from workers.engine import PLAIN, GenerationResult, SpecEngine
from workers.sampling import SamplingParams

MAX_TOKENS = 48
PROMPTS = [("summarization", 0), ("summarization", 1), ("rag", 0), ("coding", 0), ("translation", 0)]
IDS = [f"{c}{i}" for c, i in PROMPTS]


@pytest.fixture(scope="module")
def prompt_ids(real_engine: SpecEngine, spec_bench) -> dict[str, list[int]]:
    out = {}
    for category, i in PROMPTS:
        question = spec_bench(category, i + 1)[i]
        out[f"{category}{i}"] = real_engine.encode(question["turns"][0])
    return out


_results: dict[tuple[str, str], GenerationResult] = {}


def run(engine: SpecEngine, prompt_ids: dict[str, list[int]], name: str, drafter: str = PLAIN,
        k: int | None = None) -> GenerationResult:
    key = (name, drafter)
    if key not in _results:
        _results[key] = engine.generate(prompt_ids[name], SamplingParams(max_tokens=MAX_TOKENS), drafter, k)
    return _results[key]


def describe_mismatch(engine: SpecEngine, prompt: list[int], expected: list[int], got: list[int]) -> str:
    i = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
    if i >= min(len(expected), len(got)):
        return f"outputs differ in length: plain {len(expected)} tokens, speculative {len(got)}"
    model = engine.target.model
    ids = torch.tensor(prompt + expected[:i])
    logits = model.forward(ids, model.new_cache(len(ids)), last_only=True).logits[0]
    top2 = torch.topk(logits, 2)
    gap = logits[expected[i]] - logits[got[i]]
    tok = engine.tokenizer
    return (
        f"first difference at output position {i}: plain {expected[i]} {tok.decode([expected[i]])!r}, "
        f"speculative {got[i]} {tok.decode([got[i]])!r}; one-pass logit gap between them {gap.item():.3e} "
        f"(top-2 gap {(top2.values[0] - top2.values[1]).item():.3e})"
    )


def assert_identical(engine: SpecEngine, prompt: list[int], expected: GenerationResult, got: GenerationResult) -> None:
    assert got.token_ids == expected.token_ids, describe_mismatch(engine, prompt, expected.token_ids, got.token_ids)
    assert got.text == expected.text
    assert got.finish_reason == expected.finish_reason


@pytest.fixture(scope="module")
def self_drafting_engine(real_engine: SpecEngine, target_dir) -> SpecEngine:
    """The real target plus a `model` drafter loaded from the target's own directory: it drafts
    exactly what plain decoding would, so every rejection is a numerical near-tie."""
    config = ModelDrafterConfig(name="self", model=ModelConfig(model=str(target_dir)), draft_len=4)
    drafter = build_drafter(config, real_engine.target)
    return SpecEngine(real_engine.target, {**real_engine.drafters, "self": drafter}, real_engine.config)


def test_prompts_use_the_chat_template(real_engine: SpecEngine, prompt_ids: dict[str, list[int]]) -> None:
    tok = real_engine.tokenizer
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    for name, ids in prompt_ids.items():
        assert ids[0] == im_start, name
        text = tok.decode(ids)
        assert "<|im_start|>user\n" in text
        assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", IDS)
def test_ngram_greedy_identical_to_plain(real_engine: SpecEngine, prompt_ids: dict[str, list[int]], name: str) -> None:
    expected = run(real_engine, prompt_ids, name)
    got = run(real_engine, prompt_ids, name, "ngram")
    assert_identical(real_engine, prompt_ids[name], expected, got)
    assert sum(s.num_emitted for s in got.steps) == len(got.token_ids)
    assert all(s.num_accepted <= s.num_draft_tokens for s in got.steps)


def test_ngram_accepts_tokens_on_summarization(real_engine: SpecEngine, prompt_ids: dict[str, list[int]]) -> None:
    for name in ("summarization0", "summarization1"):
        result = run(real_engine, prompt_ids, name, "ngram")
        assert result.num_accepted_tokens > 0, name
        assert result.num_steps < len(result.token_ids)  # fewer target forwards than tokens
        assert result.mean_acceptance_length > 1.0
    plain = run(real_engine, prompt_ids, "summarization0")
    assert plain.mean_acceptance_length == 1.0


@pytest.mark.parametrize("name", ["summarization0", "coding0", "translation0"])
def test_model_drafter_greedy_identical_to_plain(self_drafting_engine: SpecEngine, real_engine: SpecEngine,
                                                prompt_ids: dict[str, list[int]], name: str) -> None:
    expected = run(real_engine, prompt_ids, name)
    got = self_drafting_engine.generate(prompt_ids[name], SamplingParams(max_tokens=MAX_TOKENS), "self", 4)
    assert_identical(real_engine, prompt_ids[name], expected, got)
    assert got.drafters == ["self"]
    # the target drafting for itself: rejections only at numerical near-ties
    assert got.num_accepted_tokens >= 0.8 * got.num_draft_tokens
    assert got.num_steps < len(got.token_ids)


# the trained drafters shipped in models/ (their CARD.md says how they were made)
SHIPPED = {
    "distilled": ModelDrafterConfig(name="distilled", model=ModelConfig(model=str(REPO_ROOT / "models" / "distilled"))),
    "eagle": EagleDrafterConfig(path="models/eagle"),
    "medusa": MedusaDrafterConfig(path="models/medusa"),
    # draft trees (workers/tree.py) of the same drafters
    "distilled_tree": ModelDrafterConfig(name="distilled_tree", tree=TreeConfig(),
                                         model=ModelConfig(model=str(REPO_ROOT / "models" / "distilled"))),
    "eagle_tree": EagleDrafterConfig(name="eagle_tree", path="models/eagle", tree=TreeConfig()),
    "medusa_tree": MedusaDrafterConfig(name="medusa_tree", path="models/medusa", tree=TreeConfig()),
}


@pytest.fixture(scope="module")
def shipped_engine(real_engine: SpecEngine) -> SpecEngine:
    drafters = {name: build_drafter(config, real_engine.target) for name, config in SHIPPED.items()}
    return SpecEngine(real_engine.target, {**real_engine.drafters, **drafters}, real_engine.config)


@pytest.mark.parametrize("drafter", sorted(SHIPPED))
@pytest.mark.parametrize("name", ["coding0", "rag0"])
def test_shipped_drafters_greedy_identical_to_plain(shipped_engine: SpecEngine, real_engine: SpecEngine,
                                                    prompt_ids: dict[str, list[int]], name: str, drafter: str) -> None:
    expected = run(real_engine, prompt_ids, name)
    got = shipped_engine.generate(prompt_ids[name], SamplingParams(max_tokens=MAX_TOKENS), drafter, 3)
    assert_identical(real_engine, prompt_ids[name], expected, got)
    assert got.drafters == [drafter] and got.num_accepted_tokens > 0  # they draft, and some drafts land


def test_plain_decoding_stops_at_eos_within_budget(real_engine: SpecEngine, prompt_ids: dict[str, list[int]]) -> None:
    """The translation prompt ends with EOS inside the budget: speculative decoding stops at the
    same EOS, not after it (the ngram run's comparison above checks the tokens)."""
    eos = real_engine.target.model.info.eos_token_ids
    for name in IDS:
        result = run(real_engine, prompt_ids, name)
        if result.finish_reason == "stop":
            assert result.token_ids[-1] in eos
        else:
            assert len(result.token_ids) == MAX_TOKENS
    assert any(run(real_engine, prompt_ids, name).finish_reason == "stop" for name in IDS)


@pytest.mark.parametrize("drafter", ["distilled", "eagle", "medusa"])
def test_teacher_forced_agreement_is_what_a_k1_chain_accepts(shipped_engine: SpecEngine, real_engine: SpecEngine,
                                                             prompt_ids: dict[str, list[int]], drafter: str) -> None:
    """bench/agreement.py's top-1 hits, walked as a k = 1 chain walks (a hit moves two tokens on,
    a miss one), give what speculative decoding with k = 1 accepts."""
    predicted = accepted = 0
    for name in ("coding0", "rag0"):
        plain = run(real_engine, prompt_ids, name)
        hits, _ = position_hits(shipped_engine, shipped_engine.drafters[drafter], prompt_ids[name], plain.token_ids)
        predicted += chain_accepts(hits[:, 0].tolist(), plain.finish_reason == "length")
        accepted += shipped_engine.generate(prompt_ids[name], SamplingParams(max_tokens=MAX_TOKENS), drafter,
                                            1).num_accepted_tokens
    assert predicted == accepted > 0
