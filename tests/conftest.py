"""Shared fixtures: the real default target (converted once) and tiny random Llamas that use its
tokenizer, so algorithm tests run in milliseconds while integration tests use the real model."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from workers.config import EngineConfig, ModelConfig, NgramDrafterConfig, TargetConfig

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(autouse=True, scope="session")
def _threads() -> None:
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    """The default target as a safetensors directory (the GGUF is converted on first use)."""
    from workers.target import resolve_source

    source = resolve_source(ModelConfig())
    assert isinstance(source, Path)
    return source


def write_tiny_llama(out: Path, tokenizer_dir: Path, *, seed: int, num_layers: int = 2, hidden: int = 64,
                     init_std: float = 0.5, max_position: int = 2048) -> Path:
    """A random Llama with the real tokenizer's vocabulary. A large init_std makes its logits
    decisive, so greedy decoding has no near-ties that kernel rounding could flip."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_position, tie_word_embeddings=True, initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-target"), target_dir, seed=0)


@pytest.fixture(scope="session")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    """The tiny target with the shipped target's 8,192 positions, for long contexts."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-long"), target_dir, seed=0, max_position=8192)


@pytest.fixture(scope="session")
def tiny_drafter_dir(tmp_path_factory: pytest.TempPathFactory, target_dir: Path) -> Path:
    """A different random model: low but non-zero agreement with the tiny target."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-drafter"), target_dir, seed=1, num_layers=1)


@pytest.fixture(scope="session")
def tiny_config(tiny_llama_dir: Path, tiny_drafter_dir: Path) -> EngineConfig:
    """Tiny target with an n-gram drafter, a model drafter equal to the target (accepts all)
    and a model drafter that disagrees often."""
    return EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 1024},
        "drafters": [
            NgramDrafterConfig().model_dump(),
            {"kind": "model", "name": "self", "model": {"model": str(tiny_llama_dir)}, "draft_len": 4},
            {"kind": "model", "name": "other", "model": {"model": str(tiny_drafter_dir)}, "draft_len": 3},
        ],
    })


@pytest.fixture(scope="session")
def tiny_engine(tiny_config: EngineConfig):  # -> SpecEngine
    from workers.engine import SpecEngine

    return SpecEngine.from_config(tiny_config)


@pytest.fixture(scope="session")
def self_drafting_engine(tiny_llama_dir: Path):  # -> SpecEngine
    """The tiny target with prompt lookup and the target itself as a chain drafter ("self") and as
    a tree of its two likeliest tokens ("self_tree"): the drafters of the tests of what a step does
    to the target's rows (penalties, bans), which draft without it and so are partly rejected."""
    from workers.config import ModelDrafterConfig, TreeConfig
    from workers.engine import SpecEngine

    target = ModelConfig(model=str(tiny_llama_dir))
    return SpecEngine.from_config(EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 512},
        "drafters": [
            NgramDrafterConfig().model_dump(),
            ModelDrafterConfig(name="self", model=target).model_dump(),
            ModelDrafterConfig(name="self_tree", model=target, tree=TreeConfig(topk=2, nodes=6)).model_dump(),
        ],
    }))


@pytest.fixture(scope="session", params=["int4", "bfloat16"])
def row_invariant_engine(request: pytest.FixtureRequest):  # -> SpecEngine
    """The shipped target on weights that score a row bit for bit alike in any batch: int4 (prompt
    rows on a dense bfloat16 copy where the CPU has bfloat16 instructions) or bfloat16 (prompt
    rows as scored rows); with prompt lookup and the shipped EAGLE drafter, which reads the
    target's hidden states at every position."""
    from workers.config import EagleDrafterConfig
    from workers.engine import SpecEngine
    from workers.models.bf16 import bfloat16_fast

    if request.param == "bfloat16" and not bfloat16_fast(torch.device("cpu")):
        pytest.skip("bfloat16 weights need a CPU with bfloat16 instructions")
    return SpecEngine.from_config(EngineConfig(
        target=TargetConfig(weights=request.param, max_model_len=1024),
        drafters=[NgramDrafterConfig(), EagleDrafterConfig(path="models/eagle", draft_len=2)],
    ))


@pytest.fixture(scope="session")
def real_engine():  # -> SpecEngine, the shipped target with the default drafters
    from workers.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(target=TargetConfig()))


@pytest.fixture(scope="session")
def spec_bench() -> Callable[[str, int], list[dict]]:
    """spec_bench(category, n): the first n questions of a Spec-Bench category."""
    questions = [json.loads(line) for line in SPEC_BENCH.read_text().splitlines() if line.strip()]

    def pick(category: str, n: int) -> list[dict]:
        return [q for q in questions if q["category"] == category][:n]

    return pick
