"""A static-cache Llama forward for speculative decoding (gpt-fast style), one sequence or a batch.

Why not transformers' own forward: a verify step must cost little more than a plain step, so
  * the KV cache is preallocated (per request, or one slot of a pool shared by a running batch)
    and rollback is moving an integer;
  * q/k/v and gate/up are fused into one product each;
  * the kernel is chosen by row count (`Linear`): a 1-2 row step streams a transposed,
    contiguous weight (`x @ W_t`), a verify step of 3+ rows uses MKL's packed GEMM;
  * batched and row-invariant attention runs over the key/value heads, the query heads sharing
    one as rows of its call (`_grouped`).
Weights come as `LlamaWeights`: read from a checkpoint's safetensors files (workers/target.py), or
taken from a loaded transformers model, so every checkpoint format it reads works here; with
`quantized` weights the layer products run on a GGUF file's 4-bit blocks instead
(workers/models/quant.py), with `bfloat16` every product on packed bfloat16 weights
(workers/models/bf16.py).
"""

from __future__ import annotations

import ctypes
import functools
import heapq
import itertools
import logging
import math
import mmap
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from workers.models.base import LIBC, ForwardOutput, ModelInfo, SeqInput, TargetView, forward_each
from workers.models.bf16 import Bf16Linear
from workers.models.fp16 import Fp16Linear
from workers.models.probes import kept_probe
from workers.models.quant import Int4Linear, Int4Weight, dense_format
from workers.tree import DraftTree

if TYPE_CHECKING:  # transformers' modeling code takes seconds to import; a checkpoint read needs none of it
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger(__name__)

# rope types whose frequencies depend on the sequence length are left to transformers
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}
# a layer's product weights by transformers' names: .format(layer, projection)
_ATTN, _MLP = "model.layers.{}.self_attn.{}_proj.weight", "model.layers.{}.mlp.{}_proj.weight"


def supports(config: object) -> bool:
    """Whether this implementation computes exactly what transformers' Llama does for config."""
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
    return (
        getattr(config, "model_type", None) == "llama"
        and not getattr(config, "attention_bias", False)
        and not getattr(config, "mlp_bias", False)
        and getattr(config, "hidden_act", "silu") == "silu"
        and rope.get("rope_type", "default") in _STATIC_ROPE_TYPES
    )


def tensor_names(config: PretrainedConfig, tied: bool) -> set[str]:
    """The checkpoint tensors FastLlama computes with, by transformers' names (`tied`: the output
    head is the input embeddings, so no `lm_head.weight`)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"} | ({"lm_head.weight"} if not tied else set())
    for i in range(config.num_hidden_layers):
        names |= {f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"}
        names |= {_ATTN.format(i, p) for p in "qkvo"} | {_MLP.format(i, p) for p in ("gate", "up", "down")}
    return names


def rotary_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float]:
    """The inverse frequencies (float32, [head_dim / 2]) and the attention scaling that
    transformers' Llama computes for the config's rope type: its library function, or for the
    default type the formula its Llama module holds itself."""
    rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
    if rope["rope_type"] == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
    return inv_freq.float(), scaling


@dataclass(frozen=True)
class LlamaWeights:
    """A Llama checkpoint as FastLlama computes with it: its config, its tensors by transformers'
    names (where the output head is the input embeddings, `lm_head.weight` is absent or that very
    tensor) and its rotary frequencies."""

    config: PretrainedConfig
    tensors: Mapping[str, torch.Tensor]
    inv_freq: torch.Tensor  # float32 [head_dim / 2]
    attention_scaling: float

    @classmethod
    def of(cls, model: PreTrainedModel) -> LlamaWeights:
        """A loaded transformers model's own tensors and rotary frequencies."""
        rotary = model.model.rotary_emb
        tensors = {k: v.detach() for k, v in model.state_dict().items()}
        return cls(model.config, tensors, rotary.inv_freq.float(), rotary.attention_scaling)

    @classmethod
    def of_tensors(cls, config: PretrainedConfig, tensors: Mapping[str, torch.Tensor]) -> LlamaWeights:
        """Tensors read from a checkpoint, the rotary frequencies computed for its config."""
        return cls(config, tensors, *rotary_frequencies(config))


class StaticKVCache:
    """One sequence's keys and values: its own tensors, or one slot row of a `KVPool`."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pool: KVPool | None = None, slot: int = -1) -> None:
        self.k = k  # [num_layers, num_kv_heads, capacity, head_dim]; never read past length
        self.v = v
        self.pool, self.slot = pool, slot
        self._length = 0

    @classmethod
    def empty(
        cls, num_layers: int, num_kv_heads: int, capacity: int, head_dim: int,
        dtype: torch.dtype, device: torch.device, zeroed: bool = False,
    ) -> StaticKVCache:
        """`zeroed`: finite everywhere (attention that reads masked keys past the length needs it)."""
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        new = _zeros if zeroed else torch.empty
        return cls(new(shape, dtype=dtype, device=device), new(shape, dtype=dtype, device=device))

    @property
    def length(self) -> int:
        return self._length

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of length {self._length} to {length}")
        self._length = length  # stale entries past length are never read: attention slices :end

    def extend(self, n: int) -> None:
        """Count n more entries, written by the forward that ran them."""
        if self._length + n > self.capacity:
            raise ValueError(f"{self._length + n} positions exceed the cache capacity {self.capacity}")
        self._length += n

    def detach(self) -> None:
        """Leave the pool (its slot was released): empty, and never written again."""
        self.pool, self._length = None, 0

    def keep(self, start: int, indices: Sequence[int]) -> None:
        """Keep the entries at start + indices (ascending), moved to start, start + 1, ...: a draft
        tree's accepted path becomes the contiguous sequence a chain would have left."""
        src = torch.tensor(indices, device=self.k.device) + start
        end = start + len(indices)
        if end > self._length or (len(indices) and int(src[-1]) >= self._length):
            raise ValueError(f"cannot keep {indices} after {start} in a cache of length {self._length}")
        self.k[:, :, start:end] = self.k[:, :, src]
        self.v[:, :, start:end] = self.v[:, :, src]
        self._length = end


class KVPool:
    """The KV cache of every running sequence: one slot row of `capacity` positions each.

    Slot rows rather than paged blocks: on the CPU a large `torch.empty` is mapped lazily, so
    a slot costs only the pages its sequence has written, and attention reads every sequence's
    keys in place (a strided view of the pool), where paged blocks need a gather per layer and
    step (docs/benchmarks.md, "Continuous batching"). Slots are handed out lowest first, so the
    running sequences occupy a dense range and one attention call covers them all; a released
    slot may keep a prefix of its sequence for a later one (workers/prefix.py).

    Attention over a group reads keys up to its longest sequence (whole blocks, for a
    row-invariant model), masked; a NaN there would stay NaN under the mask, so the pool starts
    as zeros (`_zeros`: no memory until written) and a released slot reads zeros again past the
    prefix it keeps (finite keys and values, which the mask hides as it hides zeros)."""

    def __init__(
        self, num_layers: int, num_slots: int, num_kv_heads: int, capacity: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.k = _zeros(shape, dtype=dtype, device=device)
        self.v = _zeros(shape, dtype=dtype, device=device)
        self._free = list(range(num_slots))  # a heap: the lowest free slot first

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    @property
    def free_slots(self) -> list[int]:
        return sorted(self._free)

    def allocate(self, slot: int | None = None) -> StaticKVCache:
        """The lowest free slot, or `slot` (free), as an empty cache: what the slot still holds
        from an earlier sequence is only read once `copy_prefix` or `extend` counts it."""
        if slot is None:
            if not self._free:
                raise RuntimeError(f"all {self.num_slots} KV slots are in use")
            slot = heapq.heappop(self._free)
        else:
            if slot not in self._free:
                raise ValueError(f"slot {slot} is not free")
            self._free.remove(slot)
            heapq.heapify(self._free)
        return StaticKVCache(self.k[:, slot], self.v[:, slot], self, slot)

    def release(self, cache: StaticKVCache, keep: int = 0) -> None:
        """Give the slot back. Its first `keep` positions stay as they are, a prefix a later
        sequence may reuse (workers/prefix.py); the rest is zeroed and its memory given to the
        system (`forget`)."""
        if cache.pool is not self or cache.slot in self._free:
            raise ValueError(f"slot {cache.slot} is not allocated from this pool")
        if not 0 <= keep <= cache.length:
            raise ValueError(f"cannot keep {keep} positions of a sequence of {cache.length}")
        self.forget(cache.slot, keep)
        heapq.heappush(self._free, cache.slot)
        cache.detach()

    def forget(self, slot: int, start: int = 0) -> None:
        """Zero positions `start` onwards of a slot, handing their pages to the system: a slot keeps
        no pages past what it holds, so the pool's resident size follows the positions held, not
        its longest sequence ever."""
        for layer in range(self.k.shape[0]):
            for kv in (self.k, self.v):
                if start == 0:
                    _zero_(kv[layer, slot])
                else:  # each head's positions are contiguous
                    for head in range(kv.shape[2]):
                        _zero_(kv[layer, slot, head, start:])

    def copy_prefix(self, src_slot: int, cache: StaticKVCache, length: int) -> None:
        """Start an empty cache with the first `length` positions another slot holds."""
        if cache.pool is not self or cache.length:
            raise ValueError("copy a prefix into an empty cache of this pool")
        self.k[:, cache.slot, :, :length] = self.k[:, src_slot, :, :length]
        self.v[:, cache.slot, :, :length] = self.v[:, src_slot, :, :length]
        cache.extend(length)


_MADV_DONTNEED = 4  # <sys/mman.h>: private anonymous pages are freed and read back as zeros


def _zero_(t: torch.Tensor) -> torch.Tensor:
    """Zero a contiguous tensor; on a Linux CPU by handing its whole pages back to the system,
    which then read as the kernel's one shared zero page until written: no resident memory, and
    reading them (attention's masked padding keys, see KeySpan) costs no memory
    traffic. The partial pages at either end, and any tensor elsewhere, are zeroed in place."""
    if LIBC is None or t.device.type != "cpu" or not t.is_contiguous():
        return t.zero_()
    page, size = mmap.PAGESIZE, t.element_size()
    first, last = t.data_ptr(), t.data_ptr() + t.numel() * size
    start, end = -(-first // page) * page, last // page * page
    if end <= start:
        return t.zero_()
    if LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED):
        log.warning("madvise failed (errno %d): zeroing KV memory in place", ctypes.get_errno())
        return t.zero_()
    flat = t.view(-1)
    flat[: (start - first) // size].zero_()
    flat[(end - first) // size :].zero_()
    return t


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros that takes memory only where it is written, on a CPU (`_zero_`)."""
    return _zero_(torch.empty(shape, dtype=dtype, device=device))


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Product  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: Product  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Product  # hidden -> 2 * intermediate
    down: Product  # intermediate -> hidden


# A product's best kernel depends on the machine and on the number of rows (1 for a decode step,
# 1 + k to verify a draft): MKL's packed GEMM wins on some Intel parts, oneDNN on AMD (measured
# 3x on the lm_head at 8 rows, docs/benchmarks.md), for one row a plain x @ W_t or oneDNN.
# So each weight shape is timed on the kernels available, per row bucket, once per machine: the
# plan is kept with the kernel probes (workers/models/probes.py), so a restart neither pays the
# timing again nor risks another plan from timing noise (a plan fixes a row's float32 rounding).
_ROW_BUCKETS = (1, 3, 8, 17)  # representative rows; a product takes the bucket of the first >= its rows
_KERNELS = ("stream", "dnnl", "mkl")
_MARGIN = 0.85  # a later kernel must be this much faster than the one chosen so far
_PACK_ROWS_HINT = 16
_COLD_BYTES = 64 << 20  # weight copies cycled while timing a kernel: more than a CPU cache holds


def _bucket(rows: int) -> int:
    return next((i for i, n in enumerate(_ROW_BUCKETS) if rows <= n), len(_ROW_BUCKETS) - 1)


def _available(device: torch.device, dtype: torch.dtype) -> tuple[str, ...]:
    if device.type != "cpu" or dtype != torch.float32:
        return ("stream",)
    kernels = ["stream"]
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        kernels.append("dnnl")
    if torch.backends.mkl.is_available():
        kernels.append("mkl")
    return tuple(kernels)


def _decode_plan(value: list[str]) -> tuple[str, ...]:
    plan = tuple(value)
    if len(plan) != len(_ROW_BUCKETS) or not set(plan) <= set(_KERNELS):
        raise ValueError(f"not a kernel plan: {value!r}")
    return plan


@kept_probe(encode=list, decode=_decode_plan)
def _kernel_plan(out_features: int, in_features: int, kernels: tuple[str, ...]) -> tuple[str, ...]:
    """The fastest kernel per row bucket for this weight shape, timed on random data.

    Timed with cold weights, as a forward sees them: it reads every layer's weights once, far more
    than a CPU cache holds, so a small step is bound by memory bandwidth. A weight that stays
    cached between repetitions (the earlier way) measured the 1-row `stream` product as fastest,
    while in the forward oneDNN reads the same bytes ~15% faster: plain decoding ran 26 ms/step
    against 22 for a 2-row verify step of the same model (SmolLM2-135M, AMD EPYC, 2 threads)."""
    if len(kernels) == 1:
        return kernels * len(_ROW_BUCKETS)
    copies = max(1, min(64, _COLD_BYTES // (4 * out_features * in_features)))
    lins = [Linear(torch.randn(out_features, in_features), plan=kernels * len(_ROW_BUCKETS),
                   keep_packed="mkl" in kernels) for _ in range(copies)]
    passes = max(1, min(2, int(4e7 // (copies * out_features * in_features))))  # ~ the same time for every shape
    plan = []
    for rows in _ROW_BUCKETS:
        x = torch.randn(rows, in_features)
        best: dict[str, float] = {}
        for kernel in kernels:
            lins[0].run(kernel, x)  # warm up the kernel (not the weights)
            t0 = time.perf_counter()
            for _ in range(passes):
                for lin in lins:  # each copy has left the cache by the time it comes round again
                    lin.run(kernel, x)
            best[kernel] = (time.perf_counter() - t0) / (passes * copies)
        # a kernel replaces the simpler one before it only when clearly faster: timing noise must
        # not flip plans between processes (and the packed copy costs memory)
        choice = "stream"
        for kernel in kernels[1:]:
            if best[kernel] < _MARGIN * best[choice]:
                choice = kernel
        plan.append(choice)
    return tuple(plan)


class Linear:
    """y = x @ W.T with the kernel chosen per number of rows; W is stored once, transposed
    ([in, out] contiguous: one row streams it), plus MKL's packed copy only when it is used."""

    def __init__(self, weight: torch.Tensor, plan: tuple[str, ...] | None = None, keep_packed: bool = False) -> None:
        self.w_t = weight.t().contiguous()  # [in, out]
        if plan is None:
            plan = _kernel_plan(weight.shape[0], weight.shape[1], _available(weight.device, weight.dtype))
        self.plan = plan
        self.packed: torch.Tensor | None = None
        if keep_packed or "mkl" in plan:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, _PACK_ROWS_HINT)

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        if kernel == "dnnl":  # oneDNN reads the [out, in] view of w_t without copying it
            return torch.ops.mkldnn._linear_pointwise(x, self.w_t.t(), None, "none", [], "")
        if kernel == "mkl":  # the original weight argument is only read for its shape
            return torch.ops.mkl._mkl_linear(x, self.packed, self.w_t.t(), None, x.shape[0])
        return x @ self.w_t

    @property
    def nbytes(self) -> int:
        """Bytes a step streams: w_t, or the MKL-packed copy of the same weights read instead."""
        return self.w_t.numel() * self.w_t.element_size()

    def __call__(self, x: torch.Tensor, num_scored: int | None = None) -> torch.Tensor:  # x: [n, in] -> [n, out]
        """`num_scored` matters to Int4Linear only: here every row takes the row count's kernel."""
        return self.run(self.plan[_bucket(x.shape[0])], x)


Product = Linear | Int4Linear | Bf16Linear | Fp16Linear  # a product in one of the weight formats


class FastLlama:
    supports_tree = True

    def __init__(
        self, weights: LlamaWeights, eos_token_ids: frozenset[int], head_rows: torch.Tensor | None = None,
        quantized: Mapping[str, Int4Weight] | None = None, bfloat16: bool = False, shared_embeddings: bool = False,
        dense_prefill: bool = True,
    ) -> None:
        """`head_rows`: token ids the lm_head computes logits for, in that order (a drafter's
        reduced vocabulary: logits column i is token head_rows[i]); None: the whole vocabulary.
        `quantized`: the layer products' 4-bit weights by name (workers/models/quant.py), used
        instead of the model's float ones (the embeddings stay float; the lm_head, see below).
        `bfloat16`: every product, the lm_head included, on packed bfloat16 weights
        (workers/models/bf16.py); the embeddings stay float. With int4 layers the lm_head is
        bfloat16 too where the CPU computes it fast: float32 logits at 6 rows cost 3x one row
        there, bfloat16 ones the same as one (its weights are ~20% of an int4 step's bytes); on
        other x86 CPUs float16 (workers/models/fp16.py), its logits float32.
        `shared_embeddings`: the embeddings are another model's (a drafter sharing its target's),
        kept as given, never copied. `dense_prefill`: int4 prompt rows on a dense copy of the
        weights where one pays (workers/models/quant.py), else on the int4 kernel."""
        cfg = weights.config
        if not supports(cfg):
            raise ValueError(f"FastLlama does not support {cfg.model_type} with this config")
        if quantized is not None and bfloat16:
            raise ValueError("the layer products are either int4 or bfloat16")
        sd = weights.tensors

        def own(name: str) -> torch.Tensor:
            # a copy for what is kept as it is: a tensor loaded from safetensors is a view of the
            # file's mapping, and one kept view keeps the whole file (every format's float32
            # weights) resident beside the copies the products made
            return sd[name].clone()

        # every row computed the same way whatever shares its forward (see invariant_min_queries)
        self.batch_invariant = quantized is not None or bfloat16
        self.device = sd["model.norm.weight"].device
        self.dtype = sd["model.norm.weight"].dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.group = self.num_heads // self.num_kv_heads  # query heads per key/value head
        # attention calls of the grouped layout (_grouped) have num_kv_heads heads
        self.min_queries = (invariant_min_queries(self.num_kv_heads, self.head_dim, self.dtype, self.device)
                            if self.batch_invariant else 1)
        self.key_span = (invariant_key_span(self.num_kv_heads, self.head_dim, self.dtype, self.device)
                         if self.batch_invariant else KeySpan())
        self.eps = cfg.rms_norm_eps

        def product(*names: str) -> Product:  # one product over the weights stacked
            if quantized is not None:
                return Int4Linear(Int4Weight.cat([quantized[n] for n in names]), "auto" if dense_prefill else "none")
            weight = torch.cat([sd[n] for n in names])
            return Bf16Linear(weight) if bfloat16 else Linear(weight)

        self.layers = [
            _Layer(
                input_norm=own(f"model.layers.{i}.input_layernorm.weight"),
                qkv=product(*(_ATTN.format(i, p) for p in "qkv")),
                o=product(_ATTN.format(i, "o")),
                post_norm=own(f"model.layers.{i}.post_attention_layernorm.weight"),
                gate_up=product(_MLP.format(i, "gate"), _MLP.format(i, "up")),
                down=product(_MLP.format(i, "down")),
            )
            for i in range(cfg.num_hidden_layers)
        ]
        # whether prompt rows compute as scored rows do, in every product (a dense copy exists per shape)
        self.prompt_rows_as_scored = not any(isinstance(p, Int4Linear) and p.dense is not None for layer in self.layers
                                             for p in (layer.qkv, layer.o, layer.gate_up, layer.down))
        embed_key = "model.embed_tokens.weight"
        self.embed = sd[embed_key] if shared_embeddings else own(embed_key)  # [vocab, hidden]
        self.final_norm = own("model.norm.weight")
        tied = "lm_head.weight" not in sd or sd["lm_head.weight"].data_ptr() == sd[embed_key].data_ptr()
        head = self.embed if tied else own("lm_head.weight")
        if head_rows is not None:
            head = head[head_rows.to(head.device)]
        # with int4 layers the head takes their dense format: fbgemm's float16 calls compute a row
        # alike at any row count, where float32's kernel plan changes the last bits with the rows
        # (so batched and alone logits would differ); its logits float32
        head_format = "bfloat16" if bfloat16 else dense_format(self.device) if quantized is not None else "none"
        self.lm_head: Linear | Bf16Linear | Fp16Linear = (
            Bf16Linear(head) if head_format == "bfloat16"
            else (head_format == "float16" and Fp16Linear.of(head, out_dtype=torch.float32)) or Linear(head))
        # what a feature drafter multiplies by in float32: the head's own transposed copy, or a
        # view of the float weights (the embeddings themselves where the model ties them)
        self.head_t = self.lm_head.w_t if isinstance(self.lm_head, Linear) else head.t()
        self.info = ModelInfo(
            vocab_size=self.embed.shape[0],
            hidden_size=cfg.hidden_size,
            max_position=cfg.max_position_embeddings,
            eos_token_ids=eos_token_ids,
            kv_bytes_per_token=2 * len(self.layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize,
        )
        inv_freq, scale = weights.inv_freq, weights.attention_scaling
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, device=self.device).float(), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)  # [max_position, head_dim]
        self.cos = (emb.cos() * scale).to(self.dtype)
        # rotate_half(x) * sin == x.roll(d / 2) * [-sin, sin]: one op instead of three
        half = self.head_dim // 2
        self.sin_signed = (torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1) * scale).to(self.dtype)

    def view(self) -> TargetView:
        """The tensors a feature drafter computes with (EAGLE, Medusa), shared with this model."""
        return TargetView(self.info, self.embed, self.cos, self.sin_signed, self.head_t)

    def new_cache(self, capacity: int) -> StaticKVCache:
        capacity = self._cache_capacity(capacity)
        return StaticKVCache.empty(len(self.layers), self.num_kv_heads, capacity, self.head_dim, self.dtype,
                                   self.device, zeroed=self.batch_invariant)

    def new_pool(self, num_slots: int, capacity: int) -> KVPool:
        capacity = self._cache_capacity(capacity)
        return KVPool(len(self.layers), num_slots, self.num_kv_heads, capacity, self.head_dim, self.dtype, self.device)

    def _cache_capacity(self, capacity: int) -> int:
        if capacity > self.info.max_position:
            raise ValueError(f"cache capacity {capacity} exceeds the model's {self.info.max_position} positions")
        if self.batch_invariant:  # room for any call's keys (see KeySpan)
            capacity = min(_whole_blocks(capacity), self.info.max_position)
        return capacity

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: StaticKVCache,
        *,
        last_only: bool = False,
        return_hidden: bool = False,
        tree: DraftTree | None = None,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> ForwardOutput:
        """`tree`: the inputs are a step's root and the nodes of a draft tree (workers/tree.py):
        each sits at the position of its depth and sees the cache and its own ancestors.
        `positions` [n] and `mask` [n, cache.length + n] place the inputs and say which keys each
        sees in general (a drafter growing a tree level by level); default: causal after the cache."""
        n = input_ids.shape[0]
        start, end = cache.length, cache.length + n
        if end > cache.capacity:
            raise ValueError(f"{end} positions exceed the cache capacity {cache.capacity}")
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        paths = None
        if tree is not None:
            if len(tree) + 1 != n:
                raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} inputs, got {n}")
            positions = start + tree.input_offsets(self.device)
            paths = _TreeAttention.of(tree, start, self, cache.capacity) if self.batch_invariant else None
            if paths is None:
                mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device),
                                  tree.input_mask(self.device)], dim=1)
        if positions is not None:
            cos, sin = self.cos[positions, None], self.sin_signed[positions, None]
        else:
            cos, sin = self.cos[start:end, None], self.sin_signed[start:end, None]  # [n, 1, d]
        if paths is not None:

            def attend_paths(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                cache.k[i, :, start:end] = k.transpose(0, 1)
                cache.v[i, :, start:end] = v.transpose(0, 1)
                return paths.attend(q, k, v, cache.k[i], cache.v[i])

            return self._finish(input_ids, cache, cos, sin, attend_paths, last_only, return_hidden)
        # new token i may see keys 0 .. start + i: plain causal on an empty cache (SDPA's fast
        # path), an explicit mask when a draft follows cached tokens, none for a single token;
        # a row-invariant model always masks explicitly (see invariant_min_queries)
        if mask is None and (self.batch_invariant or (n > 1 and start > 0)):
            mask = torch.arange(end, device=self.device) <= torch.arange(start, end, device=self.device)[:, None]
        if self.batch_invariant:
            return self._forward_invariant(input_ids, cache, cos, sin, mask, last_only, return_hidden)
        causal = n > 1 and mask is None

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, start:end] = k.transpose(0, 1)
            cache.v[i, :, start:end] = v.transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                q[None].transpose(1, 2), cache.k[i, None, :, :end], cache.v[i, None, :, :end],
                attn_mask=mask, is_causal=causal, enable_gqa=nkv != nh,
            )  # [1, nh, n, d]
            return attn[0].transpose(0, 1).reshape(n, nh * d)

        return self._finish(input_ids, cache, cos, sin, attend, last_only, return_hidden)

    def _forward_invariant(
        self, input_ids: torch.Tensor, cache: StaticKVCache, cos: torch.Tensor, sin: torch.Tensor,
        mask: torch.Tensor, last_only: bool, return_hidden: bool,
    ) -> ForwardOutput:
        """`forward` computing every row as it would be computed alone, in a chain or in a batch:
        the grouped layout, keys cut as `key_span` says (zeros past the end, masked) and query
        blocks of >= min_queries rows (see invariant_min_queries, _query_blocks_invariant)."""
        n, start = input_ids.shape[0], cache.length
        end = start + n
        keys = min(self.key_span.keys(end), cache.capacity)
        rows = self.group * n
        pad = _invariant_rows(rows, self.min_queries) - rows
        mask = _additive(F.pad(mask, (0, keys - end)), self.dtype).repeat_interleave(self.group, 0)  # [rows, keys]
        mask = torch.cat([mask, mask[-1:].expand(pad, -1)])

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.k[i, :, start:end] = k.transpose(0, 1)
            cache.v[i, :, start:end] = v.transpose(0, 1)
            q = _grouped(q[None], self.num_kv_heads)  # [1, nkv, rows, d]
            if pad:  # repeat the last query; the extra rows are dropped below
                q = torch.cat([q, q[:, :, -1:].expand(-1, -1, pad, -1)], dim=2)
            attn = F.scaled_dot_product_attention(
                q, cache.k[i, None, :, :keys], cache.v[i, None, :, :keys], attn_mask=mask)
            return _ungrouped(attn[:, :, :rows], n).reshape(n, -1)

        return self._finish(input_ids, cache, cos, sin, attend, last_only, return_hidden)

    def _finish(
        self, input_ids: torch.Tensor, cache: StaticKVCache, cos: torch.Tensor, sin: torch.Tensor,
        attend: _Attend, last_only: bool, return_hidden: bool,
    ) -> ForwardOutput:
        """The layers over one sequence's inputs with `attend`, then the logits asked for."""
        n = input_ids.shape[0]
        # a prompt's prefill (last_only) only fills the cache; every other row is scored
        x = self._layers(self.embed[input_ids], cos, sin, attend, 0 if last_only else n)
        cache.extend(n)

        if return_hidden:  # every position's hidden state; logits still only where asked
            hidden = F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps)
            return ForwardOutput(logits=self.lm_head(hidden[-1:] if last_only else hidden).float(), hidden=hidden)
        h = F.rms_norm(x[-1:] if last_only else x, x.shape[-1:], self.final_norm, self.eps)
        return ForwardOutput(logits=self.lm_head(h).float())

    def _layers(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: _Attend, num_scored: int,
    ) -> torch.Tensor:
        """The decoder layers over x [n, hidden]; `attend(layer, q, k, v)` stores the new keys and
        values and returns the attention output [n, heads * head_dim]. The first `num_scored`
        rows are ones whose logits are read, the rest only fill the cache (prompt prefill):
        quantized products compute the two kinds differently (workers/models/quant.py)."""
        n, a = x.shape[0], num_scored
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        # a quantized product returns its compute dtype: the float32 ops after it (rotary,
        # residual, the cache's copy) take it as it is, one conversion fewer each
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, x.shape[-1:], layer.input_norm, self.eps)
            qkv = layer.qkv(h, a).view(n, nh + 2 * nkv, d)
            # rotate q and k heads in one go: x * cos + rotate_half(x) * sin
            qk = qkv[:, : nh + nkv]
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
            x = x + layer.o(attend(i, qk[:, :nh], qk[:, nh:], qkv[:, nh + nkv :].to(x.dtype)), a)
            h = F.rms_norm(x, x.shape[-1:], layer.post_norm, self.eps)
            gate, up = layer.gate_up(h, a).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate.to(x.dtype)) * up, a)
        return x

    @torch.inference_mode()
    def forward_batch(self, batch: Sequence[SeqInput], *, return_hidden: bool = False) -> list[ForwardOutput]:
        """Several sequences in one forward: every weight is read once for all their rows.

        The sequences' caches are slots of one KVPool. Their inputs are packed into one [N] row
        block for the products. Attention reads each sequence's keys in place: sequences of
        similar shape share one call over their slot range, queries padded to the call's
        longest and masked to their own keys (causal, or the draft tree's ancestry)
        (`_attention_groups`, `_BatchAttention`). A batch of one runs `forward` (the same numerics as alone).
        Sequences computed as scored rows (decode and verify steps) are packed first."""
        if len(batch) == 1:
            return forward_each(self, batch, return_hidden)
        order = sorted(range(len(batch)), key=lambda b: not batch[b].scored_rows)  # stable
        if order != list(range(len(batch))):
            outputs = self.forward_batch([batch[b] for b in order], return_hidden=return_hidden)
            return [out for _, out in sorted(zip(order, outputs), key=lambda pair: pair[0])]
        pool = batch[0].cache.pool
        slots = [s.cache.slot for s in batch]
        if pool is None or any(s.cache.pool is not pool for s in batch) or len(set(slots)) != len(slots):
            raise ValueError("a batched forward needs every sequence in its own slot of one KVPool")
        nh, d = self.num_heads, self.head_dim
        lens = [s.input_ids.shape[0] for s in batch]
        if any(s.cache.length + n > pool.capacity for s, n in zip(batch, lens)):
            raise ValueError(f"a sequence exceeds the cache capacity {pool.capacity}")
        bounds = [0, *itertools.accumulate(lens)]
        dev = self.device
        # per packed row: its slot, its storage position, its rotary position
        row_slot = torch.tensor([s.cache.slot for s, n in zip(batch, lens) for _ in range(n)], device=dev)
        store = torch.cat([torch.arange(s.cache.length, s.cache.length + n) for s, n in zip(batch, lens)]).to(dev)
        rope = torch.cat([s.cache.length + (s.tree.input_offsets() if s.tree is not None else torch.arange(n))
                          for s, n in zip(batch, lens)]).to(dev)
        cos, sin = self.cos[rope, None], self.sin_signed[rope, None]  # [N, 1, d]
        key_span = self.key_span if self.batch_invariant else None
        calls = [_AttnGroup.of([batch[b] for b in members], dev, self.dtype, self.group, self.min_queries, key_span,
                               pool.capacity)
                 for members in _attention_groups(batch, self.group, self.min_queries, key_span)]
        attention = _BatchAttention.of(batch, calls, nh, self.group, d, self.dtype, dev)
        # a draft tree's rows computed again as its root paths' chains (see _TreeAttention)
        trees = [(a, b, s.cache.slot, paths) for s, a, b in zip(batch, bounds, bounds[1:])
                 if self.batch_invariant
                 and (paths := _TreeAttention.of(s.tree, s.cache.length, self, pool.capacity)) is not None]

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            pool.k[i, row_slot, :, store] = k  # [N, nkv, d] into (slot, position) pairs
            pool.v[i, row_slot, :, store] = v
            out = attention.attend(q, pool.k[i], pool.v[i])
            for a, b, slot, paths in trees:
                out[a:b] = paths.attend(q[a:b], k[a:b], v[a:b], pool.k[i, slot], pool.v[i, slot])
            return out

        ids = torch.cat([s.input_ids for s in batch]).to(dev)
        num_scored = sum(n for s, n in zip(batch, lens) if s.scored_rows)
        x = self._layers(self.embed[ids], cos, sin, attend, num_scored)
        for s, n in zip(batch, lens):
            s.cache.extend(n)

        hidden = F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps)
        wanted = [range(a, b) if s.logits == "all" else range(b - 1, b) if s.logits == "last" else range(0)
                  for s, a, b in zip(batch, bounds, bounds[1:])]
        rows = torch.tensor([r for w in wanted for r in w], dtype=torch.long, device=dev)
        logits = self.lm_head(hidden[rows]).float().split([len(w) for w in wanted])
        return [ForwardOutput(logits=lg, hidden=hidden[a:b] if return_hidden else None)
                for lg, a, b in zip(logits, bounds, bounds[1:])]


_Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Grouped-query attention as attention over the key/value heads: the queries of the `group` heads
# that share a key/value head become rows of one head's call, query by query (row j * group + g:
# query j of that head's g-th query head). SDPA then reads each key once per key/value head
# instead of once per query head, and a one-token step already has `group` query rows
# (invariant_min_queries): 55 us a layer against 130 for a decode step over 512 keys (SmolLM2:
# 9 heads over 3). A query's rows sit at the same places whatever follows them, as the row
# invariance needs.
def _grouped(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[b, n, heads, d] -> [b, num_kv_heads, n * group, d]."""
    b, n, nh, d = q.shape
    return q.view(b, n, num_kv_heads, nh // num_kv_heads, d).transpose(1, 2).reshape(b, num_kv_heads, -1, d)


def _ungrouped(attn: torch.Tensor, n: int) -> torch.Tensor:
    """[b, num_kv_heads, n * group, d] -> [b, n, heads, d]."""
    b, nkv, rows, d = attn.shape
    return attn.view(b, nkv, n, rows // n, d).transpose(1, 2).reshape(b, n, -1, d)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as the one SDPA would make of it (0 or -inf in the queries' dtype,
    which GPU kernels require), made once per forward rather than in every layer's call."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))

# CPU SDPA computes a query row bit for bit the same whatever the call's other rows, batch and
# masked key padding, when the mask is explicit, the call has enough query rows (its products take
# other kernels below a row count that depends on the CPU: 3 on one machine, 4 on another; see
# invariant_min_queries) and its keys are cut the same way (see KeySpan): torch 2.13,
# tests/test_quant.py. The quantized path relies on it: rounding each product's input to bfloat16
# would turn attention's float32 rounding differences into ~0.5-logit ones.
_INVARIANT_KEY_BLOCK = 512  # SDPA sums a row's scores over blocks of this many keys
_MIN_QUERY_CANDIDATES = (3, 4, 6, 8, 12, 16)
_SPLIT_QUERIES = 32  # SDPA splits a call's queries into blocks of this many (below 192 rows)


@functools.cache
def invariant_min_queries(num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> int:
    """The fewest query rows from which this machine's SDPA computes every row the same at any
    row count (up to one query block): probed once per shape, on random data, in milliseconds."""
    gen = torch.Generator().manual_seed(0)
    keys = 2 * _INVARIANT_KEY_BLOCK
    q, k, v = (torch.randn(1, num_heads, n, head_dim, generator=gen).to(device, dtype)
               for n in (_SPLIT_QUERIES, keys, keys))
    mask = torch.ones(_SPLIT_QUERIES, keys, dtype=torch.bool, device=device)
    mask[:, keys - 100 :] = False  # masked padding keys, as the model's calls have

    def rows(n: int, m: int) -> torch.Tensor:
        return F.scaled_dot_product_attention(q[:, :, :n], k, v, attn_mask=mask[:n])[:, :, :m]

    for m in _MIN_QUERY_CANDIDATES:
        first = rows(m, m)
        if all(torch.equal(rows(n, m), first) for n in range(m + 1, _SPLIT_QUERIES + 1)):
            return m
    log.warning("SDPA rows differ with the call's row count up to %d rows: quantized outputs may differ "
                "from plain decoding's beyond ties", _MIN_QUERY_CANDIDATES[-1])
    return _MIN_QUERY_CANDIDATES[-1]


def _query_blocks_invariant(rows: int, min_queries: int) -> bool:
    """Whether every query block SDPA splits a call of `rows` query rows into holds min_queries
    rows or more: blocks of 32 rows below 192 (64 below 768, else 256; torch 2.13), and a short
    last block takes other kernels, as a short call does (33 rows: the 33rd row's logits 0.25
    off its own). Calls are padded up to the next count that passes."""
    split = _SPLIT_QUERIES if rows < 192 else 64 if rows < 768 else 256
    return rows >= min_queries and not 0 < rows % split < min_queries


def _whole_blocks(end: int) -> int:
    return -(-end // _INVARIANT_KEY_BLOCK) * _INVARIANT_KEY_BLOCK


@dataclass(frozen=True)
class KeySpan:
    """How many keys a row-invariant attention call reads for `end` visible ones. SDPA cuts a
    call's keys into blocks of 512 from the first, and a row's result depends on the length of
    the block its visible keys end in, not on masked keys past them, as long as that block is
    whole or a multiple of `granule` keys no longer than `limit` (torch 2.13 on an AVX-512 Xeon:
    16 and 256; between 257 and 511 keys the product with the values splits its sum differently).
    So a call reads its longest member's keys rounded up to such a block: a 100-token context
    reads 112 keys where whole blocks would read 512, and every row of the call, whatever its
    own length, comes out as it would alone. Probed per machine (`invariant_key_span`); the
    default, granule = limit = 512, reads whole blocks (where no finer cut holds)."""

    granule: int = _INVARIANT_KEY_BLOCK
    limit: int = _INVARIANT_KEY_BLOCK

    def keys(self, end: int) -> int:
        whole, rest = divmod(end, _INVARIANT_KEY_BLOCK)
        if rest > self.limit:
            return (whole + 1) * _INVARIANT_KEY_BLOCK
        return whole * _INVARIANT_KEY_BLOCK + -(-rest // self.granule) * self.granule


_KEY_SPAN_CANDIDATES = tuple((g, limit) for limit in (256, 128, 64) for g in (8, 16, 32, 64) if g <= limit)


@functools.cache
def invariant_key_span(num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> KeySpan:
    """The finest cut of a call's keys (KeySpan) from which this machine's SDPA computes every row
    as it does over whole blocks: every last block a cut allows, first or second, with rows seeing
    all of it, part of it and a single key of it, against the same rows over whole blocks;
    probed once per shape, on random data, in milliseconds."""
    gen = torch.Generator().manual_seed(0)
    block = _INVARIANT_KEY_BLOCK
    q, k, v = (torch.randn(1, num_heads, n, head_dim, generator=gen).to(device, dtype)
               for n in (6, 2 * block, 2 * block))

    def rows(keys: int, visible: list[int]) -> torch.Tensor:
        mask = torch.arange(keys, device=device) < torch.tensor(visible, device=device)[:, None]
        return F.scaled_dot_product_attention(q[:, :, : len(visible)], k[:, :, :keys], v[:, :, :keys],
                                              attn_mask=_additive(mask, dtype))

    def holds(granule: int, limit: int) -> bool:
        for last in range(granule, limit + 1, granule):
            for before in (0, block):
                visible = [before + n for n in (last, last - granule + 1, last // 2 + 1, 1, last, last - 1)]
                if not torch.equal(rows(before + last, visible), rows(before + block, visible)):
                    return False
        return True

    for granule, limit in _KEY_SPAN_CANDIDATES:
        if holds(granule, limit):
            return KeySpan(granule, limit)
    return KeySpan()

# The price of one attention call of a batched forward, per layer (2-core AMD EPYC, Zen 5, float32
# keys): ~37 ns a slot and key, plus ~4.5 ns for each grouped query row computed over them, plus a
# fixed ~60 us a call: SDPA's own ~8 us and its output's copy, and the threads a small call leaves
# idle (a slot's 3 key/value heads split unevenly over 2). 60 was the fastest or within 2% of a
# sweep of 15-200 us on replayed batches, on that EPYC and on an AMX Xeon (docs/benchmarks.md).
_CALL_US = 60.0
_SLOT_KEY_NS = 37.0
_SLOT_KEY_ROW_NS = 4.5


@functools.cache
def _invariant_rows(rows: int, min_queries: int) -> int:
    """The fewest query rows >= `rows` a call may compute every row of as alone (padding rows added)."""
    return next(r for r in itertools.count(rows) if _query_blocks_invariant(r, min_queries))


def _attention_groups(
    batch: Sequence[SeqInput], group: int, min_queries: int = 1, key_span: KeySpan | None = None,
) -> list[list[int]]:
    """The batch's sequences (indices) split into runs of neighbouring slots, one attention call
    each: a call costs its slot range x its longest keys (cut as `key_span` says, if given) x its
    longest grouped query rows (padded to `min_queries` as _AttnGroup pads them) plus a fixed cost,
    and the split minimising the sum is found exactly (B <= a few dozen). Decode steps of similar
    lengths share a call; a drafting sequence's extra query rows or one much longer context get a
    call of their own where the others' padding would cost more than the call."""
    order = sorted(range(len(batch)), key=lambda b: batch[b].cache.slot)
    slot = [batch[b].cache.slot for b in order]
    keys = [batch[b].cache.length + batch[b].input_ids.shape[0] for b in order]
    if key_span is not None:
        keys = [key_span.keys(n) for n in keys]
    inputs = [batch[b].input_ids.shape[0] for b in order]
    best, cut = [0.0] * (len(order) + 1), [0] * (len(order) + 1)
    for end in range(1, len(order) + 1):
        best[end] = math.inf
        longest_keys = most_inputs = 0  # over start..end-1, widened as start walks down
        for start in range(end - 1, -1, -1):
            longest_keys, most_inputs = max(longest_keys, keys[start]), max(most_inputs, inputs[start])
            rows = _invariant_rows(group * most_inputs, min_queries)
            slot_keys = (slot[end - 1] - slot[start] + 1) * longest_keys
            cost = best[start] + _CALL_US + slot_keys * (_SLOT_KEY_NS + _SLOT_KEY_ROW_NS * rows) * 1e-3
            if cost <= best[end]:  # equal costs: the earliest start, the fewest calls
                best[end], cut[end] = cost, start
    groups, end = [], len(order)
    while end:
        groups.append(order[cut[end] : end])
        end = cut[end]
    return groups[::-1]


@dataclass
class _AttnGroup:
    """One attention call of a batched forward: pool slots lo..hi-1, each with the grouped query
    rows of its inputs (_grouped) padded to `num_rows`."""

    lo: int
    hi: int
    l_max: int  # keys per slot, padded
    num_rows: int  # grouped query rows per slot: the longest member's inputs x group, padded (_query_blocks_invariant)
    mask: torch.Tensor  # [slots, 1, num_rows, l_max] additive: the keys each grouped query row sees

    @classmethod
    def of(
        cls, members: list[SeqInput], device: torch.device, dtype: torch.dtype, group: int,
        min_queries: int = 1,
        key_span: KeySpan | None = None,
        max_keys: int | None = None,
    ) -> _AttnGroup:
        """`dtype`: the queries'. `group`: query heads per key/value head (the grouped layout,
        _grouped). `min_queries`: the fewest query rows per slot and head of the grouped layout in
        any query block (_query_blocks_invariant); `key_span` given: keys padded as it says, up to
        `max_keys` (the pool's capacity), so that every row is computed as it would be alone."""
        lo = min(s.cache.slot for s in members)
        hi = max(s.cache.slot for s in members) + 1
        n_max = max(s.input_ids.shape[0] for s in members)
        l_max = max(s.cache.length + s.input_ids.shape[0] for s in members)
        # padded in grouped rows, not in inputs: where min_queries is 4, a decode step's 3 rows
        # (SmolLM2: 3 query heads a key/value head) take one padding row, not a padding input's 3
        num_rows = _invariant_rows(n_max * group, min_queries)
        if key_span is not None:
            l_max = min(key_span.keys(l_max), max_keys or l_max)
        # key p is visible to query j of a sequence starting at `start`: p < start, or within its
        # own inputs by the causal / tree rule; padding rows see key 0 only (no empty softmax)
        mask = torch.zeros(hi - lo, n_max, l_max, dtype=torch.bool)
        mask[:, :, 0] = True
        for s in members:
            n, row, start = s.input_ids.shape[0], s.cache.slot - lo, s.cache.length
            mask[row, :n, :start] = True
            if s.tree is not None:
                if len(s.tree) + 1 != n:
                    raise ValueError(f"a tree of {len(s.tree)} nodes needs {len(s.tree) + 1} inputs, got {n}")
                mask[row, :n, start : start + n] = s.tree.input_mask()
            else:
                mask[row, :n, start : start + n] = torch.ones(n, n, dtype=torch.bool).tril()
        pad = torch.zeros(hi - lo, num_rows - n_max * group, l_max, dtype=torch.bool)
        pad[:, :, 0] = True
        grouped = torch.cat([mask.repeat_interleave(group, 1), pad], dim=1)  # [slots, num_rows, l_max]
        return cls(lo, hi, l_max, num_rows, _additive(grouped[:, None].to(device), dtype))


@dataclass(frozen=True)
class _KeyMoves:
    """Cache places (absolute) and the step inputs whose keys and values go there."""

    places: torch.Tensor  # [j]
    inputs: torch.Tensor  # [j]

    @classmethod
    def of(cls, start: int, moves: list[tuple[int, int]], device: torch.device) -> _KeyMoves | None:
        if not moves:
            return None
        return cls(torch.tensor([start + p for p, _ in moves], device=device),
                   torch.tensor([i for _, i in moves], device=device))

    def apply(self, cache: torch.Tensor, new: torch.Tensor) -> None:
        """cache [kv_heads, capacity, d]; new [kv_heads, n, d]: the step's keys (or values)."""
        cache.index_copy_(1, self.places, new.index_select(1, self.inputs))


@dataclass(frozen=True)
class _PathCall:
    """One root path's attention call (_TreeAttention): the keys and values the cache's tree
    order holds elsewhere are moved to where a chain of the path's inputs has them, and the rows
    the call computes see the keys such a chain's rows see. Queries are gathered straight into
    the grouped layout (_grouped), padding rows repeating the last."""

    moves: _KeyMoves | None
    query_inputs: torch.Tensor  # [kv_heads, rows]: each grouped query row's input ...
    query_heads: torch.Tensor  # ... and query head
    keys: int  # keys read, cut as the model's KeySpan says
    mask: torch.Tensor  # [rows, keys] additive


@dataclass(frozen=True)
class _TreeAttention:
    """A draft tree's attention on a row-invariant model, each node computed bit for bit as plain
    decoding computes it after its ancestors. In one call over the tree a node's ancestors sit at
    other key places than a chain's, and SDPA's sums run in another order (bfloat16 products
    magnify that to ~0.25 logits). So each root path (DraftTree.root_paths) gets a call of its
    own, after moving its inputs' keys and values to where a chain of them has them; the tree's
    own order is restored last, for the step's `keep`. The products (most of a step) are shared;
    each path past the first costs ~3 ms a step (SmolLM2's 30 layers after 300 tokens, a 2-core
    AVX2 EPYC: a 10-node tree of 4 paths in 69 ms, 11 rows in a chain 61)."""

    calls: list[_PathCall]
    restore: _KeyMoves | None

    @classmethod
    def of(cls, tree: DraftTree | None, start: int, model: FastLlama, capacity: int) -> _TreeAttention | None:
        """None where one call computes every row as alone already: no tree, or a chain."""
        if tree is None or tree.leading_chain == len(tree):
            return None
        group, dev = model.group, model.device
        held = list(range(len(tree) + 1))  # the input whose keys each place after `start` holds
        calls = []
        for path in tree.root_paths():
            moves = [(p, i) for p, i in enumerate(path.inputs) if held[p] != i]
            for p, i in moves:
                held[p] = i
            m, computed = len(path.inputs), path.inputs[path.first :]
            keys = min(model.key_span.keys(start + m), capacity)
            rows = _invariant_rows(group * len(computed), model.min_queries)
            # grouped row t of key/value head h: query t // group of the path's computed inputs,
            # query head h * group + t % group; padding rows repeat the last
            t = torch.arange(rows).clamp(max=group * len(computed) - 1)
            query_inputs = torch.tensor(computed)[t // group].expand(model.num_kv_heads, -1)
            query_heads = torch.arange(model.num_kv_heads)[:, None] * group + t % group
            visible = torch.arange(keys) < start + 1 + path.first + t[:, None] // group  # causal along the path
            calls.append(_PathCall(_KeyMoves.of(start, moves, dev), query_inputs.to(dev), query_heads.to(dev), keys,
                                   _additive(visible, model.dtype).to(dev)))
        restore = [(p, p) for p, i in enumerate(held) if i != p]
        return cls(calls, _KeyMoves.of(start, restore, dev))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> torch.Tensor:
        """q [n, heads, d], k and v [n, kv_heads, d] -> [n, heads * d]; k_cache, v_cache: the
        sequence's layer, [kv_heads, capacity, d], holding the step's keys and values in the
        tree's order."""
        k, v = k.transpose(0, 1), v.transpose(0, 1)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for c in self.calls:
            if c.moves is not None:
                c.moves.apply(k_cache, k)
                c.moves.apply(v_cache, v)
            attn = F.scaled_dot_product_attention(q[c.query_inputs, c.query_heads][None], k_cache[None, :, : c.keys],
                                                  v_cache[None, :, : c.keys], attn_mask=c.mask)
            out[c.query_inputs, c.query_heads] = attn[0]  # a padding row writes its last row's values again
        if self.restore is not None:
            self.restore.apply(k_cache, k)
            self.restore.apply(v_cache, v)
        return out.view(q.shape[0], -1)


@dataclass
class _BatchAttention:
    """A batched forward's attention, its calls planned once for all layers. The queries of every
    layer go, in one gather, to their slot's rows of a buffer in the grouped layout, [slots,
    num_kv_heads, rows, head_dim] with rows the most any call computes; each call reads a view of
    it (its slots, its padded rows), writes its output to the same place of a second buffer, and
    one gather takes every row back. Per call that leaves SDPA and one copy, where padding each
    call's own queries (zero-fill, gather, regroup, pad, ungroup, scatter) cost ~10 ops. Padding
    rows are zeros, never written, masked to key 0."""

    lo: int  # the first slot
    index: torch.Tensor  # [N * heads]: where each packed row's head sits in the flat buffer
    queries: torch.Tensor  # [slots, num_kv_heads, rows, head_dim]
    out: torch.Tensor  # the same shape
    calls: list[_AttnGroup]

    @classmethod
    def of(cls, batch: Sequence[SeqInput], calls: list[_AttnGroup], num_heads: int, group: int, head_dim: int,
           dtype: torch.dtype, device: torch.device) -> _BatchAttention:
        lo = min(c.lo for c in calls)
        num_kv_heads, rows = num_heads // group, max(c.num_rows for c in calls)
        slot = torch.tensor([s.cache.slot - lo for s in batch for _ in range(s.input_ids.shape[0])])
        step = torch.cat([torch.arange(s.input_ids.shape[0]) for s in batch])  # the row's input in its sequence
        head = torch.arange(num_heads)  # query head h is row h % group of key/value head h // group (_grouped)
        index = (slot[:, None] * num_kv_heads + head // group) * rows + step[:, None] * group + head % group
        shape = (max(c.hi for c in calls) - lo, num_kv_heads, rows, head_dim)
        return cls(lo, index.view(-1).to(device), torch.zeros(shape, dtype=dtype, device=device),
                   torch.empty(shape, dtype=dtype, device=device), calls)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, heads, head_dim] -> [N, heads * head_dim]; k, v: the layer's pool, [slots,
        num_kv_heads, positions, head_dim]."""
        d = q.shape[-1]
        self.queries.view(-1, d).index_copy_(0, self.index, q.reshape(-1, d))
        out = self.out
        for c in self.calls:
            a, b = c.lo - self.lo, c.hi - self.lo
            attn = F.scaled_dot_product_attention(self.queries[a:b, :, : c.num_rows], k[c.lo : c.hi, :, : c.l_max],
                                                  v[c.lo : c.hi, :, : c.l_max], attn_mask=c.mask)
            if len(self.calls) == 1:  # the call is the whole buffer
                out = attn
            else:
                out[a:b, :, : c.num_rows] = attn
        return out.view(-1, d).index_select(0, self.index).view(q.shape[0], -1)
