"""The router's start-up calibration kept on disk, so a replica that starts again reuses it.

Calibrating (`workers.routing.measure_costs`, `measure_batch_cost`) runs the target for 15-50 s
of a replica's start (a 2-core CPU; most on one without AVX-512, where prompt rows are dear).
What it measures depends on the engine config, the model files, the software and the machine,
so a file keyed by a digest of all of them under `<cache dir>/calibration/` holds it: a start
with the same key reads it back in milliseconds, a start with any of them changed measures
again. Like torch.compile's caches, it also keeps a restart that happens under load (a replica
replaced while its neighbours serve) from taking a slowed measurement as its prior. Delete the
directory, or set `routing.calibration_cache: false`, to measure at every start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policies.batching import BatchCost
from policies.cost import CostTable
from workers.config import EngineConfig, default_cache_dir
from workers.files import write_atomically
from workers.models.probes import machine

log = logging.getLogger(__name__)

CALIBRATION_DIR = "calibration"
KEEP_FILES = 32  # newest calibrations kept; starting one more removes the oldest
_FORMAT = 1  # what a file holds; files of another format are measured again
# engine settings that only say what a replica logs: they move no measured time
_LOG_FIELDS = {"log_stats_interval_s", "log_requests", "max_log_len"}


@dataclass(frozen=True)
class Calibration:
    """What a replica measures at start: the cost model's prior and the batch's step cost."""

    costs: CostTable
    batch_cost: BatchCost
    origin: str = "measured"  # for the replica's log: measured, or read from which file


def _stamp(path: Path) -> list[Any]:
    """A model file's or directory's files with their sizes and modification times: a retrained
    drafter written over the same path changes it."""
    if path.is_file():
        st = path.stat()
        return [path.name, st.st_size, st.st_mtime_ns]
    if path.is_dir():
        return [_stamp(p) for p in sorted(path.iterdir()) if p.is_file()]
    return [str(path), None]


def _code_digest() -> str:
    """The engine's source: an edited kernel or forward may move every time (a release's version
    number does not change while the code does)."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def identity(config: EngineConfig, source_dir: Path | str, device: torch.device) -> dict[str, Any]:
    """Everything a calibration's times depend on, as JSON-able data (the file keeps it, so a
    reader can tell why a start measured again)."""
    return {
        "format": _FORMAT,
        "engine": config.model_dump(mode="json", exclude=_LOG_FIELDS),
        "models": [[field, _stamp(path)] for field, path in config.local_paths()] + [str(source_dir)],
        "software": {"workers": _code_digest(), "torch": torch.__version__},
        "machine": machine(device),
    }


def calibration_path(config: EngineConfig, ident: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:24]
    return (config.target.cache_dir or default_cache_dir()) / CALIBRATION_DIR / f"{digest}.json"


def load(path: Path, ident: dict[str, Any]) -> Calibration | None:
    """The calibration kept at `path` for `ident`; None when there is none, or it is unreadable
    or another's (a digest collision, or a file edited by hand)."""
    try:
        data = json.loads(path.read_text())
        if data["identity"] != json.loads(json.dumps(ident)):
            return None
        c, b = data["costs"], data["batch_cost"]
        return Calibration(
            CostTable(tuple(c["verify_s"]), dict(c["draft_s_per_token"]),
                      {name: tuple(sizes) for name, sizes in c["tree_sizes"].items()}),
            BatchCost(tuple(b["rows"]), tuple(b["seconds"]), tuple(b["prefill_rows"]), tuple(b["prefill_seconds"])),
            f"read from {path} (measured {data['measured_at']})",
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(path: Path, ident: dict[str, Any], calibration: Calibration) -> None:
    """Keep `calibration` at `path` atomically (a replica starting beside this one reads all of it
    or none), then remove all but the KEEP_FILES newest. A cache that cannot be written is logged:
    the next start measures again."""
    c, b = calibration.costs, calibration.batch_cost
    data = {
        "identity": ident,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "costs": {"verify_s": c.verify_s, "draft_s_per_token": dict(c.draft_s_per_token),
                  "tree_sizes": dict(c.tree_sizes)},
        "batch_cost": {"rows": b.rows, "seconds": b.seconds, "prefill_rows": b.prefill_rows,
                       "prefill_seconds": b.prefill_seconds},
    }
    try:
        write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1)))
        kept = sorted(path.parent.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in kept[KEEP_FILES:]:
            old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("cannot keep the routing calibration at %s: %s", path, e)
