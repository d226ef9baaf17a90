"""What this machine's kernels compute, probed once and kept on disk for the next process.

Row invariance rests on probes of the kernels (workers/models/bf16.py `invariant_rows`,
workers/models/fp16.py `invariant_granule`): which row counts compute a row bit for bit alike.
The answer depends only on the CPU, the threads, torch's build and the probe's own code, yet
probing costs seconds at every start (4.2 s of a 7 s engine build for the shipped target's five
bfloat16 shapes on an AVX-512 EPYC). So a probe's result is kept under
`<cache dir>/probes/`, in a file keyed by all of those: a replica that starts again on the same
machine and software reads it back, and any change (another CPU, thread count, torch, or an
edit of the probing module) probes again. Set SPECROUTE_PROBE_CACHE=0 to probe in every process.

Float32 products' kernel plans (workers/models/llama.py `_kernel_plan`: the fastest kernel per
row count, timed) are kept the same way: besides the start-up time, a plan fixes how a row is
rounded, so a restart keeps the outputs of the process before it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import platform
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch

from workers.config import default_cache_dir
from workers.files import write_atomically

log = logging.getLogger(__name__)

PROBE_DIR = "probes"
PROBE_CACHE_ENV = "SPECROUTE_PROBE_CACHE"  # "0": probe in every process, keep nothing
R = TypeVar("R")
_lock = threading.Lock()  # one read-modify-write of a file at a time in this process


@functools.cache
def _cpu() -> dict[str, Any]:
    """The CPU's name and flags (Linux names both in /proc/cpuinfo; platform.processor() often
    says only "x86_64"): a VM may hide flags of the same model."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())  # the first CPU's
    except OSError:
        pass
    model = fields.get("model name", platform.processor())
    flags = fields.get("flags", fields.get("Features", ""))  # x86, Arm
    return {"cpu": model, "flags": hashlib.sha256(flags.encode()).hexdigest()[:16]}


def machine(device: torch.device) -> dict[str, Any]:
    """The machine a measurement or a probe ran on, as JSON-able data."""
    if device.type == "cuda":
        return {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda}
    return {**_cpu(), "capability": torch.backends.cpu.get_cpu_capability(), "cpus": os.cpu_count(),
            "threads": torch.get_num_threads()}


@functools.cache
def _software() -> str:
    """torch's version and build (its oneDNN, MKL and compiler flags)."""
    return hashlib.sha256(f"{torch.__version__}\n{torch.__config__.show()}".encode()).hexdigest()[:16]


@functools.cache
def _source_digest(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def _file() -> Path | None:
    """This machine's and software's probe file; None where probes are not kept."""
    if os.environ.get(PROBE_CACHE_ENV, "1") == "0":
        return None
    ident = json.dumps({"machine": machine(torch.device("cpu")), "torch": _software()}, sort_keys=True)
    return default_cache_dir() / PROBE_DIR / f"{hashlib.sha256(ident.encode()).hexdigest()[:24]}.json"


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: Path, key: str, value: Any) -> None:
    """Add one result to the file (two processes writing at once may lose one result, which the
    next start probes again)."""
    with _lock:
        data = _read(path)
        data[key] = value
        try:
            write_atomically(path, lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True)))
        except OSError as e:
            log.warning("cannot keep a kernel probe's result at %s: %s", path, e)


def kept_probe(
    encode: Callable[[R], Any] = lambda r: r, decode: Callable[[Any], R] = lambda v: v,
) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Decorate a probe of hashable, repr-stable arguments (shapes): probed once per process, and
    read back from this machine's probe file when an earlier process kept it. `encode` and
    `decode` turn the result into JSON and back. The undecorated probe stays at `.probe`."""

    def wrap(probe: Callable[..., R]) -> Callable[..., R]:
        source = inspect.getsourcefile(probe)
        assert source is not None

        @functools.cache
        @functools.wraps(probe)
        def kept(*args: Any) -> R:
            key = f"{probe.__module__}.{probe.__qualname__}{args!r} {_source_digest(source)}"
            path = _file()
            if path is not None and key in (known := _read(path)):
                try:
                    return decode(known[key])
                except (TypeError, ValueError):
                    pass  # a file edited by hand, or another version's result: probe again
            result = probe(*args)
            if path is not None:
                _write(path, key, encode(result))
            return result

        kept.probe = probe  # type: ignore[attr-defined]
        return kept

    return wrap
