"""The target's products on its GGUF file's own 4-bit weights (`target.weights: int4`).

A Q4_0 / Q4_1 tensor stores each group of 32 weights of a row as 4-bit values q with one scale
d (and, for Q4_1, a minimum m): w = d * q + m. torch's weight-only int4 kernel computes
x @ W.T from exactly that shape of data (w = (q - 8) * scale + zero per group), reading a
quarter of float32's bytes, so a decode step streams ~70 MB of layer weights instead of ~440.
The kernel takes bfloat16 activations: the scales and zeros are rounded to bfloat16 once, and a
product's input is rounded to bfloat16 (its bfloat16 output is read exactly by the float32 ops
after it; norms, attention and the residual stream stay float32).

Speculative decoding and batching need a row scored exactly as plain decoding alone scores it,
whatever else shares its forward. Rounding to bfloat16 would magnify any float32 difference into
~0.5-logit ones, so every step of the quantized model is row-invariant (tested):
  * rows whose logits are read (decode, verification) go through the int4 kernel, which computes
    a row bit for bit the same at every row count;
  * rows that only fill the cache (prompt prefill) go through a dense copy of the same weights:
    where the CPU has bfloat16 instructions, oneDNN's packed bfloat16 product
    (workers/models/bf16.py) costs 0.13-0.15 ms a row of all 30 layers' products in calls of
    64 to 128 rows, where a step on the int4 kernel grows ~2 ms a row (Intel Xeon with AMX). It
    may change a row's result with the call's row count, so it runs in calls of the row counts
    its probe found to compute a row alike (`invariant_rows`): a 39-token prompt costs a call of
    39 rows, not one padded to a fixed 256 (its prefill 36 against 70 ms). Without bfloat16
    instructions (AVX2 only) that GEMM takes a reference path ~50x slower than the int4 kernel,
    so prompt rows take fbgemm's float16 product there (workers/models/fp16.py; prefill ~2x the
    int4 kernel's pace), in calls of a multiple of its probed granule; with neither, the
    int4 kernel;
  * attention: see workers/models/llama.py, invariant_min_queries.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from workers.files import write_atomically
from workers.models.bf16 import Bf16Linear, bfloat16_fast
from workers.models.fp16 import Fp16Linear, float16_available

GROUP_SIZE = 32  # weights per Q4_0 / Q4_1 block
_INNER_K_TILES = 2  # the int4 packing's tile factor (the kernel's default for CPU)
_COMPUTE_DTYPE = torch.bfloat16  # what the int4 kernel multiplies in

# GGUF tensor name -> Hugging Face name of a Llama layer's products; "{i}" is the layer
LAYER_TENSORS = {
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


# what a blocks file (`save_int4`) holds; a file of another format is read from the GGUF again
_BLOCKS_FORMAT = "specroute-int4-v1"


class QuantError(ValueError):
    """The file cannot be run as int4 (its layers are not Q4_0 / Q4_1, or the shapes do not fit)."""


@dataclass(frozen=True)
class Int4Weight:
    """An [out, in] weight as 4-bit values with per-(row, group) scale and zero:
    w[o, j] = (q[o, j] - 8) * scales[j // 32, o] + zeros[j // 32, o]."""

    q: torch.Tensor  # [out, in] int32, 0..15
    scales: torch.Tensor  # [in / 32, out] float32
    zeros: torch.Tensor  # [in / 32, out] float32

    def dequantize(self) -> torch.Tensor:
        """[out, in] float32."""
        s = self.scales.t().repeat_interleave(GROUP_SIZE, dim=1)
        z = self.zeros.t().repeat_interleave(GROUP_SIZE, dim=1)
        return (self.q.float() - 8) * s + z

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.q[index], self.scales[:, index], self.zeros[:, index])

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """The weights stacked along `out` (a fused q/k/v or gate/up product)."""
        return Int4Weight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts], dim=1),
                          torch.cat([p.zeros for p in parts], dim=1))


def _blocks(data: np.ndarray, type_name: str) -> Int4Weight:
    """Decode a Q4_0 / Q4_1 tensor's bytes ([out, blocks * block_bytes] uint8)."""
    has_min = type_name == "Q4_1"
    block = 20 if has_min else 18  # fp16 d [+ fp16 m] + 16 bytes of nibbles
    out = data.shape[0]
    raw = np.ascontiguousarray(data).reshape(out, -1, block)
    d = raw[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # [out, groups]
    m = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else None
    qs = raw[:, :, block - 16 :]
    # a block's element j < 16 is the low nibble of byte j, element j + 16 its high nibble
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(out, -1).astype(np.int32)
    # w = d * q + m = (q - 8) * d + (m + 8 d); Q4_0: w = d * (q - 8)
    zeros = m + 8 * d if m is not None else np.zeros_like(d)
    scales, zeros = torch.from_numpy(d).t().contiguous(), torch.from_numpy(zeros).t().contiguous()
    return Int4Weight(torch.from_numpy(q), scales, zeros)


def _unpermute_rope_rows(w: Int4Weight, num_heads: int) -> Int4Weight:
    """GGUF stores q and k rows in llama.cpp's rotary order; undo it (as transformers does)."""
    out = w.q.shape[0]
    half = out // num_heads // 2
    index = torch.arange(out).view(num_heads, half, 2).transpose(1, 2).reshape(out)
    return w.rows(index)


def read_gguf_int4(path: Path, num_layers: int, num_heads: int, num_kv_heads: int) -> dict[str, Int4Weight]:
    """Every layer product of a Llama GGUF file as Int4Weight, by Hugging Face name."""
    import gguf  # only here: the float path never needs it

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    weights: dict[str, Int4Weight] = {}
    for i in range(num_layers):
        for gguf_name, hf_name in LAYER_TENSORS.items():
            name = gguf_name.format(i=i)
            t = tensors.get(name)
            if t is None:
                raise QuantError(f"{path}: no tensor {name}")
            if t.tensor_type.name not in ("Q4_0", "Q4_1"):
                raise QuantError(f"{path}: {name} is {t.tensor_type.name}; weights 'int4' needs Q4_0 or Q4_1 layers")
            w = _blocks(t.data, t.tensor_type.name)
            if w.q.shape[0] % 8:  # the kernel packs output rows in eights (blocks make `in` a multiple of 32)
                raise QuantError(f"{path}: {name} has {w.q.shape[0]} rows; the int4 kernel needs a multiple of 8")
            if name.endswith("attn_q.weight"):
                w = _unpermute_rope_rows(w, num_heads)
            elif name.endswith("attn_k.weight"):
                w = _unpermute_rope_rows(w, num_kv_heads)
            weights[hf_name.format(i=i)] = w
    return weights


def save_int4(weights: Mapping[str, Int4Weight], path: Path) -> None:
    """Write `read_gguf_int4`'s result to a safetensors file, two 4-bit values a byte, atomically:
    reading it back takes ~0.3 s where gguf-py parses the GGUF's 147k metadata fields in ~5."""
    tensors: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        q = w.q.to(torch.uint8)
        tensors[f"{name}.q"] = q[:, 0::2] | (q[:, 1::2] << 4)
        tensors[f"{name}.scales"], tensors[f"{name}.zeros"] = w.scales, w.zeros
    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": _BLOCKS_FORMAT}))


def load_int4(path: Path) -> dict[str, Int4Weight] | None:
    """A file `save_int4` wrote; None when there is none, or it is unreadable or of another format."""
    try:
        with safe_open(str(path), framework="pt") as f:
            if (f.metadata() or {}).get("format") != _BLOCKS_FORMAT:
                return None
        tensors = load_file(str(path))
    except (OSError, SafetensorError):
        return None
    weights: dict[str, Int4Weight] = {}
    for key in tensors:
        if key.endswith(".q"):
            name, packed = key.removesuffix(".q"), tensors[key]
            q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1).to(torch.int32)
            weights[name] = Int4Weight(q, tensors[f"{name}.scales"], tensors[f"{name}.zeros"])
    return weights


DenseCopy = Literal["auto", "bfloat16", "float16", "none"]


def dense_format(device: torch.device) -> DenseCopy:
    """The dense format an int4 target's rows beside the int4 kernel (prompt rows, logits) compute
    in here: bfloat16 with bfloat16 instructions, else fbgemm's float16 (x86), else none."""
    if bfloat16_fast(device):
        return "bfloat16"
    return "float16" if device.type == "cpu" and float16_available() else "none"


class Int4Linear:
    """y = x @ W.T for an Int4Weight: the first `num_scored` rows through the int4 kernel, the
    rest (prefill rows) through a dense copy of the weights: `dense` names its format (auto: where
    it pays, see the module docstring), none: the int4 kernel too. y is bfloat16, as the kernel
    returns it: a float32 op taking it converts it exactly, so the model converts nothing back."""

    def __init__(self, weight: Int4Weight, dense: DenseCopy = "auto") -> None:
        scales, zeros = weight.scales.to(_COMPUTE_DTYPE), weight.zeros.to(_COMPUTE_DTYPE)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.q, _INNER_K_TILES)
        self.scales_zeros = torch.stack([scales, zeros], dim=-1).contiguous()  # [in / 32, out, 2]
        if dense == "auto":
            dense = dense_format(torch.device("cpu"))
        self.dense: Bf16Linear | Fp16Linear | None = None
        if dense != "none":
            # the same values the kernel computes with (bfloat16 scales and zeros), rounded to the copy's format
            values = Int4Weight(weight.q, scales.float(), zeros.float()).dequantize()
            self.dense = Bf16Linear(values) if dense == "bfloat16" else Fp16Linear.of(values)

    @property
    def nbytes(self) -> int:
        """Bytes a step streams: the packed values and group scales (the dense copy serves prompt rows)."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def __call__(self, x: torch.Tensor, num_scored: int | None = None) -> torch.Tensor:
        n = x.shape[0]
        a = n if num_scored is None or self.dense is None else num_scored
        xb = x.to(_COMPUTE_DTYPE)
        if a == n:
            return self._int4(xb)
        assert self.dense is not None
        if a == 0:
            return self.dense(xb)
        return torch.cat([self._int4(xb[:a]), self.dense(xb[a:])])

    def _int4(self, xb: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, GROUP_SIZE, self.scales_zeros)
