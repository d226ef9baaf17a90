"""The machine a benchmark ran on, recorded with its results: speedups are hardware-bound."""

from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers


@dataclass(frozen=True)
class MachineInfo:
    cpu: str
    cores: int | None
    torch_threads: int
    torch: str
    transformers: str
    python: str
    platform: str
    gpu: str | None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    return asdict(MachineInfo(
        cpu=_cpu_model(),
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    ))
