"""A static-cache Llama forward for batch-one speculative decoding (gpt-fast style).

Why not transformers' own forward: a verify step must cost little more than a plain step, so
  * the KV cache is preallocated once per request and rollback is moving an integer;
  * q/k/v and gate/up are fused into one product each;
  * the kernel is chosen by row count (`Linear`): a 1-2 row step streams a transposed,
    contiguous weight (`x @ W_t`), a verify step of 3+ rows uses MKL's packed GEMM.
Weights come from a loaded transformers model, so every checkpoint format it reads works here.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from workers.models.base import ForwardOutput, ModelInfo
from workers.tree import DraftTree

# rope types whose frequencies depend on the sequence length are left to transformers
_STATIC_ROPE_TYPES = {"default", "linear", "llama3", "yarn"}


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


class StaticKVCache:
    def __init__(
        self, num_layers: int, num_kv_heads: int, capacity: int, head_dim: int,
        dtype: torch.dtype, device: torch.device,
    ) -> None:
        shape = (num_layers, num_kv_heads, capacity, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)  # never read past length
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self._length = 0

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

    def keep(self, start: int, indices: list[int]) -> None:
        """Keep the entries at start + indices (ascending), moved to start, start + 1, ...: a draft
        tree's accepted path becomes the contiguous sequence a chain would have left."""
        src = torch.tensor(indices, device=self.k.device) + start
        end = start + len(indices)
        if end > self._length or (len(indices) and int(src[-1]) >= self._length):
            raise ValueError(f"cannot keep {indices} after {start} in a cache of length {self._length}")
        self.k[:, :, start:end] = self.k[:, :, src]
        self.v[:, :, start:end] = self.v[:, :, src]
        self._length = end


@dataclass
class _Layer:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # hidden -> (num_heads + 2 * num_kv_heads) * head_dim
    o: Linear  # num_heads * head_dim -> hidden
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden


# A product's best kernel depends on the machine and on the number of rows (1 for a decode step,
# 1 + k to verify a draft): MKL's packed GEMM wins on some Intel parts, oneDNN on AMD (measured
# 3x on the lm_head at 8 rows, docs/benchmarks.md), for one row a plain x @ W_t or oneDNN.
# So each weight shape is timed once per process on the kernels available, per row bucket.
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


@functools.cache
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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [n, in] -> [n, out]
        return self.run(self.plan[_bucket(x.shape[0])], x)


class FastLlama:
    supports_tree = True

    def __init__(
        self, hf_model: PreTrainedModel, eos_token_ids: frozenset[int], head_rows: torch.Tensor | None = None,
    ) -> None:
        """`head_rows`: token ids the lm_head computes logits for, in that order (a drafter's
        reduced vocabulary: logits column i is token head_rows[i]); None: the whole vocabulary."""
        cfg = hf_model.config
        if not supports(cfg):
            raise ValueError(f"FastLlama does not support {cfg.model_type} with this config")
        sd = {k: v.detach() for k, v in hf_model.state_dict().items()}
        self.device = next(hf_model.parameters()).device
        self.dtype = next(hf_model.parameters()).dtype
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.eps = cfg.rms_norm_eps
        self.layers = [
            _Layer(
                input_norm=sd[f"model.layers.{i}.input_layernorm.weight"],
                qkv=Linear(torch.cat([sd[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv"])),
                o=Linear(sd[f"model.layers.{i}.self_attn.o_proj.weight"]),
                post_norm=sd[f"model.layers.{i}.post_attention_layernorm.weight"],
                gate_up=Linear(torch.cat([sd[f"model.layers.{i}.mlp.{p}_proj.weight"] for p in ("gate", "up")])),
                down=Linear(sd[f"model.layers.{i}.mlp.down_proj.weight"]),
            )
            for i in range(cfg.num_hidden_layers)
        ]
        self.embed = sd["model.embed_tokens.weight"]  # [vocab, hidden]
        self.final_norm = sd["model.norm.weight"]
        head = sd.get("lm_head.weight", self.embed)
        self.lm_head = Linear(head if head_rows is None else head[head_rows.to(head.device)])
        self.info = ModelInfo(
            vocab_size=self.embed.shape[0],
            hidden_size=cfg.hidden_size,
            max_position=cfg.max_position_embeddings,
            eos_token_ids=eos_token_ids,
        )
        # the model's own rotary module computed the frequencies for its rope type
        rotary = hf_model.model.rotary_emb
        inv_freq, scale = rotary.inv_freq.float(), rotary.attention_scaling
        angles = torch.outer(torch.arange(cfg.max_position_embeddings, device=self.device).float(), inv_freq)
        emb = torch.cat((angles, angles), dim=-1)  # [max_position, head_dim]
        self.cos = (emb.cos() * scale).to(self.dtype)
        # rotate_half(x) * sin == x.roll(d / 2) * [-sin, sin]: one op instead of three
        half = self.head_dim // 2
        self.sin_signed = (torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1) * scale).to(self.dtype)

    def new_cache(self, capacity: int) -> StaticKVCache:
        if capacity > self.info.max_position:
            raise ValueError(f"cache capacity {capacity} exceeds the model's {self.info.max_position} positions")
        return StaticKVCache(
            len(self.layers), self.num_kv_heads, capacity, self.head_dim, self.dtype, self.device
        )

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
        if tree is not None:
            if len(tree) + 1 != n:
                raise ValueError(f"a tree of {len(tree)} nodes needs {len(tree) + 1} inputs, got {n}")
            positions = start + tree.input_offsets(self.device)
            mask = torch.cat([torch.ones(n, start, dtype=torch.bool, device=self.device),
                              tree.input_mask(self.device)], dim=1)
        if positions is not None:
            cos, sin = self.cos[positions, None], self.sin_signed[positions, None]
        else:
            cos, sin = self.cos[start:end, None], self.sin_signed[start:end, None]  # [n, 1, d]
        # new token i may see keys 0 .. start + i: plain causal on an empty cache (SDPA's fast
        # path), an explicit mask when a draft follows cached tokens, none for a single token
        if mask is None and n > 1 and start > 0:
            mask = torch.arange(end, device=self.device) <= torch.arange(start, end, device=self.device)[:, None]
        causal = n > 1 and mask is None

        x = self.embed[input_ids]  # [n, hidden]
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, x.shape[-1:], layer.input_norm, self.eps)
            qkv = layer.qkv(h).view(n, nh + 2 * nkv, d)
            # rotate q and k heads in one go: x * cos + rotate_half(x) * sin
            qk = qkv[:, : nh + nkv]
            qk = qk * cos + qk.roll(d // 2, dims=-1) * sin
            cache.k[i, :, start:end] = qk[:, nh:].transpose(0, 1)
            cache.v[i, :, start:end] = qkv[:, nh + nkv :].transpose(0, 1)
            attn = F.scaled_dot_product_attention(
                qk[None, :, :nh].transpose(1, 2), cache.k[i, None, :, :end], cache.v[i, None, :, :end],
                attn_mask=mask, is_causal=causal, enable_gqa=nkv != nh,
            )  # [1, nh, n, d]
            x = x + layer.o(attn[0].transpose(0, 1).reshape(n, nh * d))
            h = F.rms_norm(x, x.shape[-1:], layer.post_norm, self.eps)
            gate, up = layer.gate_up(h).chunk(2, dim=-1)
            x = x + layer.down(F.silu(gate) * up)
        cache._length = end

        if return_hidden:  # every position's hidden state; logits still only where asked
            hidden = F.rms_norm(x, x.shape[-1:], self.final_norm, self.eps)
            return ForwardOutput(logits=self.lm_head(hidden[-1:] if last_only else hidden).float(), hidden=hidden)
        h = F.rms_norm(x[-1:] if last_only else x, x.shape[-1:], self.final_norm, self.eps)
        return ForwardOutput(logits=self.lm_head(h).float())
