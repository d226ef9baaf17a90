"""`train-drafter --kind model` end to end on the tiny target: a Hugging Face directory that shares
the target's embeddings, the held-out KL falls, the engine drafts with it losslessly over its draft
vocabulary (greedy and sampled), transformers runs it as assistant_model, an exact resume, and
a directory that does not fit the target is refused with both sizes named."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import TwoTokenCase
from safetensors.torch import load_file, save_file

from training.args import TrainError
from training.model import WEIGHTS_FILE, ModelTrainArgs, train_model
from workers.config import EngineConfig, ModelConfig, ModelDrafterConfig, TargetConfig
from workers.sampling import SamplingParams
from workers.target import DRAFT_VOCAB_FILE, SHARED_EMBEDDINGS_KEY, ModelLoadError, load_hf


def args_for(target: Path, out: Path, **kw) -> ModelTrainArgs:
    base = ModelTrainArgs(target=str(target), data="pydoc", out=str(out), max_tokens=4000, chunk_len=256,
                          seq_len=128, batch=4, lr=1e-2, save_every=4, draft_vocab=2048, num_layers=1, steps=8)
    return replace(base, **kw)


@pytest.fixture(scope="module")
def trained(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model") / "drafter"
    train_model(args_for(tiny_llama_dir, out), log=lambda _: None)
    return out


def engine_with(target: Path, drafter: Path):  # -> SpecEngine
    from workers.engine import SpecEngine

    return SpecEngine.from_config(EngineConfig(
        target=TargetConfig(model=str(target), max_model_len=512),
        drafters=[ModelDrafterConfig(name="distilled", model=ModelConfig(model=str(drafter)), draft_len=3)],
    ))


def test_output_is_a_hf_directory_without_the_shared_embeddings(trained: Path, tiny_llama_dir: Path) -> None:
    config = json.loads((trained / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1 and config[SHARED_EMBEDDINGS_KEY]
    weights = load_file(str(trained / WEIGHTS_FILE))
    assert "model.embed_tokens.weight" not in weights and "lm_head.weight" not in weights
    assert "model.layers.0.self_attn.q_proj.weight" in weights and "model.norm.weight" in weights
    # the student started from the target's last layer (the default for one layer), then moved
    target_w = load_file(str(tiny_llama_dir / "model.safetensors"))
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == target_w["model.layers.1.mlp.down_proj.weight"].shape
    vocab = load_file(str(trained / DRAFT_VOCAB_FILE))["draft_vocab"]
    assert vocab.shape == (2048,) and len(set(vocab.tolist())) == 2048
    before, after = config["specroute_training"]["eval_initial"], config["specroute_training"]["eval_final"]
    assert before["positions"] == after["positions"] > 0 and after["loss"] < before["loss"], (before, after)
    assert "complete" in (trained / "CARD.md").read_text()


def test_engine_drafts_with_it_losslessly(trained: Path, tiny_llama_dir: Path) -> None:
    engine = engine_with(tiny_llama_dir, trained)
    drafter = engine.drafters["distilled"]
    assert drafter.vocab_ids is not None and drafter.model.lm_head.w_t.shape[1] == 2048  # logits over 2048 rows
    assert drafter.model.embed.data_ptr() == engine.target.model.embed.data_ptr()  # shared, not copied
    drafted = 0
    for text in ("Write a Python function that sorts a list.", "Explain the with statement."):
        prompt = engine.encode(text)
        params = SamplingParams(max_tokens=24)
        plain, spec = engine.generate(prompt, params), engine.generate(prompt, params, "distilled", 3)
        assert spec.token_ids == plain.token_ids
        drafted += spec.num_draft_tokens
    assert drafted > 0
    # sampled: the draft probabilities are spread over the whole vocabulary for rejection sampling
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=3)
    prompt = engine.encode("Tell me about lists.")
    gen = engine.start(prompt, sampled)
    while not gen.finished:
        gen.step("distilled", 3)
    assert gen.result().num_draft_tokens > 0


def test_sampled_output_follows_the_target_distribution(trained: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A draft vocabulary holding two of the target's likely first tokens and one it never
    samples: the first two sampled tokens keep the target's exact joint distribution."""
    plain_engine = engine_with(tiny_llama_dir, trained)
    case = TwoTokenCase.of(plain_engine)
    drafter = tmp_path / "three-tokens"
    shutil.copytree(trained, drafter)
    vocab = case.draft_vocab(plain_engine.target.model.info.vocab_size)
    save_file({"draft_vocab": torch.tensor(vocab)}, str(drafter / DRAFT_VOCAB_FILE))
    engine = engine_with(tiny_llama_dir, drafter)
    results = case.check(engine, "distilled", 1, 600)
    assert sum(r.num_draft_tokens for r in results) > 0


def test_transformers_runs_it_as_the_assistant_model(trained: Path, tiny_llama_dir: Path) -> None:
    target, tokenizer, _ = load_hf(ModelConfig(model=str(tiny_llama_dir)))
    with pytest.raises(ModelLoadError, match="shares its target's embeddings"):
        load_hf(ModelConfig(model=str(trained)))
    assistant, _, _ = load_hf(ModelConfig(model=str(trained)), target.get_input_embeddings().weight.detach())
    assert assistant.get_output_embeddings().weight is assistant.get_input_embeddings().weight
    ids = tokenizer("def sort(xs):", return_tensors="pt").input_ids
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tokenizer.eos_token_id}
    plain = target.generate(ids, **kw)
    assisted = target.generate(ids, assistant_model=assistant, **kw)
    assert torch.equal(plain, assisted)


def test_a_directory_for_another_target_is_refused_with_both_sizes(trained: Path, tiny_llama_dir: Path,
                                                                    tmp_path: Path) -> None:
    other = tmp_path / "wide"
    shutil.copytree(trained, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] = 2 * config["hidden_size"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"hidden size 128 do not match the target's embeddings, .*hidden size 64"):
        engine_with(tiny_llama_dir, other)
    config["hidden_size"] //= 2
    (other / "config.json").write_text(json.dumps(config))
    save_file({"draft_vocab": torch.tensor([5, config["vocab_size"]])}, str(other / DRAFT_VOCAB_FILE))
    with pytest.raises(ModelLoadError, match=f"token ids must be in 0..{config['vocab_size'] - 1}"):
        engine_with(tiny_llama_dir, other)
    (other / WEIGHTS_FILE).unlink()
    with pytest.raises(ModelLoadError, match=f"no weights at {other / WEIGHTS_FILE}"):
        engine_with(tiny_llama_dir, other)


def test_resume_repeats_the_uninterrupted_run(trained: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    train_model(args_for(tiny_llama_dir, out, stop_at=4), log=lambda _: None)
    with pytest.raises(TrainError, match="--lr 0.5"):
        train_model(args_for(tiny_llama_dir, out, resume=True, lr=0.5), log=lambda _: None)
    train_model(args_for(tiny_llama_dir, out, resume=True), log=lambda _: None)
    got, want = load_file(str(out / WEIGHTS_FILE)), load_file(str(trained / WEIGHTS_FILE))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)


def test_init_layers_are_checked_against_the_target(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(TrainError, match=r"--init-layers: \[5\] not in 0..1"):
        train_model(args_for(tiny_llama_dir, tmp_path / "o", num_layers=2, init_layers="0,5"), log=lambda _: None)


def test_a_drafter_replica_reads_the_target_embeddings_from_its_files(trained: Path, tiny_llama_dir: Path) -> None:
    """A drafter deployment loads the target's embedding matrix alone (not the target) and drafts
    exactly what the colocated drafter does."""
    from workers.deployment import DrafterWorker
    from workers.drafters.remote import DraftCall

    engine = engine_with(tiny_llama_dir, trained)
    config = engine.drafters["distilled"].config
    worker = DrafterWorker.func_or_class(config.model_dump(mode="json"), engine.config.target.model_dump(mode="json"))
    prompt = engine.encode("Write a Python function that sorts a list.")
    gen = engine.start(prompt, SamplingParams(max_tokens=8))
    local = engine.drafters["distilled"]
    want = local.propose(local.begin(gen.ctx), gen.ctx, 3).token_ids.tolist()
    reply = worker.draft(DraftCall("s", list(prompt), 3, SamplingParams(max_tokens=8), gen.ctx.max_len,
                                   engine.target.model.info.vocab_size, 0))
    assert reply.token_ids == want and len(want) == 3
    gen.close()
