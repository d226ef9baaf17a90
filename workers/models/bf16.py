"""The target's products in bfloat16 on a CPU with bfloat16 instructions (`target.weights: bfloat16`).

Each product keeps one copy of its weight, rounded to bfloat16 and packed once by oneDNN into
the blocked layout its AMX / AVX512-BF16 kernels read; a call then streams half of float32's
bytes and costs nearly the same at 1 and at 16 rows (docs/benchmarks.md, "Weight formats"),
which is what verification and batching need. Products take bfloat16 inputs and return
bfloat16; norms, attention and the residual stream stay float32, as for int4.

Rounding each product's input to bfloat16 magnifies float32 differences, so the model runs
row-invariant (workers/models/llama.py, invariant_min_queries), and so must the products: a
row's result may not depend on how many rows share its call. oneDNN picks its kernel by the
call's shape, and past some row count a different blocking of the reduction changes the
rounding (seen at 48 rows of [3072, 576] with a weight packed for 256 rows). So each weight
shape is probed once per process: the largest row count up to which every count computes a
row bit for bit alike (`invariant_rows`), and calls never exceed it.
"""

from __future__ import annotations

import functools

import torch

from workers.models.cpu import cpu_bfloat16_pays

_MAX_CALL_ROWS = 128  # the largest call probed; more rows run as several calls
_PACK_ROWS_HINT = 1  # oneDNN's packing for this many rows: decode steps are its common case


def bfloat16_available(device: torch.device) -> bool:
    """oneDNN's bfloat16 linear exists in this torch build (its speed is `cpu_bfloat16_pays`)."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                                                     "_reorder_linear_weight")


def bfloat16_fast(device: torch.device) -> bool:
    """Whether bfloat16 products run here, and near float32's pace: where a compact format may
    choose them (without bfloat16 instructions torch takes a reference path ~50x slower)."""
    return bfloat16_available(device) and cpu_bfloat16_pays()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), _PACK_ROWS_HINT)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@functools.cache
def invariant_rows(out_features: int, in_features: int) -> int:
    """The largest n <= _MAX_CALL_ROWS such that a call of any 1..n rows computes each row bit for
    bit as a call of that row alone does, whatever its place (probed on random data: a different
    reduction order shows as a different rounding of almost every row)."""
    g = torch.Generator().manual_seed(0)
    packed = _pack(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(_MAX_CALL_ROWS, in_features, generator=g).to(torch.bfloat16)
    alone = torch.cat([_linear(x[i : i + 1], packed) for i in range(_MAX_CALL_ROWS)])
    for n in range(2, _MAX_CALL_ROWS + 1):
        if not torch.equal(_linear(x[:n], packed), alone[:n]):
            return n - 1
    return _MAX_CALL_ROWS


class Bf16Linear:
    """y = x @ W.T in bfloat16 through oneDNN's packed weight, in calls of at most
    `invariant_rows` rows; y is bfloat16 (the float32 ops after it read it exactly)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = _pack(weight)
        self.max_rows = invariant_rows(*weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes a step streams."""
        return self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, num_scored: int | None = None) -> torch.Tensor:
        """`num_scored` does not matter here: prompt rows and scored rows compute alike."""
        xb = x.to(torch.bfloat16)
        if xb.shape[0] <= self.max_rows:
            return _linear(xb, self.packed)
        return torch.cat([_linear(part, self.packed) for part in xb.split(self.max_rows)])
