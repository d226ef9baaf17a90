"""`target.weights: int4`: the shipped GGUF file's 4-bit blocks read exactly, products that compute
a row the same way whatever else is in the forward, and speculative and batched decoding on the
int4 target against its own plain decoding: identical, or apart only where the target's top two
logits are within the int4 path's rounding spread (INT4_TIE, docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from workers.batch import BatchEngine
from workers.config import PLAIN, EngineConfig, ModelConfig, NgramDrafterConfig, TargetConfig
from workers.engine import SpecEngine, StepOrder
from workers.models.quant import GROUP_SIZE, Int4Linear, Int4Weight, read_gguf_int4
from workers.sampling import SamplingParams
from workers.target import ModelLoadError, _resolve_pkg, load_model

TARGET_GGUF = ModelConfig().model
# the largest logit difference measured between a row computed alone, in a verify chain and in a
# batch (bfloat16 rounding before each product turns attention's float32 rounding into this)
INT4_TIE = 1.0


def test_int4_weights_are_the_files_values(target_dir: Path) -> None:
    """Every layer product read from the Q4_1 blocks dequantises bit for bit to the float32
    weights transformers makes of the same file (q and k rows back in Hugging Face's order)."""
    weights = read_gguf_int4(_resolve_pkg(TARGET_GGUF), num_layers=30, num_heads=9, num_kv_heads=3)
    floats: dict[str, torch.Tensor] = {}
    for path in target_dir.glob("*.safetensors"):
        floats.update(load_file(str(path)))
    assert len(weights) == 30 * 7
    for name, w in weights.items():
        assert torch.equal(w.dequantize(), floats[name]), name


def _random_weight(out: int, inp: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    groups = inp // GROUP_SIZE
    return Int4Weight(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.int32),
                      torch.rand(groups, out, generator=g) * 0.02, torch.randn(groups, out, generator=g) * 0.05)


def test_an_int4_row_is_computed_the_same_whatever_the_rows_around_it() -> None:
    """Scored rows (int4 kernel) and prefill rows (dense bfloat16) are each batch-invariant, bit
    for bit, and both are the weights' product up to bfloat16 rounding."""
    w = _random_weight(96, 128)
    lin = Int4Linear(w)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1))
    scored, bulk = lin(x[:1]), lin(x[:1], num_scored=0)
    for rows in (2, 3, 16, 40):
        assert torch.equal(lin(x[:rows])[:1], scored)
        assert torch.equal(lin(x[:rows], num_scored=0)[:1], bulk)
    mixed = lin(x[:10], num_scored=4)
    assert torch.equal(mixed[:4], lin(x[:4])) and torch.equal(mixed[4:], lin(x[4:10], num_scored=0))
    exact = x[:10] @ w.dequantize().t()
    for y in (lin(x[:10]), lin(x[:10], num_scored=0)):
        assert (y - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_int4_needs_a_gguf_file(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"weights 'int4' needs a \.gguf file"):
        load_model(TargetConfig(model=str(tiny_llama_dir), weights="int4"))


@pytest.fixture(scope="module")
def int4_engine() -> SpecEngine:
    return SpecEngine.from_config(EngineConfig(
        target=TargetConfig(weights="int4", max_model_len=1024), drafters=[NgramDrafterConfig()],
        scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 64},
    ))


@pytest.fixture(scope="module")
def int4_prompts(int4_engine: SpecEngine, spec_bench) -> list[list[int]]:
    questions = spec_bench("summarization", 2) + spec_bench("writing", 1) + spec_bench("math_reasoning", 1)
    return [int4_engine.encode(q["turns"][0]) for q in questions]


def assert_same_or_int4_tie(engine: SpecEngine, prompt: list[int], got: list[int], expected: list[int]) -> None:
    if got == expected:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    model = engine.target.model
    logits = model.forward(torch.tensor(prompt + expected[:i]), model.new_cache(len(prompt) + i + 1),
                           last_only=True).logits[0]
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() < INT4_TIE, f"position {i}: {got[i:i + 3]} vs {expected[i:i + 3]}, top-2 {top2}"


def test_int4_target_speculative_and_batched_output_follows_its_plain_output(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """Prompt lookup alone, and a batch mixing plain and prompt-lookup requests (more requests
    than slots, prompts prefilled in chunks beside decode rows), against the int4 target's own
    plain output."""
    params = SamplingParams(max_tokens=48)
    plain = [int4_engine.generate(p, params).token_ids for p in int4_prompts]
    drafted = [int4_engine.generate(p, params, drafter="ngram", draft_len=6) for p in int4_prompts]
    for prompt, r, expected in zip(int4_prompts, drafted, plain):
        assert_same_or_int4_tie(int4_engine, prompt, r.token_ids, expected)
    assert sum(r.num_accepted_tokens for r in drafted) > 0  # the summaries copy their articles

    batch = BatchEngine(int4_engine)
    gens = [batch.add(p, params) for p in int4_prompts]
    orders = {g: StepOrder("ngram", 6) if i % 2 else StepOrder(PLAIN, 0) for i, g in enumerate(gens)}
    while batch.num_unfinished:
        step = batch.step({g: orders[g] for g in batch.schedule()})
        assert not step.failed
    for prompt, gen, expected in zip(int4_prompts, gens, plain):
        assert_same_or_int4_tie(int4_engine, prompt, gen.output_ids, expected)
