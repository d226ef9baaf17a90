"""`target.weights: bfloat16` and `auto`: a bfloat16 product computes a row the same whatever shares
its call; on a CPU that computes bfloat16 fast, the target's logits are bit for bit the same alone,
in a verify chain and in a batch, and its speculative and batched output is its plain output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.verify_cost import weight_bytes
from workers.batch import BatchEngine
from workers.config import PLAIN, EngineConfig, NgramDrafterConfig, TargetConfig
from workers.engine import SpecEngine, StepOrder
from workers.models.base import SeqInput
from workers.models.bf16 import Bf16Linear, bfloat16_available
from workers.models.cpu import cpu_bfloat16_pays
from workers.models.llama import Linear
from workers.models.quant import Int4Linear
from workers.sampling import SamplingParams
from workers.target import ModelLoadError, load_model

pytestmark = pytest.mark.skipif(not bfloat16_available(torch.device("cpu")), reason="torch built without oneDNN")
fast_bfloat16 = pytest.mark.skipif(not bfloat16_available(torch.device("cpu")) or not cpu_bfloat16_pays(),
                                   reason="no bfloat16 instructions: a bfloat16 target takes minutes here")


def test_a_bfloat16_product_computes_a_row_the_same_whatever_the_rows_around_it() -> None:
    """At every row count and place, and across the calls a long input is split into."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    lin = Bf16Linear(w)
    assert 1 <= lin.max_rows
    x = torch.randn(300, 128, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(300)])
    assert alone.dtype == torch.bfloat16
    for rows in (2, 3, 7, 16, 64, 130, 300):
        assert torch.equal(lin(x[:rows]), alone[:rows])
    lin.max_rows = 8  # as where the probe found a smaller invariant call
    assert torch.equal(lin(x[:50]), alone[:50])
    exact = x @ w.t()
    assert (lin(x).float() - exact).abs().max() <= 2e-2 * exact.abs().max()  # bfloat16 rounding
    assert lin.nbytes == 96 * 128 * 2


def test_weights_auto_takes_the_files_int4_blocks_and_bfloat16_needs_the_fast_backend(tiny_llama_dir: Path) -> None:
    shipped = load_model(TargetConfig(weights="auto", max_model_len=512)).model
    assert all(isinstance(layer.qkv, Int4Linear) for layer in shipped.layers)
    tiny = load_model(TargetConfig(model=str(tiny_llama_dir), weights="auto")).model  # no GGUF blocks
    expected = Bf16Linear if cpu_bfloat16_pays() else Linear
    assert isinstance(tiny.layers[0].qkv, expected) and isinstance(tiny.lm_head, expected)
    with pytest.raises(ModelLoadError, match="weights 'bfloat16' runs on the fast backend only"):
        load_model(TargetConfig(model=str(tiny_llama_dir), weights="bfloat16", backend="hf"))


@pytest.fixture(scope="module")
def bf16_engine() -> SpecEngine:
    return SpecEngine.from_config(EngineConfig(
        target=TargetConfig(weights="bfloat16", max_model_len=1024), drafters=[NgramDrafterConfig()],
        scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 64},
    ))


@pytest.fixture(scope="module")
def bf16_prompts(bf16_engine: SpecEngine, spec_bench) -> list[list[int]]:
    questions = spec_bench("summarization", 2) + spec_bench("writing", 1) + spec_bench("math_reasoning", 1)
    return [bf16_engine.encode(q["turns"][0]) for q in questions]


@fast_bfloat16
def test_a_bfloat16_rows_logits_are_bit_for_bit_the_same_alone_in_a_verify_chain_and_in_a_batch(
    bf16_engine: SpecEngine, bf16_prompts: list[list[int]],
) -> None:
    """Every product (the lm_head too) and the attention are row-invariant, so nothing differs."""
    model = bf16_engine.target.model
    pool = model.new_pool(len(bf16_prompts), 1024)
    caches = [pool.allocate() for _ in bf16_prompts]
    heads, tails = [torch.tensor(p[:-6]) for p in bf16_prompts], [torch.tensor(p[-6:]) for p in bf16_prompts]
    model.forward_batch([SeqInput(h, c, "none") for h, c in zip(heads, caches)])  # prefill side by side
    batched = model.forward_batch([SeqInput(t, c, "all") for t, c in zip(tails, caches)])
    for head, tail, out in zip(heads, tails, batched):
        alone = model.new_cache(1024)
        model.forward(head, alone, last_only=True)
        chain = model.forward(tail, alone).logits
        alone.truncate(head.numel())
        steps = torch.cat([model.forward(tail[i : i + 1], alone).logits for i in range(6)])
        assert torch.equal(chain, steps) and torch.equal(out.logits, steps)


@fast_bfloat16
def test_bfloat16_target_speculative_and_batched_output_equals_its_plain_output(
    bf16_engine: SpecEngine, bf16_prompts: list[list[int]],
) -> None:
    """Prompt lookup alone, and a batch mixing plain and prompt-lookup requests (more requests
    than slots, prompts prefilled in chunks beside decode rows): token for token."""
    params = SamplingParams(max_tokens=48)
    plain = [bf16_engine.generate(p, params).token_ids for p in bf16_prompts]
    drafted = [bf16_engine.generate(p, params, drafter="ngram", draft_len=6) for p in bf16_prompts]
    assert [r.token_ids for r in drafted] == plain
    assert sum(r.num_accepted_tokens for r in drafted) > 0  # the summaries copy their articles

    batch = BatchEngine(bf16_engine)
    gens = [batch.add(p, params) for p in bf16_prompts]
    orders = {g: StepOrder("ngram", 6) if i % 2 else StepOrder(PLAIN, 0) for i, g in enumerate(gens)}
    while batch.num_unfinished:
        step = batch.step({g: orders[g] for g in batch.schedule()})
        assert not step.failed
    assert [gen.output_ids for gen in gens] == plain


@fast_bfloat16
def test_the_bandwidth_floor_counts_the_bfloat16_bytes_a_step_reads(bf16_engine: SpecEngine) -> None:
    """Two bytes a weight, the lm_head included (the embeddings are read a row at a time)."""
    model = bf16_engine.target.model
    products = sum(lin.nbytes for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert products == 2 * 30 * 576 * (960 + 576 + 2 * 1536 + 1536)
    assert weight_bytes(model) == pytest.approx(products + model.lm_head.nbytes, rel=0.01)
