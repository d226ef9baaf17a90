"""Medusa heads on the tiny target: lossless under greedy and sampled decoding, Medusa's own
checkpoint layout (a vocabulary head per head) and SpecRoute's shared reduced head both load,
and heads that do not fit the target are refused naming both sizes or the missing file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TwoTokenCase, chains_where_steps_verify_chains, write_medusa_heads
from safetensors.torch import save_file

from workers.config import EngineConfig, MedusaDrafterConfig, TreeConfig
from workers.drafters.medusa import MedusaConfig, MedusaHeads
from workers.engine import SpecEngine
from workers.sampling import SamplingParams
from workers.target import ModelLoadError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Write a haiku about spring rain.", "x = 1\ny = 2\n"]


def engine_with(tiny_engine: SpecEngine, **paths: Path) -> SpecEngine:
    drafters = [MedusaDrafterConfig(name=name, path=str(path)) for name, path in paths.items()]
    return SpecEngine.from_config(EngineConfig(target=tiny_engine.config.target, drafters=drafters))


@pytest.fixture(scope="module")
def medusa_engine(tiny_engine: SpecEngine, tmp_path_factory: pytest.TempPathFactory) -> SpecEngine:
    return engine_with(
        tiny_engine,
        medusa=write_medusa_heads(tmp_path_factory.mktemp("medusa"), tiny_engine),
        medusa_small=write_medusa_heads(tmp_path_factory.mktemp("medusa-small"), tiny_engine, list(range(0, 4000, 3))),
    )


@pytest.mark.parametrize("drafter", ["medusa", "medusa_small"])
@pytest.mark.parametrize("k", [1, 3, 5])  # 5 > the 3 heads: proposals stop at the heads
def test_greedy_identical_to_plain(medusa_engine: SpecEngine, drafter: str, k: int) -> None:
    for text in TEXTS:
        ids = medusa_engine.encode(text)
        plain = medusa_engine.generate(ids, SamplingParams(max_tokens=24))
        out = medusa_engine.generate(ids, SamplingParams(max_tokens=24), drafter, k)
        assert out.token_ids == plain.token_ids and out.text == plain.text
        assert out.num_draft_tokens > 0 and max(s.num_draft_tokens for s in out.steps) == min(k, 3)


@pytest.mark.parametrize("k", [1, 3])
def test_tree_greedy_identical_to_plain(medusa_engine: SpecEngine, tmp_path: Path, k: int) -> None:
    """Medusa's candidate tree: head d's top candidates at depth d + 1, under every kept parent."""
    path = write_medusa_heads(tmp_path / "medusa", medusa_engine)
    engine = SpecEngine.from_config(EngineConfig(target=medusa_engine.config.target, drafters=[
        MedusaDrafterConfig(name="medusa", path=str(path), tree=TreeConfig(topk=3, nodes=9))]))
    for text in TEXTS:
        ids = engine.encode(text)
        plain = engine.generate(ids, SamplingParams(max_tokens=24))
        out = engine.generate(ids, SamplingParams(max_tokens=24), "medusa", k)
        assert out.token_ids == plain.token_ids and out.text == plain.text
        assert max(s.num_draft_tokens for s in out.steps) == k and max(s.num_tree_nodes for s in out.steps) > k
    chains_where_steps_verify_chains(engine, "medusa", k, TEXTS[0])


def test_heads_predict_the_targets_next_tokens_when_trained_so(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    """Head 0 with zero blocks is the identity: through the target's lm_head it proposes the
    target's own next token at the feature's position, which plain decoding has already emitted
    (the newest token), so the draft is the newest token again: acceptance then follows the
    text. A check of alignment: head i at position p proposes token p + 2 + i."""
    m = tiny_engine.target.model
    heads = MedusaHeads(MedusaConfig(1, 1, m.info.hidden_size, m.info.vocab_size))  # zero init
    heads.save(tmp_path)
    engine = engine_with(tiny_engine, medusa=tmp_path)
    ids = engine.encode(TEXTS[0])
    gen = engine.start(ids, SamplingParams(max_tokens=8))
    gen.step("none", 0)
    newest = gen.ctx.token_ids[-1]
    draft = engine.drafters["medusa"].propose(None, gen.ctx, 1)
    assert draft.token_ids.tolist() == [newest]  # identity head: the target's prediction at p = newest
    gen.close()


def test_sampled_output_follows_target_distribution(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    """Draft probabilities of a head over a reduced vocabulary (zero outside it) keep the
    target's exact joint distribution of the first two sampled tokens (the first step drafts
    from the prompt's second-to-last feature; both tokens are checked)."""
    case = TwoTokenCase.of(tiny_engine)
    vocab = case.draft_vocab(tiny_engine.target.model.info.vocab_size)
    engine = engine_with(tiny_engine, medusa=write_medusa_heads(tmp_path / "m", tiny_engine, vocab))
    results = case.check(engine, "medusa", 1, 600)
    assert sum(r.num_draft_tokens for r in results) > 0


def test_medusa_layout_with_a_vocabulary_head_per_head(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    """Medusa's own file: {i}.0.linear.weight|bias and {i}.1.weight (full vocabulary) per head."""
    m = tiny_engine.target.model
    h = m.info.hidden_size
    g = torch.Generator().manual_seed(5)
    weights = {}
    for i in range(2):
        weights[f"{i}.0.linear.weight"] = torch.randn(h, h, generator=g) * 0.02
        weights[f"{i}.0.linear.bias"] = torch.zeros(h)
        weights[f"{i}.1.weight"] = m.lm_head.w_t.t().contiguous()
    save_file(weights, str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "medusa_num_heads": 2, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"}))
    engine = engine_with(tiny_engine, medusa=tmp_path)
    ids = engine.encode(TEXTS[1])
    out = engine.generate(ids, SamplingParams(max_tokens=16), "medusa", 2)
    assert out.token_ids == engine.generate(ids, SamplingParams(max_tokens=16)).token_ids
    assert out.num_draft_tokens > 0


def test_mismatched_or_missing_heads_are_refused(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    m = tiny_engine.target.model
    h, v = m.info.hidden_size, m.info.vocab_size
    save_file({"0.0.linear.weight": torch.zeros(h // 2, h // 2), "0.0.linear.bias": torch.zeros(h // 2)},
              str(tmp_path / "medusa_lm_head.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 1, "medusa_num_layers": 1}))
    with pytest.raises(ModelLoadError) as e:
        engine_with(tiny_engine, medusa=tmp_path)
    assert f"hidden size {h // 2}" in str(e.value) and f"hidden size {h}" in str(e.value)

    save_file({"0.0.linear.weight": torch.zeros(h, h), "0.0.linear.bias": torch.zeros(h),
               "0.1.weight": torch.zeros(1000, h)}, str(tmp_path / "medusa_lm_head.safetensors"))
    with pytest.raises(ModelLoadError) as e:
        engine_with(tiny_engine, medusa=tmp_path)
    assert "vocabulary size 1000" in str(e.value) and f"vocabulary size {v}" in str(e.value)

    (tmp_path / "medusa_lm_head.safetensors").unlink()
    (tmp_path / "medusa_lm_head.pt").write_bytes(b"a pickle")
    with pytest.raises(ModelLoadError, match="pickle") as e:
        engine_with(tiny_engine, medusa=tmp_path)
    assert str(tmp_path / "medusa_lm_head.safetensors") in str(e.value)
