"""`target.weights: bfloat16` and `auto`: a bfloat16 product computes a row the same whatever shares
its call; on a CPU that computes bfloat16 fast, the target's logits are bit for bit the same alone,
in a verify chain and in a batch, and its speculative and batched output is its plain output."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import (
    compact_prompts,
    compact_target_engine,
    decode_three_ways,
    logits_three_ways,
    tree_rows_and_chains,
)

from bench.verify_cost import weight_bytes
from workers.config import TargetConfig
from workers.engine import SpecEngine
from workers.models import cpu
from workers.models.bf16 import Bf16Linear, CallRows, bfloat16_available, bfloat16_fast
from workers.models.llama import Linear
from workers.models.quant import Int4Linear
from workers.target import ModelLoadError, load_model

bfloat16_products = pytest.mark.skipif(not bfloat16_available(torch.device("cpu")),
                                       reason="no oneDNN bfloat16 product for this torch build or CPU (AVX2 only)")
fast_bfloat16 = pytest.mark.skipif(not bfloat16_fast(torch.device("cpu")),
                                   reason="no bfloat16 instructions: a bfloat16 target takes minutes here")


@bfloat16_products
def test_a_bfloat16_product_computes_a_row_the_same_whatever_the_rows_around_it() -> None:
    """At every row count and place, and across the calls a long input is split into."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 128, generator=g) * 0.05
    lin = Bf16Linear(w)
    assert 1 <= lin.rows.min_rows <= lin.rows.max_rows
    x = torch.randn(300, 128, generator=g)
    alone = torch.cat([lin(x[i : i + 1]) for i in range(300)])
    assert alone.dtype == torch.bfloat16
    for rows in (2, 3, 7, 16, 64, 130, 300):
        assert torch.equal(lin(x[:rows]), alone[:rows])
    lin.rows = CallRows(3, 8)  # as where the probe found a narrower range: 50 rows = 6 calls of 8 + 2 padded to 3
    assert torch.equal(lin(x[:50]), alone[:50]) and torch.equal(lin(x[:2]), alone[:2])
    exact = x @ w.t()
    assert (lin(x).float() - exact).abs().max() <= 2e-2 * exact.abs().max()  # bfloat16 rounding
    assert lin.nbytes == 96 * 128 * 2


@bfloat16_products
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (192, 576)])
def test_the_target_shapes_compute_every_row_alike_in_calls_of_any_size(shape: tuple[int, int]) -> None:
    """The probe's range holds on other data, row by row over many rows: a kernel that treats
    one row differently (a split reduction) differs in ~2e-4 of the outputs, which a few rows
    would miss (the down projection's shape on an AMD EPYC with AVX512-BF16)."""
    g = torch.Generator().manual_seed(1)
    lin = Bf16Linear(torch.randn(*shape, generator=g) * 0.05)
    x = torch.randn(512, shape[1], generator=g)
    alone = torch.cat([lin(row) for row in x.split(1)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 16, 33):
        assert torch.equal(torch.cat([lin(part) for part in x.split(rows)]), alone), rows


def test_weights_auto_takes_the_files_int4_blocks_and_bfloat16_needs_the_fast_backend(tiny_llama_dir: Path) -> None:
    shipped = load_model(TargetConfig(weights="auto", max_model_len=512)).model
    assert all(isinstance(layer.qkv, Int4Linear) for layer in shipped.layers)
    tiny = load_model(TargetConfig(model=str(tiny_llama_dir), weights="auto")).model  # no GGUF blocks
    expected = Bf16Linear if bfloat16_fast(torch.device("cpu")) else Linear
    assert isinstance(tiny.layers[0].qkv, expected) and isinstance(tiny.lm_head, expected)
    with pytest.raises(ModelLoadError, match="weights 'bfloat16' runs on the fast backend only"):
        load_model(TargetConfig(model=str(tiny_llama_dir), weights="bfloat16", backend="hf"))


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx512_bf16": True, "amx_tile": False, "avx512": True, "avx2": True}, True),
    ({"avx512_bf16": False, "amx_tile": True, "avx512": True, "avx2": True}, True),
    ({"avx512_bf16": False, "amx_tile": False, "avx512": False, "avx2": True}, False),
    ({"avx512_bf16": False, "amx_tile": False, "avx512": True, "avx2": True}, "timed"),  # AVX-512 without BF16
    ({"avx512_bf16": False, "amx_tile": False, "avx512": False, "avx2": False}, "timed"),  # not x86
])
def test_the_cpus_flags_decide_whether_bfloat16_pays_and_a_timing_only_where_they_cannot(
    monkeypatch: pytest.MonkeyPatch, flags: dict[str, bool], expected: bool | str,
) -> None:
    """A timing misreads a busy CPU, so it never overrides the flags."""
    for flag, value in flags.items():
        monkeypatch.setattr(torch.cpu, f"_is_{flag}_supported", lambda value=value: value)
    monkeypatch.setattr(cpu, "_bfloat16_timed_near_float32", lambda: "timed")
    assert cpu.cpu_bfloat16_pays.__wrapped__() == expected


@pytest.fixture(scope="module")
def bf16_engine() -> SpecEngine:
    return compact_target_engine("bfloat16")


@pytest.fixture(scope="module")
def bf16_prompts(bf16_engine: SpecEngine, spec_bench) -> list[list[int]]:
    return compact_prompts(bf16_engine, spec_bench)


@fast_bfloat16
def test_a_bfloat16_rows_logits_are_bit_for_bit_the_same_alone_in_a_verify_chain_and_in_a_batch(
    bf16_engine: SpecEngine, bf16_prompts: list[list[int]],
) -> None:
    """Every product (the lm_head too) and the attention are row-invariant, so nothing differs."""
    for three in logits_three_ways(bf16_engine, bf16_prompts):
        assert torch.equal(three.chain, three.steps) and torch.equal(three.batched, three.steps)


@fast_bfloat16
def test_every_node_of_a_bfloat16_draft_tree_is_scored_bit_for_bit_as_a_chain_through_it(
    bf16_engine: SpecEngine, bf16_prompts: list[list[int]],
) -> None:
    """Each root path in an attention call of its own (workers/models/llama.py _TreeAttention)."""
    for seed, prompt in enumerate(bf16_prompts):
        for rows in tree_rows_and_chains(bf16_engine, prompt, seed=seed):
            for scored in (rows.alone, rows.batched, rows.among_trees):
                assert torch.equal(scored, rows.chains), rows.tree


@fast_bfloat16
def test_bfloat16_target_speculative_and_batched_output_equals_its_plain_output(
    bf16_engine: SpecEngine, bf16_prompts: list[list[int]],
) -> None:
    """Prompt lookup and lookahead decoding alone, and a batch mixing plain, prompt-lookup and
    lookahead requests (draft trees): token for token."""
    out = decode_three_ways(bf16_engine, bf16_prompts)
    assert [r.token_ids for r in out.drafted] == out.plain
    assert sum(r.num_accepted_tokens for r in out.drafted) > 0  # the summaries copy their articles
    assert out.batched == out.plain
    assert [r.token_ids for r in out.lookahead] == out.plain  # draft trees
    assert sum(r.num_accepted_tokens for r in out.lookahead) > 0


@fast_bfloat16
def test_the_bandwidth_floor_counts_the_bfloat16_bytes_a_step_reads(bf16_engine: SpecEngine) -> None:
    """Two bytes a weight, the lm_head included (the embeddings are read a row at a time)."""
    model = bf16_engine.target.model
    products = sum(lin.nbytes for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert products == 2 * 30 * 576 * (960 + 576 + 2 * 1536 + 1536)
    assert weight_bytes(model) == pytest.approx(products + model.lm_head.nbytes, rel=0.01)
