"""Cache files that processes starting side by side share (converted weights, calibrations,
kernel probes): each written whole or not at all."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """`write` a temporary file beside `path` (its directory made if missing), then rename it to
    `path`: a reader sees the old file or all of the new one, never half of it, whether the writer
    is interrupted or another writes at the same time (the last rename wins)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
