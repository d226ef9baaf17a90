"""What this CPU computes fast, decided once per process."""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def cpu_bfloat16_pays() -> bool:
    """Whether bfloat16 products run near float32's pace on this CPU. With bfloat16 dot products
    (AVX512-BF16, AMX) they do; on an x86 CPU without AVX-512 torch takes a reference path: one
    row of [576, 1536] in 1.6 ms against 0.08 in float32, 256 rows in 342 ms against 2.9 (AMD
    EPYC, 2 threads). Other CPUs (AVX-512 without BF16, Arm) are timed: a timing alone misreads
    a CPU that is busy with other work, so it decides only where the flags do not."""
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return True
    if torch.cpu._is_avx2_supported() and not torch.cpu._is_avx512_supported():
        return False
    return _bfloat16_timed_near_float32()


def _bfloat16_timed_near_float32() -> bool:
    w, x = torch.randn(576, 1536), torch.randn(8, 576)

    def best(a: torch.Tensor, b: torch.Tensor) -> float:
        a @ b  # warm up the kernel
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        return min(times)

    # a factor of 3: a CPU converting bfloat16 in vector registers is near float32, a reference path far slower
    return best(x.bfloat16(), w.bfloat16()) < 3 * best(x, w)
