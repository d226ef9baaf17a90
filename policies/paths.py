"""Files named in configs and policies: how a relative path resolves, and where the service may
read from.

A served deployment reads models, checkpoints, classifiers and policy files only under its allowed
directories: the repository's `models/` and `policies/`, the directories in $SPECROUTE_MODEL_DIRS
(os.pathsep-separated) and those its Serve config lists. A policy sent over HTTP (PUT /v1/policy)
then cannot make a replica open an arbitrary file. Symlinks are resolved before the check. The
CLI is not confined: there the user names their own files.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODEL_DIRS_ENV = "SPECROUTE_MODEL_DIRS"
SHIPPED_DIRS = (REPO_ROOT / "models", REPO_ROOT / "policies")


class PathNotAllowed(ValueError):
    """A configured path outside the allowed directories; the message names the field and the path."""


def resolve_repo_path(path: str | Path) -> Path:
    """A path from a policy or a config (classifier, policy file, drafter checkpoint): absolute,
    relative to the working directory if it exists there, else relative to the repository (a Ray
    replica's working directory is not the caller's)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else REPO_ROOT / p


def allowed_dirs(extra: Iterable[str | Path] = ()) -> tuple[Path, ...]:
    """The shipped directories, $SPECROUTE_MODEL_DIRS and `extra`, resolved."""
    env = [d for d in os.environ.get(MODEL_DIRS_ENV, "").split(os.pathsep) if d]
    return tuple(Path(d).expanduser().resolve() for d in (*SHIPPED_DIRS, *env, *extra))


def confine(path: str | Path, allowed: Iterable[Path], field: str) -> Path:
    """`path` resolved (repository-relative as `resolve_repo_path`, symlinks followed) if it lies
    under one of `allowed`; else PathNotAllowed naming `field`."""
    real = resolve_repo_path(path).resolve()
    roots = list(allowed)
    if not any(real == root or real.is_relative_to(root) for root in roots):
        shown = ", ".join(str(r) for r in roots)
        raise PathNotAllowed(f"{field}: {str(path)!r} is outside the allowed directories ({shown}); "
                             f"add its directory to allowed_dirs or ${MODEL_DIRS_ENV}")
    return real
