"""The target's products in bfloat16 on a CPU with bfloat16 instructions (`target.weights: bfloat16`).

Each product keeps one copy of its weight, rounded to bfloat16 and packed once by oneDNN into
the blocked layout its AMX / AVX512-BF16 kernels read; a call then streams half of float32's
bytes and costs nearly the same at 1 and at 16 rows (docs/benchmarks.md, "Weight formats"),
which is what verification and batching need. Products take bfloat16 inputs and return
bfloat16; norms, attention and the residual stream stay float32, as for int4.

Rounding each product's input to bfloat16 magnifies float32 differences, so the model runs
row-invariant (workers/models/llama.py, invariant_min_queries), and so must the products: a
row's result may not depend on how many rows share its call. oneDNN picks its kernel by the
call's shape, and both ends of the row range can change the reduction's order: past some row
count a different blocking (48 rows of [3072, 576] with a weight packed for 256 rows, Intel AMX),
and at one row a kernel that splits a long reduction between the threads ([576, 1536] on an AMD
EPYC with AVX512-BF16: one row differs from two in ~2e-4 of the outputs, which bfloat16 output
rounding hides from most probes). So each weight shape is probed once per process for the row
counts that compute a row bit for bit alike (`invariant_rows`); smaller calls are padded up to
that range and larger ones split to fit it. The probe costs seconds (the lm_head's most), so its
results are kept on disk for the machine's next process (workers/models/probes.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workers.models.cpu import cpu_bfloat16_pays
from workers.models.probes import kept_probe

_MAX_CALL_ROWS = 128  # the largest call probed; more rows run as several calls
_MAX_MIN_ROWS = 4  # a call is padded to at most this many rows
_THOROUGH_ROWS = 8  # row counts probed over every row of the probe, not its first rows only
_PACK_ROWS_HINT = 1  # oneDNN's packing for this many rows: decode steps are its common case


def bfloat16_available(device: torch.device) -> bool:
    """oneDNN's bfloat16 linear runs here (its speed is `cpu_bfloat16_pays`): torch built with it,
    and a CPU it packs bfloat16 weights for (AVX-512 or AVX-NE-CONVERT; torch 2.13 refuses AVX2)."""
    return device.type == "cpu" and _packs_bfloat16()


@functools.cache
def _packs_bfloat16() -> bool:
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        _pack(torch.zeros(8, 8))
    except RuntimeError:  # "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
        return False
    return True


def bfloat16_fast(device: torch.device) -> bool:
    """Whether bfloat16 products run here, and near float32's pace: where a compact format may
    choose them (without bfloat16 instructions torch takes a reference path ~50x slower)."""
    return bfloat16_available(device) and cpu_bfloat16_pays()


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous(), _PACK_ROWS_HINT)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@dataclass(frozen=True)
class CallRows:
    """The row counts of a product's calls that compute each row bit for bit alike."""

    min_rows: int  # fewer rows are padded up to this many
    max_rows: int  # more rows run as several calls of at most this many


@kept_probe(encode=lambda rows: [rows.min_rows, rows.max_rows], decode=lambda v: CallRows(*v))
def invariant_rows(out_features: int, in_features: int) -> CallRows:
    """Probed on random data, where a different reduction order shows as a different rounding of
    a few outputs in 10^4 or more. `min_rows`: the smallest count m <= _MAX_MIN_ROWS whose calls
    compute every probe row as calls of m + 1 rows do; `max_rows`: the largest count n such that
    every count from m to n computes like m, checked over every probe row up to _THOROUGH_ROWS
    rows (small calls hold few outputs, so a prefix would miss a rare difference) and over the
    call's own rows beyond."""
    g = torch.Generator().manual_seed(0)
    packed = _pack(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(_MAX_CALL_ROWS, in_features, generator=g).to(torch.bfloat16)

    # small calls' results stay lists of rows and the [128, out] reference is made once: such
    # temporaries made and freed again and again raise malloc's mmap threshold, which then keeps
    # the later calls' outputs resident (~0.7 GB after the lm_head's probe)
    def rows_in_calls_of(n: int) -> list[torch.Tensor]:
        return [row for part in x.split(n) for row in _linear(part, packed)]

    def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
        return all(torch.equal(p, q) for p, q in zip(a, b))

    by_count = {1: rows_in_calls_of(1)}
    min_rows = _MAX_MIN_ROWS
    for m in range(1, _MAX_MIN_ROWS):
        by_count[m + 1] = rows_in_calls_of(m + 1)
        if same(by_count[m], by_count[m + 1]):
            min_rows = m
            break
    ref = by_count[min_rows]
    for n in range(min_rows + 1, _THOROUGH_ROWS + 1):
        if not same(by_count[n] if n in by_count else rows_in_calls_of(n), ref):
            return CallRows(min_rows, n - 1)
    ref_tensor = torch.stack(ref)  # one allocation, held to the end; the calls below grow
    for n in range(_THOROUGH_ROWS + 1, _MAX_CALL_ROWS + 1):
        if not torch.equal(_linear(x[:n], packed), ref_tensor[:n]):
            return CallRows(min_rows, n - 1)
    return CallRows(min_rows, _MAX_CALL_ROWS)


class Bf16Linear:
    """y = x @ W.T in bfloat16 through oneDNN's packed weight, in calls whose row counts compute
    alike (`invariant_rows`: padded up, split down); y is bfloat16 (the float32 ops after it read
    it exactly)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = _pack(weight)
        self.rows = invariant_rows(*weight.shape)

    @property
    def nbytes(self) -> int:
        """Bytes a step streams."""
        return self.packed.numel() * self.packed.element_size()

    def __call__(self, x: torch.Tensor, num_scored: int | None = None) -> torch.Tensor:
        """`num_scored` does not matter here: prompt rows and scored rows compute alike."""
        xb = x.to(torch.bfloat16)
        if xb.shape[0] <= self.rows.max_rows:
            return self._call(xb)
        return torch.cat([self._call(part) for part in xb.split(self.rows.max_rows)])

    def _call(self, xb: torch.Tensor) -> torch.Tensor:
        """One call of at most max_rows rows, padded up to min_rows."""
        num_rows = xb.shape[0]
        if num_rows >= self.rows.min_rows:
            return _linear(xb, self.packed)
        padded = torch.cat([xb, xb.new_zeros(self.rows.min_rows - num_rows, xb.shape[1])])
        return _linear(padded, self.packed)[:num_rows]
