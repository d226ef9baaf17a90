"""Path confinement (policies/paths.py): the service reads models, checkpoints, classifiers and
policy files only under its allowed directories."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from test_routing import policy_dict

from policies.paths import MODEL_DIRS_ENV, REPO_ROOT, PathNotAllowed, allowed_dirs, confine
from policies.schema import PolicyError, load_policy
from policies.stats import MemoryStats
from router.app import AppArgs
from workers.engine import SpecEngine
from workers.routing import Router


@pytest.fixture()
def roots(tmp_path: Path) -> tuple[Path, Path]:
    inside, outside = tmp_path / "allowed", tmp_path / "elsewhere"
    (inside / "ckpt").mkdir(parents=True)
    (outside / "ckpt").mkdir(parents=True)
    return inside, outside


def test_inside_is_resolved_and_outside_is_refused_naming_the_field(roots: tuple[Path, Path]) -> None:
    inside, outside = roots
    assert confine(inside / "ckpt", [inside], "engine.drafters[0].path") == (inside / "ckpt").resolve()
    with pytest.raises(PathNotAllowed, match=r"^engine\.drafters\[0\]\.path: .*elsewhere.* outside the allowed"):
        confine(outside / "ckpt", [inside], "engine.drafters[0].path")


@pytest.mark.parametrize("escape", ["dotdot", "symlink"])
def test_no_escape_by_dotdot_or_symlink(roots: tuple[Path, Path], escape: str) -> None:
    inside, outside = roots
    if escape == "dotdot":
        path = inside / ".." / "elsewhere" / "ckpt"
    else:
        path = inside / "link"
        path.symlink_to(outside / "ckpt")
    with pytest.raises(PathNotAllowed):
        confine(path, [inside], "classifier.model")


def test_shipped_dirs_and_the_environment(roots: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    inside, outside = roots
    assert confine("models/classifier", allowed_dirs(), "classifier.model") == REPO_ROOT / "models" / "classifier"
    with pytest.raises(PathNotAllowed):
        confine("/etc/passwd", allowed_dirs(), "routing.policy")
    monkeypatch.setenv(MODEL_DIRS_ENV, f"{outside}:{inside}")
    assert confine(outside / "ckpt", allowed_dirs(), "x") == (outside / "ckpt").resolve()


def test_app_args_refuse_a_checkpoint_or_policy_outside(roots: tuple[Path, Path]) -> None:
    inside, outside = roots
    eagle = {"drafters": [{"kind": "eagle", "path": str(outside / "ckpt")}]}
    with pytest.raises(ValidationError, match=r"engine\.drafters\[0\]\.path: .*outside the allowed"):
        AppArgs.model_validate({"engine": eagle})
    args = AppArgs.model_validate({"engine": eagle, "allowed_dirs": [str(outside)]})
    assert args.engine.drafters[0].kind == "eagle"
    with pytest.raises(ValidationError, match=r"routing\.policy: .*outside the allowed"):
        AppArgs.model_validate({"routing": {"policy": str(outside / "p.yaml")}})
    with pytest.raises(ValidationError, match=r"engine\.target\.model: .*outside the allowed"):
        AppArgs.model_validate({"engine": {"target": {"model": str(outside / "m.gguf")}}})
    assert AppArgs.model_validate({}).engine.local_paths() == []  # the packaged target needs no directory


def test_a_policy_pointing_the_classifier_outside_is_refused_and_the_old_stays(
    tiny_engine: SpecEngine, roots: tuple[Path, Path],
) -> None:
    inside, outside = roots
    router = Router(tiny_engine, load_policy(policy_dict()), MemoryStats(), allowed_dirs=(inside,))
    bad = {**policy_dict(), "version": "bad", "classifier": {"model": str(outside / "ckpt")}}
    with pytest.raises(PolicyError, match=r"^classifier\.model: .*outside the allowed"):
        router.set_policy(load_policy(bad))
    assert router.policy.version == "test-1"


def test_a_relative_model_directory_resolves_against_the_repository(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray replica's working directory is not the caller's: `models/...` in a config still
    names the repository's directory there, and a hub id stays a hub id."""
    from workers.config import ModelConfig

    monkeypatch.chdir(tmp_path)
    assert ModelConfig(model="models/classifier").local_path() == REPO_ROOT / "models" / "classifier"
    assert ModelConfig(model="HuggingFaceTB/SmolLM2-135M-Instruct").local_path() is None
    (tmp_path / "models" / "classifier").mkdir(parents=True)  # the working directory's copy wins
    assert ModelConfig(model="models/classifier").local_path() == Path("models/classifier")
