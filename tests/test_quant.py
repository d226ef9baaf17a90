"""`target.weights: int4`: the shipped GGUF file's 4-bit blocks read exactly; a row's logits the
same alone, in a verify chain and in a batch (the products and the attention are row-invariant);
speculative and batched decoding on the int4 target identical to its own plain decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
import torch
from helpers import (
    assert_same_or_tie,
    compact_prompts,
    compact_target_engine,
    decode_three_ways,
    logits_three_ways,
    tree_rows_and_chains,
)
from safetensors.torch import load_file, save_file

import workers.engine as engine_module
import workers.models.llama as llama
import workers.models.quant as quant
from bench.verify_cost import weight_bytes
from workers.config import ModelConfig, TargetConfig
from workers.engine import PLAIN, SpecEngine
from workers.models.base import SeqInput
from workers.models.bf16 import bfloat16_available, bfloat16_fast
from workers.models.fp16 import float16_available
from workers.models.llama import (
    FastLlama,
    KeySpan,
    KVPool,
    _additive,
    _attention_groups,
    _AttnGroup,
    _whole_blocks,
    invariant_key_span,
)
from workers.models.quant import GROUP_SIZE, DenseCopy, Int4Linear, Int4Weight, load_int4, read_gguf_int4, save_int4
from workers.routing import tree_sizes
from workers.sampling import SamplingParams
from workers.target import INT4_BLOCKS_FILE, ModelLoadError, _resolve_pkg, load_model
from workers.tree import DraftTree
from workers.verify import VerifyResult, verify_tree_greedy

TARGET_GGUF = ModelConfig().model


def test_int4_weights_are_the_files_values(target_dir: Path, tmp_path: Path) -> None:
    """Every layer product read from the Q4_1 blocks dequantises bit for bit to the float32
    weights transformers makes of the same file (q and k rows back in Hugging Face's order);
    the blocks file a later load reads instead of the GGUF holds the same values."""
    weights = read_gguf_int4(_resolve_pkg(TARGET_GGUF), num_layers=30, num_heads=9, num_kv_heads=3)
    floats = load_file(str(target_dir / "model.safetensors"))
    assert len(weights) == 30 * 7
    for name, w in weights.items():
        assert torch.equal(w.dequantize(), floats[name]), name
    save_int4(weights, tmp_path / "blocks.safetensors")
    kept = load_int4(tmp_path / "blocks.safetensors")
    assert kept is not None and kept.keys() == weights.keys()
    for name, w in weights.items():
        assert all(torch.equal(getattr(kept[name], f), getattr(w, f)) for f in ("q", "scales", "zeros")), name


def test_a_blocks_file_of_another_format_or_cut_short_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "blocks.safetensors"
    assert load_int4(path) is None  # none yet
    save_int4({"w": _random_weight(8, 64)}, path)
    assert load_int4(path) is not None
    path.write_bytes(path.read_bytes()[:100])
    assert load_int4(path) is None
    save_file({"w.q": torch.zeros(8, 32, dtype=torch.uint8)}, str(path), metadata={"format": "other"})
    assert load_int4(path) is None


def test_int4_prompt_rows_take_a_dense_copy_unless_configured_not_to() -> None:
    """`target.dense_prefill`: the copy where this CPU has a fast one (bfloat16, else fbgemm's
    float16), none when turned off: prompt rows then take the int4 kernel, as scored rows do."""
    default = load_model(TargetConfig(weights="int4")).model
    assert isinstance(default, FastLlama)
    fast = bfloat16_fast(torch.device("cpu")) or float16_available()
    assert (default.layers[0].qkv.dense is not None) == fast
    assert default.prompt_rows_as_scored == (not fast)
    lean = load_model(TargetConfig(weights="int4", dense_prefill=False)).model
    assert isinstance(lean, FastLlama)
    assert all(layer.qkv.dense is None and layer.down.dense is None for layer in lean.layers)
    assert lean.prompt_rows_as_scored
    assert weight_bytes(lean) == weight_bytes(default)  # a step streams the int4 blocks either way


def test_a_later_int4_load_reads_the_kept_blocks_not_the_gguf(
    target_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first load keeps the blocks beside the converted model; a load then never parses the
    GGUF file (gguf-py reads all 147k metadata fields on the way: ~5 s a start)."""
    load_model(TargetConfig(weights="int4"))
    assert load_int4(target_dir / INT4_BLOCKS_FILE) is not None

    def parse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(quant, "read_gguf_int4", parse)
    model = load_model(TargetConfig(weights="int4")).model
    assert isinstance(model, FastLlama) and isinstance(model.layers[0].qkv, Int4Linear)


def _random_weight(out: int, inp: int, seed: int = 0) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    groups = inp // GROUP_SIZE
    return Int4Weight(torch.randint(0, 16, (out, inp), generator=g, dtype=torch.int32),
                      torch.rand(groups, out, generator=g) * 0.02, torch.randn(groups, out, generator=g) * 0.05)


@pytest.mark.parametrize("dense", ["bfloat16", "float16", "none"])
def test_an_int4_product_computes_a_row_the_same_whatever_the_rows_around_it(dense: DenseCopy) -> None:
    """Scored rows (the int4 kernel) at every row count, prefill rows (the dense bfloat16 product
    in calls of its probed row counts, fbgemm's float16 one in calls of a multiple of its probed
    granule, or the int4 kernel) at every count and place: bit for bit; both the weights'
    product up to bfloat16 rounding."""
    if dense == "float16" and not float16_available():
        pytest.skip("torch built without fbgemm (not x86)")
    if dense == "bfloat16" and not bfloat16_available(torch.device("cpu")):
        pytest.skip("no oneDNN bfloat16 product for this torch build or CPU (AVX2 only)")
    w = _random_weight(96, 128)
    lin = Int4Linear(w, dense=dense)
    assert (lin.dense is not None) == (dense != "none")  # no dense copy where it is not used
    x = torch.randn(600, 128, generator=torch.Generator().manual_seed(1))
    first, first_bulk, last_bulk = lin(x[:1]), lin(x[:1], num_scored=0), lin(x[599:], num_scored=0)
    for rows in (2, 3, 16, 64, 120, 256, 300, 600):
        assert torch.equal(lin(x[:rows])[:1], first)
        assert torch.equal(lin(x[:rows], num_scored=0)[:1], first_bulk)
    assert torch.equal(lin(x[500:], num_scored=0)[99:], last_bulk)  # another place in its call
    mixed = lin(x[:10], num_scored=4)
    assert torch.equal(mixed[:4], lin(x[:4])) and torch.equal(mixed[4:], lin(x[4:10], num_scored=0))
    exact = x[:16] @ w.dequantize().t()
    for y in (lin(x[:16]), lin(x[:16], num_scored=0)):
        assert (y - exact).abs().max() <= 2e-2 * exact.abs().max()


def test_int4_needs_a_gguf_file(tiny_llama_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"weights 'int4' needs a \.gguf file"):
        load_model(TargetConfig(model=str(tiny_llama_dir), weights="int4"))


@pytest.fixture(scope="module")
def int4_engine() -> SpecEngine:
    return compact_target_engine("int4")


@pytest.fixture(scope="module")
def int4_prompts(int4_engine: SpecEngine, spec_bench) -> list[list[int]]:
    return compact_prompts(int4_engine, spec_bench)


def test_an_int4_rows_logits_are_the_same_alone_in_a_verify_chain_and_in_a_batch(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """Rounding each product's input to bfloat16 magnifies float32 differences ~10^4-fold, so
    this holds only because the attention is row-invariant too: bit for bit with a bfloat16 or
    float16 lm_head, else (a float32 one: neither bfloat16 instructions nor fbgemm) differing by
    its kernel choice at most, as on the float32 target."""
    exact = not isinstance(int4_engine.target.model.lm_head, llama.Linear)
    for three in logits_three_ways(int4_engine, int4_prompts):
        if exact:
            assert torch.equal(three.chain, three.steps) and torch.equal(three.batched, three.steps)
        torch.testing.assert_close(three.chain, three.steps, atol=2e-4, rtol=0)
        torch.testing.assert_close(three.batched, three.steps, atol=2e-4, rtol=0)


def test_int4_target_speculative_and_batched_output_equals_its_plain_output(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """Prompt lookup and lookahead decoding alone, and a batch mixing plain, prompt-lookup and
    lookahead requests (draft trees): the int4 target's own plain output (a differing token only at a
    float32 tie of the top two logits)."""
    out = decode_three_ways(int4_engine, int4_prompts)
    for prompt, r, expected in zip(int4_prompts, out.drafted, out.plain):
        assert_same_or_tie(int4_engine, prompt, r.token_ids, expected)
    assert sum(r.num_accepted_tokens for r in out.drafted) > 0  # the summaries copy their articles
    for prompt, got, expected in zip(int4_prompts, out.batched, out.plain):
        assert_same_or_tie(int4_engine, prompt, got, expected)
    for prompt, r, expected in zip(int4_prompts, out.lookahead, out.plain):  # draft trees
        assert_same_or_tie(int4_engine, prompt, r.token_ids, expected)


def test_int4_seeded_sampling_gives_plain_sampling_output_under_any_drafter_alone_and_in_a_batch(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """Draws keyed by position (the default `seeded_draws`) on a target that scores a row alike in
    any call: prompt lookup and lookahead (draft trees) alone, a batch mixing them with plain
    requests, and a request switching drafters step by step give exactly the tokens plain
    sampling gives with the request's seed."""
    if isinstance(int4_engine.target.model.lm_head, llama.Linear):
        pytest.skip("a float32 lm_head's kernel changes a row's last bits with the call's rows here")
    params = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.95, seed=3)
    out = decode_three_ways(int4_engine, int4_prompts, params=params)
    for runs in (out.drafted, out.lookahead):
        assert [r.token_ids for r in runs] == out.plain
    assert out.batched == out.plain
    assert sum(r.num_accepted_tokens for r in [*out.drafted, *out.lookahead]) > 0
    gen = int4_engine.start(int4_prompts[0], params)
    schedule = [("ngram", 6), (PLAIN, 0), ("lookahead", 2), ("ngram", 2)]
    while not gen.finished:
        gen.step(*schedule[len(gen.steps) % len(schedule)])
    assert gen.result().token_ids == out.plain[0]
    gen.close()


def test_eagle_racing_the_keyed_draws_gives_plain_sampling_output(row_invariant_engine: SpecEngine, spec_bench) -> None:
    """EAGLE drafts by racing its own distribution on the request's keyed draws (open chat, where
    prompt lookup has little to copy): its output is plain sampling's with the seed, and it is
    accepted."""
    engine = row_invariant_engine
    if isinstance(engine.target.model.lm_head, llama.Linear):
        pytest.skip("a float32 lm_head's kernel changes a row's last bits with the call's rows here")
    params = SamplingParams(max_tokens=40, temperature=0.7, seed=5)
    accepted = 0
    for q in spec_bench("writing", 1) + spec_bench("qa", 1):
        ids = engine.encode(q["turns"][0])
        raced = engine.generate(ids, params, "eagle", 3)
        assert raced.token_ids == engine.generate(ids, params).token_ids
        accepted += raced.num_accepted_tokens
    assert accepted > 0


def test_int4_logprobs_of_a_drafted_request_are_its_plain_requests(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """A summary copying its article: prompt lookup verifies most tokens in chains, and each
    token's logprobs are those plain decoding reads (up to a float32 lm_head's kernel choice,
    where the CPU runs neither a bfloat16 nor a float16 one)."""
    params = SamplingParams(max_tokens=32, logprobs=2)
    plain = int4_engine.generate(int4_prompts[0], params)
    drafted = int4_engine.generate(int4_prompts[0], params, drafter="ngram", draft_len=6)
    assert drafted.num_accepted_tokens > 0 and drafted.token_ids == plain.token_ids
    assert plain.logprobs is not None and drafted.logprobs is not None
    for got, expected in zip(drafted.logprobs, plain.logprobs, strict=True):
        assert [t.token_id for t in got.top] == [t.token_id for t in expected.top]
        assert [got.chosen.logprob, *(t.logprob for t in got.top)] == pytest.approx(
            [expected.chosen.logprob, *(t.logprob for t in expected.top)], abs=2e-4)


def test_every_node_of_an_int4_draft_tree_is_scored_as_a_chain_through_it(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """Each root path in an attention call of its own (workers/models/llama.py _TreeAttention):
    a node's row, alone and in a batch, is the row plain decoding computes after its ancestors;
    bit for bit with a bfloat16 or float16 lm_head, else up to a float32 one's kernel choice."""
    exact = not isinstance(int4_engine.target.model.lm_head, llama.Linear)
    for seed, prompt in enumerate(int4_prompts):
        for rows in tree_rows_and_chains(int4_engine, prompt, seed=seed):
            if exact:
                for scored in (rows.alone, rows.batched, rows.among_trees):
                    assert torch.equal(scored, rows.chains), rows.tree
            for scored in (rows.alone, rows.batched, rows.among_trees):
                torch.testing.assert_close(scored, rows.chains, atol=2e-4, rtol=0)


def test_lookahead_verifies_every_guess_on_the_int4_target(
    int4_engine: SpecEngine, int4_prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lookahead's trees on a row-invariant target: every node's row is read, so the drafter
    verifies its G guesses, and the router prices its steps by that size."""
    seen: list[int] = []

    def spy(logits: torch.Tensor, draft_ids: torch.Tensor, tree: DraftTree) -> VerifyResult:
        seen.append(len(tree))
        return verify_tree_greedy(logits, draft_ids, tree)

    monkeypatch.setattr(engine_module, "verify_tree_greedy", spy)
    int4_engine.generate(int4_prompts[0], SamplingParams(max_tokens=16), drafter="lookahead", draft_len=2)
    config = next(d for d in int4_engine.config.drafters if d.name == "lookahead")
    assert config.guesses > 1 and seen and max(seen) > config.size(2, exact_tree=False)
    assert tree_sizes(int4_engine)["lookahead"][2] == config.size(2)


def test_a_released_pool_slot_reads_only_finite_keys_when_its_next_sequence_runs_alone(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """A batch of one runs `forward` on its pool slot, which reads keys in whole blocks past
    what the slot has written: what an earlier sequence left there (NaN here) must not reach a
    logit once the slot was released."""
    model = int4_engine.target.model
    pool = model.new_pool(1, 1024)
    pool.k.fill_(float("nan"))
    pool.v.fill_(float("nan"))
    pool.release(pool.allocate())
    prompt = torch.tensor(int4_prompts[0])
    slot, alone = pool.allocate(), model.new_cache(1024)
    for cache in (slot, alone):
        model.forward(prompt[:-1], cache, last_only=True)
    torch.testing.assert_close(model.forward(prompt[-1:], slot).logits, model.forward(prompt[-1:], alone).logits,
                               atol=0, rtol=0)


def test_the_bandwidth_floor_counts_the_int4_bytes_a_step_reads(int4_engine: SpecEngine) -> None:
    """Layer products as packed 4-bit values with bfloat16 group scales (~0.63 bytes a weight),
    the lm_head as it streams (float32, or bfloat16 where the CPU computes it fast)."""
    model = int4_engine.target.model
    head = model.lm_head.nbytes  # float32, or bfloat16 where the CPU computes it fast
    layers = sum(lin.packed.numel() * lin.packed.element_size() + lin.scales_zeros.numel() * 2
                 for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
    assert 60e6 < layers < 75e6
    assert weight_bytes(model) == pytest.approx(head + layers, rel=0.01)  # norms are the rest


def test_a_key_span_cuts_the_last_key_block_to_its_granule_up_to_its_limit() -> None:
    span = KeySpan(granule=16, limit=256)
    assert [span.keys(n) for n in (1, 16, 17, 250, 256, 257, 512, 513, 700, 769, 1024)] == [
        16, 16, 32, 256, 256, 512, 512, 528, 704, 1024, 1024]
    assert [KeySpan().keys(n) for n in (1, 512, 513)] == [512, 512, 1024]  # whole blocks


def test_the_probed_key_span_computes_every_row_as_whole_key_blocks_do() -> None:
    """On other data than the probe's and SmolLM2's grouped attention shape (3 key/value heads,
    9 query rows: 3 tokens): rows whose calls read their keys cut as the span says, read whole
    blocks, or read a longer sequence's keys in a batch, bit for bit the same, at every length."""
    cpu = torch.device("cpu")
    span = invariant_key_span(3, 64, torch.float32, cpu)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(1, 3, 9, 64, generator=gen)
    k, v = (torch.randn(1, 3, 1536, 64, generator=gen) for _ in range(2))

    def rows(end: int, keys: int) -> torch.Tensor:
        visible = (torch.arange(9) // 3 + end - 2).clamp(min=1)  # a 3-token causal step ending at `end`
        mask = _additive(torch.arange(keys) < visible[:, None], torch.float32)
        return torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :keys], v[:, :, :keys], attn_mask=mask)

    for end in range(1, 1100, 3):
        keys = span.keys(end)
        assert end <= keys <= _whole_blocks(end)
        cut = rows(end, keys)
        assert torch.equal(cut, rows(end, _whole_blocks(end))), end
        assert torch.equal(cut, rows(end, 1536)), end


def test_int4_hidden_states_are_the_same_with_keys_cut_or_in_whole_blocks(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """The target reads its keys cut as its probed span says (a short prompt's step reads its
    own length rounded to the granule): every hidden state, alone and in a batch beside a long
    summary, bit for bit as over whole key blocks."""
    model = int4_engine.target.model
    probed = model.key_span

    def hidden(span: KeySpan) -> list[torch.Tensor]:
        model.key_span = span
        try:
            out = []
            for prompt in int4_prompts:
                cache = model.new_cache(1024)
                out.append(model.forward(torch.tensor(prompt), cache, return_hidden=True).hidden)
            pool = model.new_pool(len(int4_prompts), 1024)
            caches = [pool.allocate() for _ in int4_prompts]
            heads = [SeqInput(torch.tensor(p[:-3]), c, "none") for p, c in zip(int4_prompts, caches)]
            model.forward_batch(heads)
            tails = [SeqInput(torch.tensor(p[-3:]), c, "all") for p, c in zip(int4_prompts, caches)]
            return out + [o.hidden for o in model.forward_batch(tails, return_hidden=True)]
        finally:
            model.key_span = probed

    lengths = sorted(len(p) for p in int4_prompts)
    assert probed.keys(lengths[0]) < _whole_blocks(lengths[0]) or probed == KeySpan()  # a cut is read where one holds
    assert lengths[-1] > 256  # the batch holds a long sequence beside the short ones
    for cut, whole in zip(hidden(probed), hidden(KeySpan()), strict=True):
        assert torch.equal(cut, whole)


def test_rows_scored_without_logits_fill_the_cache_as_scored_rows(
    int4_engine: SpecEngine, int4_prompts: list[list[int]],
) -> None:
    """A resumed request's output runs as scored rows that return no logits: the keys and values
    it leaves are those of the same rows run for their logits, beside a decode step."""
    model = int4_engine.target.model
    assert not model.prompt_rows_as_scored  # int4: prompt rows take the dense copy
    first, second = int4_prompts[:2]

    def keys(logits: Literal["all", "none"], scored: bool | None = None) -> tuple[torch.Tensor, list[int]]:
        """The second prompt's keys after its last 8 tokens ran so, beside the first's decode step,
        and the rows of logits each returned."""
        pool = model.new_pool(2, 1024)
        caches = [pool.allocate() for _ in range(2)]
        model.forward_batch([SeqInput(torch.tensor(p[:-8]), c, "none") for p, c in zip((first, second), caches)])
        outs = model.forward_batch([SeqInput(torch.tensor(first[-8:-7]), caches[0], "all"),
                                    SeqInput(torch.tensor(second[-8:]), caches[1], logits, scored=scored)])
        return pool.k[:, caches[1].slot, :, : len(second)].clone(), [o.logits.shape[0] for o in outs]

    read, read_rows = keys("all")
    unread, unread_rows = keys("none", scored=True)
    prompt_rows, _ = keys("none")
    assert read_rows == [1, 8] and unread_rows == [1, 0]
    assert torch.equal(unread, read) and not torch.equal(prompt_rows, read)


def _hidden_alone(model: FastLlama, head: list[int], tail: list[int]) -> torch.Tensor:
    """The tail's hidden states after the head, one sequence in its own cache."""
    cache = model.new_cache(1024)
    model.forward(torch.tensor(head), cache, last_only=True)
    return model.forward(torch.tensor(tail), cache, return_hidden=True).hidden


@pytest.mark.parametrize("min_queries", [4, 6])
def test_a_batch_of_decode_and_verify_steps_computes_each_row_as_alone(
    int4_engine: SpecEngine, int4_prompts: list[list[int]], min_queries: int,
) -> None:
    """A batched call pads each sequence's grouped query rows (3 a token here) up to a count
    computed like any other (a decode step's 3 to 4 where 4 is the fewest, not to another input's
    6): sequences of 1, 2 and 3 inputs side by side, every hidden state bit for bit as alone."""
    model = int4_engine.target.model
    probed = model.min_queries
    if min_queries < probed:  # any count from the probed one computes alike, none below it
        pytest.skip(f"this machine's SDPA needs {probed} query rows")
    model.min_queries = min_queries
    try:
        pool = model.new_pool(len(int4_prompts), 1024)
        caches = [pool.allocate() for _ in int4_prompts]
        tails = [p[-1 - i % 3 :] for i, p in enumerate(int4_prompts)]  # 1, 2, 3, 1 inputs
        heads = [p[: len(p) - len(t)] for p, t in zip(int4_prompts, tails)]
        model.forward_batch([SeqInput(torch.tensor(h), c, "none") for h, c in zip(heads, caches)])
        decode = _AttnGroup.of([SeqInput(torch.tensor(tails[0]), caches[0])], model.device, model.dtype,
                               model.group, min_queries)
        assert decode.num_rows == min_queries  # 3 rows padded to 4 (or 6), no more
        batched = model.forward_batch([SeqInput(torch.tensor(t), c) for t, c in zip(tails, caches)],
                                      return_hidden=True)
        for head, tail, out in zip(heads, tails, batched, strict=True):
            assert torch.equal(out.hidden, _hidden_alone(model, head, tail))
    finally:
        model.min_queries = probed


def _seqs(pool: KVPool, lengths: list[int], inputs: list[int]) -> list[SeqInput]:
    seqs = []
    for length, n in zip(lengths, inputs, strict=True):
        cache = pool.allocate()
        cache.extend(length)  # only the lengths matter to the grouping
        seqs.append(SeqInput(torch.zeros(n, dtype=torch.long), cache))
    return seqs


@pytest.mark.parametrize("call_us", [0.0, 1e9], ids=["a-call-per-sequence", "one-call"])
def test_a_batch_in_scattered_slots_computes_each_row_as_alone_in_one_call_or_many(
    int4_engine: SpecEngine, int4_prompts: list[list[int]], call_us: float, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sequences in every other slot of a pool (free slots between them), one verifying 8 drafts
    beside decode steps: priced so that each gets an attention call of its own, or so that all
    share one over the whole slot range (the free slots' rows padding), every hidden state bit
    for bit as alone."""
    monkeypatch.setattr(llama, "_CALL_US", call_us)
    model = int4_engine.target.model
    pool = model.new_pool(2 * len(int4_prompts), 1024)
    caches = [pool.allocate() for _ in range(pool.num_slots)][::2]
    tails = [p[-9:] if i == 1 else p[-1:] for i, p in enumerate(int4_prompts)]
    heads = [p[: len(p) - len(t)] for p, t in zip(int4_prompts, tails)]
    model.forward_batch([SeqInput(torch.tensor(h), c, "none") for h, c in zip(heads, caches)])
    batch = [SeqInput(torch.tensor(t), c) for t, c in zip(tails, caches)]
    calls = _attention_groups(batch, model.group, model.min_queries, model.key_span)
    assert len(calls) == (len(batch) if call_us == 0 else 1)
    for head, tail, out in zip(heads, tails, model.forward_batch(batch, return_hidden=True), strict=True):
        assert torch.equal(out.hidden, _hidden_alone(model, head, tail))


def test_attention_groups_give_a_drafting_sequence_its_own_call_only_where_padding_costs_more(
    int4_engine: SpecEngine,
) -> None:
    """Sixteen decode steps over similar keys share one call; one sequence verifying 8 drafts in
    their middle would pad every other slot's query rows to its 27, so it gets a call of its own
    (its neighbours two); one verifying a single draft (6 rows against 4) stays in the shared call."""
    model = int4_engine.target.model
    span = KeySpan(16, 256)
    lengths = [400 + 7 * i for i in range(16)]
    decode = _seqs(model.new_pool(16, 1024), lengths, [1] * 16)
    assert _attention_groups(decode, 3, 4, span) == [list(range(16))]
    long_draft = _seqs(model.new_pool(16, 1024), lengths, [1] * 7 + [9] + [1] * 8)
    assert _attention_groups(long_draft, 3, 4, span) == [list(range(7)), [7], list(range(8, 16))]
    one_draft = _seqs(model.new_pool(16, 1024), lengths, [1] * 7 + [2] + [1] * 8)
    assert _attention_groups(one_draft, 3, 4, span) == [list(range(16))]
