"""bench/agreement.py on the tiny target: positions, domains, the split, and a CLI that refuses
drafters it cannot measure (tests/test_real_target.py checks its figure against decoding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from helpers import chain_accepts, write_eagle, write_medusa_heads

from bench.agreement import main, measure, measure_sampled, position_hits, render_sampled
from bench.prompts import load_prompts
from workers.config import EagleDrafterConfig, EngineConfig, MedusaDrafterConfig
from workers.drafters.base import RACE_POWER
from workers.engine import SpecEngine
from workers.sampling import SamplingParams

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Write a haiku about spring rain.", "x = 1\ny = 2\n"]
SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"


@pytest.fixture(scope="module")
def engine(tiny_engine: SpecEngine, tmp_path_factory: pytest.TempPathFactory) -> SpecEngine:
    """The tiny target with a random EAGLE head (reduced vocabulary), random Medusa heads and the
    model drafters of tiny_config (`self` is the target, `other` a different random model)."""
    eagle = write_eagle(tmp_path_factory.mktemp("eagle"), tiny_engine, list(range(0, 4000, 3)))
    medusa = write_medusa_heads(tmp_path_factory.mktemp("medusa"), tiny_engine)
    drafters = [*tiny_engine.config.drafters, EagleDrafterConfig(name="eagle", path=str(eagle)),
                MedusaDrafterConfig(name="medusa", path=str(medusa))]
    return SpecEngine.from_config(EngineConfig(target=tiny_engine.config.target, drafters=drafters))


def test_a_drafter_equal_to_the_target_agrees_everywhere(engine: SpecEngine) -> None:
    params = SamplingParams(max_tokens=32)
    for text in TEXTS:
        prompt = engine.encode(text)
        plain = engine.generate(prompt, params)
        hits, confident = position_hits(engine, engine.drafters["self"], prompt, plain.token_ids)
        assert hits.shape == (len(plain.token_ids), 3) and confident.shape == (hits.shape[0],)
        assert hits.all()
        chain = engine.generate(prompt, params, "self", 1)
        assert chain_accepts(hits[:, 0].tolist(), plain.finish_reason == "length") == chain.num_accepted_tokens
    for drafter in ("eagle", "medusa", "other"):  # random ones, on the last answer: top-1 within top-4 within top-10
        hits, _ = position_hits(engine, engine.drafters[drafter], prompt, plain.token_ids)
        assert (hits[:, 0] <= hits[:, 1]).all() and (hits[:, 1] <= hits[:, 2]).all()


def test_measure_counts_every_drafted_position_by_domain(engine: SpecEngine) -> None:
    prompts = load_prompts(SPEC_BENCH, 1, ["coding", "writing"], heldout_mod=5)
    table = measure(engine, ["self", "eagle"], prompts, max_tokens=8)
    assert set(table["self"]) == {"code", "chat"}
    for domain, a in table["self"].items():
        assert a.rate(1) == 1.0 and a.positions == table["eagle"][domain].positions
        assert 0 < a.positions <= 8
        assert a.confident_hits == a.confident


def test_train_split_is_the_complement_of_the_held_out_one() -> None:
    held = load_prompts(SPEC_BENCH, 100, ["writing"], heldout_mod=5)
    train = load_prompts(SPEC_BENCH, 100, ["writing"], heldout_mod=5, train_split=True)
    assert len(held) + len(train) == 10 and all(int(p.question_id) % 5 == 0 for p in held)
    assert not {p.question_id for p in held} & {p.question_id for p in train}


def test_cli_refuses_drafters_without_a_model(engine: SpecEngine, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(engine.config.model_dump(mode="json")))
    for names, needle in (("ngram", "ngram has no model to teacher force"), ("nope", "nope not in")):
        with pytest.raises(SystemExit) as exit_:
            main(["--config", str(config), "--drafters", names, "--prompts", str(SPEC_BENCH)])
        assert exit_.value.code == 2 and needle in capsys.readouterr().err
    assert main(["--config", str(config), "--drafters", "other", "--prompts", str(SPEC_BENCH), "--per-category", "1",
                 "--max-tokens", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("| drafter | domain |") and "| other | chat |" in printed


def test_sampled_agreement_of_the_target_with_itself_is_certain(engine: SpecEngine) -> None:
    """A drafter equal to the target, on sampled answers: sum min(p, q) is 1 and its race of q
    picks the target's draw at every seed and position (the same race); squaring q, or taking
    its likeliest token, can only lose. A random drafter does not overlap fully."""
    prompts = load_prompts(SPEC_BENCH, 1, ["coding", "writing"], heldout_mod=5)
    table = measure_sampled(engine, ["self", "other"], prompts, max_tokens=8, temperature=0.9, seeds=4)
    assert set(table["self"]) == {"code", "chat"}
    for a in table["self"].values():
        assert 0 < a.positions <= 8
        assert a.overlap == pytest.approx(a.positions, rel=1e-5) and a.raced[1] == a.positions
        assert a.likeliest <= a.positions + 1e-5 and a.raced[RACE_POWER] <= a.positions
    for a in table["other"].values():
        assert a.overlap < a.positions and a.raced[1] <= a.positions
    printed = render_sampled(table)
    assert printed.startswith("| drafter | domain | positions | sum min(p, q) | p(argmax q) | race q | race q^2 |")
    assert "| self | all |" in printed
