"""Kernel probes kept on disk: a process on the same machine and software reads a probe's result
back instead of probing; another machine, thread count or probe code probes again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from workers.files import write_atomically
from workers.models import probes
from workers.models.bf16 import CallRows, bfloat16_available, invariant_rows

calls: list[tuple[int, int]] = []


@probes.kept_probe(encode=lambda rows: [rows.min_rows, rows.max_rows], decode=lambda v: CallRows(*v))
def counted(out_features: int, in_features: int) -> CallRows:
    calls.append((out_features, in_features))
    return CallRows(out_features % 4 + 1, in_features)


def new_process() -> None:
    """What a new process starts with: nothing probed in memory."""
    counted.cache_clear()  # type: ignore[attr-defined]
    calls.clear()


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECROUTE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(probes.PROBE_CACHE_ENV, raising=False)
    new_process()
    return tmp_path


def test_a_second_process_reads_the_result_the_first_probed(cache_dir: Path) -> None:
    assert counted(8, 16) == CallRows(1, 16)
    assert counted(8, 16) == CallRows(1, 16)  # the process's own memory
    assert calls == [(8, 16)]
    new_process()
    assert counted(8, 16) == CallRows(1, 16)
    assert counted(9, 16) == CallRows(2, 16)  # another shape is probed
    assert calls == [(9, 16)]
    [kept] = (cache_dir / probes.PROBE_DIR).glob("*.json")
    assert len(json.loads(kept.read_text())) == 2


def test_another_cpu_or_thread_count_probes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    counted(8, 16)
    new_process()
    monkeypatch.setattr(probes, "_cpu", lambda: {"cpu": "another CPU", "flags": "0"})
    counted(8, 16)
    assert calls == [(8, 16)]
    real = probes.machine
    monkeypatch.setattr(probes, "machine", lambda device: {**real(device), "threads": 99})
    new_process()
    counted(8, 16)
    assert calls == [(8, 16)]


def test_an_edited_probe_probes_again(monkeypatch: pytest.MonkeyPatch) -> None:
    counted(8, 16)
    new_process()
    monkeypatch.setattr(probes, "_source_digest", lambda path: "edited")
    counted(8, 16)
    assert calls == [(8, 16)]


def test_a_file_that_cannot_be_read_is_probed_over(cache_dir: Path) -> None:
    counted(8, 16)
    [kept] = (cache_dir / probes.PROBE_DIR).glob("*.json")
    data = json.loads(kept.read_text())
    kept.write_text(json.dumps({key: "not rows" for key in data}))  # a value of another shape
    new_process()
    assert counted(8, 16) == CallRows(1, 16)
    kept.write_text("{ half a file")
    new_process()
    assert counted(8, 16) == CallRows(1, 16)
    assert calls == [(8, 16)]
    assert json.loads(kept.read_text()) == data  # written anew


def test_probes_are_not_kept_where_the_environment_says_so(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(probes.PROBE_CACHE_ENV, "0")
    counted(8, 16)
    new_process()
    counted(8, 16)
    assert calls == [(8, 16)]
    assert not (cache_dir / probes.PROBE_DIR).exists()


def test_an_unwritable_cache_still_gives_the_probes_result(cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = cache_dir / "file"
    blocker.write_text("")
    monkeypatch.setenv("SPECROUTE_CACHE_DIR", str(blocker))  # a directory cannot be made under a file
    assert counted(8, 16) == CallRows(1, 16)


@pytest.mark.skipif(not bfloat16_available(torch.device("cpu")), reason="no oneDNN bfloat16 products on this CPU")
def test_a_kept_bfloat16_probe_is_the_one_this_machine_computes() -> None:
    fresh = invariant_rows.probe(576, 576)  # type: ignore[attr-defined]
    invariant_rows.cache_clear()  # type: ignore[attr-defined]
    assert invariant_rows(576, 576) == fresh
    invariant_rows.cache_clear()  # type: ignore[attr-defined]
    assert invariant_rows(576, 576) == fresh  # read back from the file the call above wrote


def test_a_writer_that_fails_leaves_the_old_file_whole_and_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "kept.json"
    write_atomically(path, lambda tmp: tmp.write_text("old"))

    def fails(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_atomically(path, fails)
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["kept.json"]


def test_a_float32_kernel_plan_is_kept_and_a_foreign_one_timed_again(cache_dir: Path) -> None:
    from workers.models import llama

    kernels = llama._available(torch.device("cpu"), torch.float32)
    llama._kernel_plan.cache_clear()
    plan = llama._kernel_plan(24, 32, kernels)
    [kept] = (cache_dir / probes.PROBE_DIR).glob("*.json")
    data = json.loads(kept.read_text())
    [key] = [k for k in data if "_kernel_plan(24, 32," in k]
    assert data[key] == list(plan) and set(plan) <= set(kernels)
    data[key] = ["warp"] * len(plan)  # not a kernel: timed again, and the file mended
    write_atomically(kept, lambda tmp: tmp.write_text(json.dumps(data)))
    llama._kernel_plan.cache_clear()
    assert set(llama._kernel_plan(24, 32, kernels)) <= set(kernels)
    assert set(json.loads(kept.read_text())[key]) <= set(kernels)
