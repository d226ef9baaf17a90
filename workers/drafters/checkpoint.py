"""What the trained drafters' checkpoint folders share: a config.json beside safetensors weights,
and errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class CheckpointError(ValueError):
    """A drafter checkpoint that cannot serve this target; the message names the file or sizes."""


def read_config(folder: Path, layout: str) -> dict[str, Any]:
    """`folder`/config.json of a checkpoint in `layout` (EAGLE, Medusa)."""
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no {layout} config at {path}")
    return json.loads(path.read_text())


def write_config(folder: Path, config: dict[str, Any]) -> None:
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def missing_weights(expected: Path) -> CheckpointError:
    """No weights at `expected`; a pickle beside it is named (safetensors only: a pickle can run code)."""
    pickled = sorted(p.name for pattern in ("*.bin", "*.pt") for p in expected.parent.glob(pattern))
    hint = f" ({', '.join(pickled)} is a pickle: convert it to safetensors)" if pickled else ""
    return CheckpointError(f"no weights at {expected}{hint}")
