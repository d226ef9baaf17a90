"""The EAGLE feature drafter on the tiny target: lossless under greedy and sampled decoding
(with a full and a reduced draft vocabulary), checkpoints in the official EAGLE layout load, and
checkpoints that do not fit the target are refused naming both sizes or the missing file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TwoTokenCase, chains_where_steps_verify_chains, write_eagle
from safetensors.torch import save_file

from workers.config import EagleDrafterConfig, EngineConfig, NgramDrafterConfig, TreeConfig
from workers.engine import SpecEngine
from workers.sampling import SamplingParams
from workers.target import ModelLoadError

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Write a haiku about spring rain.", "x = 1\ny = 2\n"]


def engine_with(tiny_engine: SpecEngine, path: Path, name: str = "eagle", tree: TreeConfig | None = None) -> SpecEngine:
    config = EngineConfig(target=tiny_engine.config.target,
                          drafters=[NgramDrafterConfig(), EagleDrafterConfig(name=name, path=str(path), tree=tree)])
    return SpecEngine.from_config(config)


@pytest.fixture(scope="module")
def eagle_engine(tiny_engine: SpecEngine, tmp_path_factory: pytest.TempPathFactory) -> SpecEngine:
    full = write_eagle(tmp_path_factory.mktemp("eagle-full"), tiny_engine)
    reduced = write_eagle(tmp_path_factory.mktemp("eagle-reduced"), tiny_engine, list(range(0, 4000, 3)))
    config = EngineConfig(target=tiny_engine.config.target, drafters=[
        EagleDrafterConfig(name="eagle", path=str(full)), EagleDrafterConfig(name="eagle_small", path=str(reduced)),
        EagleDrafterConfig(name="eagle_tree", path=str(full), tree=TreeConfig(topk=3, nodes=10)),
        EagleDrafterConfig(name="eagle_small_tree", path=str(reduced), tree=TreeConfig(topk=2, nodes=6)),
        EagleDrafterConfig(name="eagle_chain_tree", path=str(full), tree=TreeConfig(topk=1, nodes=16))])
    return SpecEngine.from_config(config)


@pytest.mark.parametrize("drafter", ["eagle", "eagle_small", "eagle_tree", "eagle_small_tree"])
@pytest.mark.parametrize("k", [1, 3, 6])
def test_greedy_identical_to_plain(eagle_engine: SpecEngine, drafter: str, k: int) -> None:
    for text in TEXTS:
        ids = eagle_engine.encode(text)
        plain = eagle_engine.generate(ids, SamplingParams(max_tokens=24))
        out = eagle_engine.generate(ids, SamplingParams(max_tokens=24), drafter, k)
        assert out.token_ids == plain.token_ids and out.text == plain.text
        assert out.num_draft_tokens > 0 and out.drafters == [drafter]


def test_tree_of_one_candidate_per_position_is_the_chain(eagle_engine: SpecEngine) -> None:
    """Growing the tree level by level through the drafting cache computes what the chain does."""
    ids = eagle_engine.encode(TEXTS[0])
    chain = eagle_engine.generate(ids, SamplingParams(max_tokens=24), "eagle", 4)
    tree = eagle_engine.generate(ids, SamplingParams(max_tokens=24), "eagle_chain_tree", 4)
    assert [s.num_accepted for s in tree.steps] == [s.num_accepted for s in chain.steps]
    assert all(s.num_tree_nodes == s.num_draft_tokens for s in tree.steps)


def test_tree_drafter_drafts_chains_where_the_step_verifies_a_chain(eagle_engine: SpecEngine) -> None:
    chains_where_steps_verify_chains(eagle_engine, "eagle_tree", 3, TEXTS[0])


def test_tree_accepts_more_per_step_than_the_chain(eagle_engine: SpecEngine) -> None:
    for text in TEXTS:
        ids = eagle_engine.encode(text)
        chain = eagle_engine.generate(ids, SamplingParams(max_tokens=24), "eagle", 3)
        tree = eagle_engine.generate(ids, SamplingParams(max_tokens=24), "eagle_tree", 3)
        assert tree.num_steps <= chain.num_steps
        assert max(s.num_tree_nodes for s in tree.steps) > 3


def test_switching_to_eagle_mid_request_uses_every_feature(eagle_engine: SpecEngine) -> None:
    """Features are kept for the whole request, so a feature drafter first asked late still sees
    the prompt's and every earlier step's (the result stays plain decoding's)."""
    ids = eagle_engine.encode(TEXTS[1])
    plain = eagle_engine.generate(ids, SamplingParams(max_tokens=30))
    gen = eagle_engine.start(ids, SamplingParams(max_tokens=30))
    for i in range(30):
        if gen.finished:
            break
        gen.step(*(("eagle", 3) if i >= 5 else ("none", 0)))
    assert gen.output_ids == plain.token_ids
    gen.close()


@pytest.mark.parametrize("tree", [None, TreeConfig(topk=2, nodes=4)], ids=["chain", "tree"])
def test_sampled_output_follows_target_distribution(tiny_engine: SpecEngine, tmp_path: Path,
                                                    tree: TreeConfig | None) -> None:
    """Rejection sampling with the drafter's distribution over a reduced vocabulary (zero outside
    it), or a tree's candidates there verified by multi-candidate rejection sampling, keeps the
    target's exact joint distribution of the first two sampled tokens."""
    case = TwoTokenCase.of(tiny_engine)
    path = write_eagle(tmp_path / "eagle", tiny_engine, case.draft_vocab(tiny_engine.target.model.info.vocab_size))
    engine = engine_with(tiny_engine, path, tree=tree)
    num_trials = 800
    results = case.check(engine, "eagle", 1, num_trials)
    assert 0 < sum(r.num_accepted_tokens for r in results) < num_trials


def test_official_eagle_layout_loads(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    """A checkpoint as EAGLE's own training writes it: Llama config fields, fp16 weights under the
    official names, the target's embeddings included (ignored: the target's own are used)."""
    m = tiny_engine.target.model
    h, nh, nkv, d, inter = m.info.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim, 2 * m.info.hidden_size
    g = torch.Generator().manual_seed(3)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).half()

    weights = {
        "fc.weight": w(h, 2 * h), "fc.bias": w(h),
        "layers.0.self_attn.q_proj.weight": w(nh * d, h), "layers.0.self_attn.k_proj.weight": w(nkv * d, h),
        "layers.0.self_attn.v_proj.weight": w(nkv * d, h), "layers.0.self_attn.o_proj.weight": w(h, nh * d),
        "layers.0.mlp.gate_proj.weight": w(inter, h), "layers.0.mlp.up_proj.weight": w(inter, h),
        "layers.0.mlp.down_proj.weight": w(h, inter), "layers.0.post_attention_layernorm.weight": torch.ones(h).half(),
        "embed_tokens.weight": w(m.info.vocab_size, h),
    }
    save_file(weights, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h, "num_attention_heads": nh,
        "num_key_value_heads": nkv, "intermediate_size": inter, "vocab_size": m.info.vocab_size,
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048,
        "bias": True, "torch_dtype": "float16",
    }))
    engine = engine_with(tiny_engine, tmp_path)
    ids = engine.encode(TEXTS[0])
    assert engine.generate(ids, SamplingParams(max_tokens=16), "eagle", 4).token_ids == \
        engine.generate(ids, SamplingParams(max_tokens=16)).token_ids


@pytest.mark.parametrize("change, needles", [
    ({"hidden_size": 32}, ["hidden size 32", "hidden size 64"]),
    ({"vocab_size": 1000}, ["vocabulary size 1000", "vocabulary size"]),
])
def test_mismatched_checkpoint_is_refused_naming_both_sizes(
    tiny_engine: SpecEngine, tmp_path: Path, change: dict, needles: list[str],
) -> None:
    path = write_eagle(tmp_path / "eagle", tiny_engine)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ModelLoadError) as e:
        engine_with(tiny_engine, path)
    for needle in needles:
        assert needle in str(e.value)
    if "vocab_size" in change:
        assert str(tiny_engine.target.model.info.vocab_size) in str(e.value)


def test_missing_or_pickled_weights_are_refused(tiny_engine: SpecEngine, tmp_path: Path) -> None:
    path = write_eagle(tmp_path / "eagle", tiny_engine)
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=str(path / "model.safetensors")):
        engine_with(tiny_engine, path)
    (path / "pytorch_model.bin").write_bytes(b"not loaded: a pickle can run code")
    with pytest.raises(ModelLoadError, match="pickle"):
        engine_with(tiny_engine, path)
    with pytest.raises(ModelLoadError, match="config"):
        engine_with(tiny_engine, tmp_path / "nowhere")
