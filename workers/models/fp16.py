"""An int4 target's prompt rows and lm_head on an x86 CPU without bfloat16 instructions: fbgemm's
product on float16 weights (`torch.ops.quantized.linear_dynamic_fp16`).

There the int4 kernel computes prompt rows at ~3.4 ms a token and oneDNN's bfloat16 product takes
a reference path ~50x slower, while fbgemm converts float16 weights to float32 in registers (F16C)
and multiplies at float32's pace from half its bytes: 64 rows of the four layer shapes in 2.95 ms
against oneDNN's float32 4.0 (AMD EPYC without AVX-512, 2 threads). Float16 holds the
dequantised 4-bit values to 11 significant bits, closer than the bfloat16 copy of
workers/models/quant.py.

fbgemm computes a call's rows in register blocks whose last, shorter block may sum in another
order, so a row's result depends on its call's row count (one row alone differs from the same
row among two). Calls whose row count is a multiple of the block compute every row alike: the
smallest such `granule` is probed once per weight shape and machine (3 on an AVX2 EPYC; kept on
disk for the next process, workers/models/probes.py), and calls are padded up to a multiple of
it (prompt rows are many: the padding costs little). The lm_head on it scores a row alike in any
batch (float32's kernel plan changes a logit's last bits with the row count) and costs less for
a verify step's rows: an int4 step at k = 5 took 39 against 55 ms, at k = 0 22 against 24 (AMD
EPYC without AVX-512).
"""

from __future__ import annotations

import torch

from workers.models.probes import kept_probe

_MAX_GRANULE = 8  # a call is padded up to a multiple of at most this many rows
_MAX_CALL_ROWS = 128  # the largest call probed; more rows run as several calls


def float16_available() -> bool:
    """fbgemm's float16-weight product exists in this torch build (x86)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized,
                                                                               "linear_prepack_fp16")


def _pack(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_prepack_fp16(weight.float().contiguous(), None)


def _linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


@kept_probe()
def invariant_granule(out_features: int, in_features: int) -> int | None:
    """The smallest g <= _MAX_GRANULE such that calls of every multiple of g rows, up to
    _MAX_CALL_ROWS, compute each row bit for bit as calls of g rows do; probed on random data,
    where another summation order shows in a few outputs in 10^4. None: no such g here."""
    g = torch.Generator().manual_seed(0)
    packed = _pack(torch.randn(out_features, in_features, generator=g) * 0.05)
    x = torch.randn(_MAX_CALL_ROWS, in_features, generator=g)
    for granule in range(1, _MAX_GRANULE + 1):
        rows = _MAX_CALL_ROWS // granule * granule
        ref = torch.cat([_linear(part, packed) for part in x[:rows].split(granule)])
        if all(torch.equal(_linear(x[:n], packed), ref[:n]) for n in range(2 * granule, rows + 1, granule)):
            return granule
    return None


class Fp16Linear:
    """y = x @ W.T on float16 weights through fbgemm, in calls of a multiple of the probed granule
    (padded up; longer inputs split), so every row computes alike; y is `out_dtype`: bfloat16 for
    a layer, as the int4 kernel's is (the float32 ops after it read it exactly), float32 logits."""

    def __init__(self, weight: torch.Tensor, granule: int, out_dtype: torch.dtype = torch.bfloat16) -> None:
        self.packed = _pack(weight)
        self.granule = granule
        self.max_rows = _MAX_CALL_ROWS // granule * granule
        self.out_dtype = out_dtype
        self.nbytes = 2 * weight.numel()  # what a call streams: the float16 values

    @classmethod
    def of(cls, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> Fp16Linear | None:
        """The product, where this CPU has a granule for the shape (None: none)."""
        granule = invariant_granule(*weight.shape)
        return None if granule is None else cls(weight, granule, out_dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if x.shape[0] <= self.max_rows:
            return self._call(x)
        return torch.cat([self._call(part) for part in x.split(self.max_rows)])

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        num_rows = x.shape[0]
        if pad := -num_rows % self.granule:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        return _linear(x.contiguous(), self.packed)[:num_rows].to(self.out_dtype)
