"""`train-drafter --kind medusa` end to end on the tiny target: Medusa's layout out, the held-out
loss falls, the engine drafts with the heads losslessly, an exact resume, features reused from
another run."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from training.args import TrainError
from training.medusa import MedusaTrainArgs, gather_heads, train_medusa
from training.state import FEATURES_FILE, STATE_DIR
from workers.config import EngineConfig, MedusaDrafterConfig, TargetConfig
from workers.drafters.medusa import WEIGHT_FILE, MedusaHeads
from workers.sampling import SamplingParams


def args_for(target: Path, out: Path, **kw) -> MedusaTrainArgs:
    base = MedusaTrainArgs(target=str(target), data="pydoc", out=str(out), max_tokens=4000, chunk_len=256,
                           seq_len=64, batch=4, lr=1e-2, save_every=4, draft_vocab=2048, num_heads=2, steps=8)
    return replace(base, **kw)


@pytest.fixture(scope="module")
def trained(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("medusa") / "heads"
    train_medusa(args_for(tiny_llama_dir, out), log=lambda _: None)
    return out


def test_output_is_a_medusa_checkpoint_and_the_loss_falls(trained: Path, tiny_llama_dir: Path) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    heads = MedusaHeads.load(trained, config["hidden_size"], config["vocab_size"])
    assert heads.cfg.num_heads == 2 and heads.lm_head is not None and heads.lm_head.weight.shape[0] == 2048
    weights = load_file(str(trained / WEIGHT_FILE))
    assert {"0.0.linear.weight", "1.0.linear.weight", "lm_head.weight"} <= set(weights)  # Medusa's key names
    rec = json.loads((trained / "config.json").read_text())["specroute_training"]
    before, after = rec["eval_initial"], rec["eval_final"]
    assert before["positions"] == after["positions"] > 0
    for i in range(2):
        assert after[f"ce_{i}"] < before[f"ce_{i}"], (before, after)
    card = (trained / "CARD.md").read_text()
    assert "complete" in card and "head 1" in card and "| coding |" in card


def test_engine_drafts_with_the_heads_and_stays_lossless(trained: Path, tiny_llama_dir: Path) -> None:
    from workers.engine import SpecEngine

    config = EngineConfig(target=TargetConfig(model=str(tiny_llama_dir), max_model_len=512),
                          drafters=[MedusaDrafterConfig(path=str(trained), draft_len=2)])
    engine = SpecEngine.from_config(config)
    drafted = 0
    for text in ("Write a Python function that sorts a list.", "Explain the with statement."):
        prompt = engine.encode(text)
        params = SamplingParams(max_tokens=24)
        plain, spec = engine.generate(prompt, params), engine.generate(prompt, params, "medusa", 2)
        assert spec.token_ids == plain.token_ids
        drafted += spec.num_draft_tokens
    assert drafted > 0


def test_resume_repeats_the_uninterrupted_run(trained: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "resumed"
    train_medusa(args_for(tiny_llama_dir, out, stop_at=4), log=lambda _: None)
    with pytest.raises(TrainError, match="--resume"):
        train_medusa(args_for(tiny_llama_dir, out), log=lambda _: None)
    with pytest.raises(TrainError, match="--decay 0.5"):
        train_medusa(args_for(tiny_llama_dir, out, resume=True, decay=0.5), log=lambda _: None)
    train_medusa(args_for(tiny_llama_dir, out, resume=True), log=lambda _: None)
    got, want = load_file(str(out / WEIGHT_FILE)), load_file(str(trained / WEIGHT_FILE))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)


def test_features_of_another_run_are_reused(trained: Path, tiny_llama_dir: Path, tmp_path: Path) -> None:
    features = trained / STATE_DIR / FEATURES_FILE
    out = tmp_path / "reused"
    rec = train_medusa(args_for(tiny_llama_dir, out, features=str(features), steps=2), log=lambda _: None)
    assert rec["corpus"]["features"] == str(features) and rec["corpus"]["tokens"] == 4000
    assert not (out / STATE_DIR / FEATURES_FILE).exists()  # not copied: the other run's file is the source
    with pytest.raises(TrainError, match="no file"):
        train_medusa(args_for(tiny_llama_dir, tmp_path / "x", features=str(tmp_path / "none.safetensors")),
                     log=lambda _: None)


def test_each_head_has_labels_only_inside_its_chunk() -> None:
    from training.features import FeatureSet

    fs = FeatureSet(torch.arange(10), torch.arange(10, dtype=torch.float16)[:, None].repeat(1, 4),
                    torch.tensor([0, 6, 10]))
    batch = gather_heads(fs, [(0, 5), (6, 3)], 2, torch.device("cpu"))
    assert batch.inputs[0, :, 0].tolist() == [0, 1, 2, 3, 4]
    assert batch.targets[1, 0, :, 0].tolist()[:4] == [2, 3, 4, 5]  # head 1 from f_t reads f_{t+2}
    assert batch.masks[0].tolist() == [[True] * 5, [True] * 3 + [False] * 2]
    assert batch.masks[1].tolist() == [[True] * 4 + [False], [True] * 2 + [False] * 3]


def test_the_cli_trains_medusa_heads(tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    out = tmp_path / "cli"
    argv = ["train-drafter", "--kind", "medusa", "--target", str(tiny_llama_dir), "--data", "pydoc", "--max-tokens",
            "2000", "--chunk-len", "128", "--seq-len", "32", "--steps", "2", "--num-heads", "2", "--draft-vocab", "512",
            "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("ok: medusa drafter at step 2/2, head 0 top-1") and "CARD.md" in printed
    rec = json.loads((out / "config.json").read_text())["specroute_training"]
    assert rec["sessions"][0].startswith("specroute train-drafter --kind medusa --target")
    assert (out / WEIGHT_FILE).is_file() and rec["draft_vocab"]["size"] == 512
