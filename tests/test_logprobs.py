"""Logprobs of generated tokens: the target's raw distribution at each token's position, read off
the row that verified it, whatever drafted the token (chains, trees, batches)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from workers.batch import BatchEngine
from workers.config import PLAIN, EngineConfig, ModelConfig, ModelDrafterConfig, NgramDrafterConfig, TreeConfig
from workers.engine import SpecEngine, StepOrder
from workers.logprobs import MIN_LOGPROB, TokenText, token_logprobs
from workers.result import GenerationResult
from workers.sampling import SamplingParams

NUM_TOP = 3
TEXTS = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "x = 1\ny = 2\nz = x + y\n"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tiny_drafter_dir: Path) -> SpecEngine:
    """The tiny float32 target with a chain drafter that always agrees, prompt lookup, and two
    tree drafters: the target's own two likeliest tokens (a sampled step often takes the second,
    off the tree's leading chain), and another model's three."""
    return SpecEngine.from_config(EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 512},
        "drafters": [
            NgramDrafterConfig().model_dump(),
            ModelDrafterConfig(name="self", model=ModelConfig(model=str(tiny_llama_dir))).model_dump(),
            ModelDrafterConfig(name="self_tree", model=ModelConfig(model=str(tiny_llama_dir)),
                               tree=TreeConfig(topk=2, nodes=6)).model_dump(),
            ModelDrafterConfig(name="other_tree", model=ModelConfig(model=str(tiny_drafter_dir)),
                               tree=TreeConfig(topk=3, nodes=8)).model_dump(),
        ],
    }))


def teacher_forced(engine: SpecEngine, result: GenerationResult) -> torch.Tensor:
    """[output tokens, vocab] log-probabilities of the plain model over prompt + output in one forward."""
    ids = torch.tensor(result.prompt_token_ids + result.token_ids)
    model = engine.target.model
    logits = model.forward(ids, model.new_cache(ids.numel())).logits
    return torch.log_softmax(logits[len(result.prompt_token_ids) - 1 : -1], dim=-1)


def assert_logprobs_of_the_target(engine: SpecEngine, result: GenerationResult) -> None:
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids)
    expected = teacher_forced(engine, result)
    for i, (entry, token) in enumerate(zip(result.logprobs, result.token_ids)):
        assert entry.chosen.token_id == token
        assert entry.chosen.logprob == pytest.approx(expected[i, token].item(), abs=1e-4)
        top = torch.topk(expected[i], NUM_TOP)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        assert [t.logprob for t in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("drafter", [PLAIN, "ngram", "self", "self_tree", "other_tree"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_tokens_logprobs_are_the_targets_at_its_position(
    engine: SpecEngine, drafter: str, temperature: float,
) -> None:
    params = SamplingParams(max_tokens=24, temperature=temperature, seed=3, logprobs=NUM_TOP)
    accepted = 0
    for text in TEXTS:
        result = engine.generate(engine.encode(text), params, drafter, 3)
        assert_logprobs_of_the_target(engine, result)
        accepted += result.num_accepted_tokens
    if drafter in ("self", "self_tree"):  # drafted tokens were kept: their rows were read
        assert accepted > 0


def test_a_sampled_tree_step_off_its_leading_chain_reads_the_path_rows(engine: SpecEngine) -> None:
    """The target's second likeliest token at a node is a candidate a sampled step takes often."""
    off_chain = 0
    for seed in range(3):
        gen = engine.start(engine.encode(TEXTS[0]), SamplingParams(max_tokens=64, temperature=1.0, seed=seed,
                                                                   logprobs=NUM_TOP))
        while not gen.finished:
            before = len(gen.output_ids)
            stats = gen.step("self_tree", 3)
            assert gen.logprobs is not None
            # an accepted draft token that is not its row's likeliest was the second child: when a
            # token follows it in the step, the path left the leading chain and went on
            off_chain += any(e.chosen.token_id != e.top[0].token_id
                             for e in gen.logprobs[before : before + stats.num_accepted][:-1])
        result = gen.result()
        gen.close()
        assert_logprobs_of_the_target(engine, result)
    assert off_chain > 0


def test_logprobs_in_a_batch_are_each_requests_own(engine: SpecEngine) -> None:
    params = SamplingParams(max_tokens=20, logprobs=NUM_TOP)
    batch = BatchEngine(engine)
    gens = [batch.add(engine.encode(text), params) for text in TEXTS * 2]
    orders = [StepOrder(PLAIN), StepOrder("self", 3), StepOrder("ngram", 4), StepOrder("other_tree", 2)]
    while batch.num_unfinished:
        step = batch.step({g: orders[gens.index(g)] for g in batch.schedule()})
        assert not step.failed
    for gen in gens:
        assert_logprobs_of_the_target(engine, gen.result())


def assert_prompt_logprobs_of_the_target(engine: SpecEngine, result: GenerationResult, num_top: int = NUM_TOP) -> None:
    """Each prompt token's logprob and its position's likeliest, as one forward over the prompt
    gives them; the first token has none."""
    ids = result.prompt_token_ids
    assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == len(ids)
    first = result.prompt_logprobs[0]
    assert first.chosen.token_id == ids[0] and first.chosen.logprob is None and first.top == ()
    model = engine.target.model
    expected = torch.log_softmax(model.forward(torch.tensor(ids), model.new_cache(len(ids))).logits, dim=-1)
    for i, entry in enumerate(result.prompt_logprobs[1:]):  # row i scores token i + 1
        assert entry.chosen.token_id == ids[i + 1]
        assert entry.chosen.logprob == pytest.approx(expected[i, ids[i + 1]].item(), abs=1e-4)
        top = torch.topk(expected[i], num_top)
        assert [t.token_id for t in entry.top] == top.indices.tolist()


LONG = " ".join(f"word{i}" for i in range(120))  # more prompt tokens than a batch step's budget


@pytest.mark.parametrize("chunk", [512, 5], ids=["one-forward", "chunked"])
def test_prompt_logprobs_are_the_targets(engine: SpecEngine, monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    monkeypatch.setattr("workers.engine.PROMPT_LOGPROBS_CHUNK", chunk)
    params = SamplingParams(max_tokens=4, prompt_logprobs=NUM_TOP, logprobs=NUM_TOP)
    result = engine.generate(engine.encode(TEXTS[0], chat=False), params, "ngram", 3)
    assert_prompt_logprobs_of_the_target(engine, result)
    assert_logprobs_of_the_target(engine, result)  # the output's are unchanged by scoring the prompt
    one = engine.generate(engine.encode("x", chat=False), params)
    assert [e.chosen.logprob for e in one.prompt_logprobs] == [None]  # nothing precedes a single token


def test_prompt_logprobs_in_a_batch_over_chunked_prefill(engine: SpecEngine) -> None:
    batch = BatchEngine(engine)
    budget = engine.config.scheduler.max_num_batched_tokens
    long, short = engine.encode(LONG, chat=False), engine.encode(TEXTS[1], chat=False)
    assert len(long) > budget  # its prefill takes two steps, each chunk scored
    scored = SamplingParams(max_tokens=6, prompt_logprobs=1)
    gens = [batch.add(long, scored), batch.add(short, SamplingParams(max_tokens=6)), batch.add(short, scored)]
    while batch.num_unfinished:
        assert not batch.step({g: StepOrder("self", 2) for g in batch.schedule()}).failed
    results = [g.result() for g in gens]
    assert results[1].prompt_logprobs is None
    for result in (results[0], results[2]):
        assert_prompt_logprobs_of_the_target(engine, result, num_top=1)


def test_no_logprobs_unless_asked(engine: SpecEngine) -> None:
    assert engine.generate(engine.encode(TEXTS[1]), SamplingParams(max_tokens=4)).logprobs is None
    with pytest.raises(ValueError, match="logprobs must be in"):
        SamplingParams(logprobs=21)


def test_token_logprobs_rank_and_clamp() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, float("-inf")], [0.0, 0.0, 3.0, 1.0]])

    class Chars:  # a stand-in tokenizer: token i is the letter "abcd"[i]
        def decode(self, ids: list[int]) -> str:
            return "abcd"[ids[0]]

        def convert_ids_to_tokens(self, i: int) -> str:
            return "abcd"[i]

    got = token_logprobs(logits, [3, 1], 2, TokenText(Chars()))
    expected = torch.log_softmax(logits, -1)
    assert got[0].chosen.logprob == MIN_LOGPROB  # -inf is not JSON
    assert got[1].chosen.logprob == pytest.approx(expected[1, 1].item())
    assert [(t.token, t.token_id) for t in got[1].top] == [("c", 2), ("d", 3)]
    assert [t.rank for t in got[1].top] == [1, 2]
    assert (got[0].chosen.rank, got[1].chosen.rank) == (4, 3)  # 1 + the strictly likelier: a tie does not count
    assert [t.logprob for t in got[0].top] == pytest.approx(expected[0, :2].tolist())
    assert token_logprobs(logits, [0, 0], 0, TokenText(Chars()))[0].top == ()


def test_token_text_gives_each_tokens_exact_bytes(target_dir: Path) -> None:
    """A byte-level vocabulary splits a character across tokens: each token's bytes are its own,
    and the tokens' bytes join into the text's UTF-8."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    text = TokenText(tokenizer)
    sample = "héllo wörld 日本語 🙂"
    ids = tokenizer.encode(sample)
    pieces = [text.of(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in pieces) == sample.encode("utf-8")
    assert any("\ufffd" in t for t, _ in pieces)  # some token holds part of a character
    assert [t for t, _ in pieces if "\ufffd" not in t] == [tokenizer.decode([i]) for i in ids
                                                          if "\ufffd" not in tokenizer.decode([i])]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert text.of(end) == ("<|im_end|>", tuple(b"<|im_end|>"))
