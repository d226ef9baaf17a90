"""The router's start-up calibration, kept on disk: a start with the same engine, model files,
code and machine reads it back instead of measuring; any of them changed, it measures again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import workers.routing as routing
from policies.stats import MemoryStats
from workers import calibration
from workers.config import RoutingConfig
from workers.engine import SpecEngine
from workers.routing import Router, calibrate


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECROUTE_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The measurements the router runs, by name."""
    calls: list[str] = []
    for name in ("measure_costs", "measure_batch_cost"):
        real = getattr(routing, name)
        monkeypatch.setattr(routing, name, lambda engine, _real=real, _name=name: calls.append(_name) or _real(engine))
    return calls


def test_a_second_start_reads_the_calibration_the_first_measured(
    tiny_engine: SpecEngine, cache_dir: Path, measured: list[str],
) -> None:
    first = Router.from_config(tiny_engine, RoutingConfig(), MemoryStats())
    assert measured == ["measure_costs", "measure_batch_cost"]
    [kept] = (cache_dir / calibration.CALIBRATION_DIR).glob("*.json")
    again = Router.from_config(tiny_engine, RoutingConfig(), MemoryStats())
    assert len(measured) == 2  # nothing measured
    assert again.costs == first.costs and again.batch_cost == first.batch_cost
    assert again.batch_cost_in_seconds
    assert first.calibration_origin.startswith("measured in") and str(kept) in first.calibration_origin
    assert again.calibration_origin.startswith(f"read from {kept}")
    # the file says what it was measured for
    ident = json.loads(kept.read_text())["identity"]
    assert ident["engine"]["target"]["model"] == tiny_engine.config.target.model
    assert ident["machine"]["threads"] >= 1


def test_another_engine_config_or_a_changed_model_file_measures_again(
    tiny_engine: SpecEngine, cache_dir: Path, measured: list[str],
) -> None:
    calibrate(tiny_engine)
    assert len(measured) == 2
    deeper = SpecEngine(tiny_engine.target, tiny_engine.drafters,
                        tiny_engine.config.model_copy(update={"max_draft_len": tiny_engine.config.max_draft_len - 1}))
    calibrate(deeper)
    assert len(measured) == 4
    # what a replica only logs is no reason to measure
    calibrate(SpecEngine(tiny_engine.target, tiny_engine.drafters,
                         tiny_engine.config.model_copy(update={"log_requests": True, "log_stats_interval_s": 1.0})))
    assert len(measured) == 4
    # a drafter retrained into the same directory: its files' times change
    [(_, target)] = [(f, p) for f, p in tiny_engine.config.local_paths() if f == "engine.target.model"]
    weights = next(target.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    try:
        calibrate(tiny_engine)
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert len(measured) == 6


def test_an_unreadable_calibration_is_measured_again_and_replaced(
    tiny_engine: SpecEngine, cache_dir: Path, measured: list[str],
) -> None:
    calibrate(tiny_engine)
    [kept] = (cache_dir / calibration.CALIBRATION_DIR).glob("*.json")
    kept.write_text(kept.read_text()[:50])
    calibrate(tiny_engine)
    assert len(measured) == 4
    assert calibration.load(kept, json.loads(kept.read_text())["identity"]) is not None


def test_without_the_cache_every_start_measures_and_keeps_nothing(
    tiny_engine: SpecEngine, cache_dir: Path, measured: list[str],
) -> None:
    for _ in range(2):
        Router.from_config(tiny_engine, RoutingConfig(calibration_cache=False), MemoryStats())
    assert len(measured) == 4
    assert not (cache_dir / calibration.CALIBRATION_DIR).exists()


def test_only_the_newest_calibrations_are_kept(tiny_engine: SpecEngine, cache_dir: Path) -> None:
    measured = calibrate(tiny_engine, reuse=False)
    ident = calibration.identity(tiny_engine.config, tiny_engine.target.source_dir, tiny_engine.target.model.device)
    folder = cache_dir / calibration.CALIBRATION_DIR
    for i in range(calibration.KEEP_FILES + 3):
        path = folder / f"{i:03d}.json"
        calibration.save(path, ident, measured)
        os.utime(path, ns=(i * 10**9, i * 10**9))  # written in this order
    kept = sorted(p.name for p in folder.glob("*.json"))
    assert len(kept) == calibration.KEEP_FILES and kept[0] == "003.json"
