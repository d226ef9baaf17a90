"""Any transformers causal LM behind the CausalLM interface (DynamicCache; rollback = crop)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache

from workers.models.base import ForwardOutput, ModelInfo
from workers.tree import DraftTree

if TYPE_CHECKING:  # its import takes seconds; the model is loaded by then
    from transformers import PreTrainedModel


class HFKVCache:
    def __init__(self, model: PreTrainedModel, capacity: int) -> None:
        self.inner = DynamicCache(config=model.config)
        self._capacity = capacity

    @property
    def length(self) -> int:
        return self.inner.get_seq_length()

    @property
    def capacity(self) -> int:
        return self._capacity

    def truncate(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        if length < self.length:
            self.inner.crop(length - self.length)  # transformers 5: a negative count removes tokens


class HFCausalLM:
    supports_tree = False  # draft trees need SpecRoute's fast Llama (workers/models/llama.py)
    batch_invariant = False
    prompt_rows_as_scored = True

    def __init__(self, hf_model: PreTrainedModel, eos_token_ids: frozenset[int]) -> None:
        self.model = hf_model.eval()
        self.device = next(hf_model.parameters()).device
        cfg = hf_model.config
        self.info = ModelInfo(
            vocab_size=hf_model.get_output_embeddings().weight.shape[0],
            hidden_size=cfg.hidden_size,
            max_position=getattr(cfg, "max_position_embeddings", 1 << 20),
            eos_token_ids=eos_token_ids,
            kv_bytes_per_token=_kv_bytes_per_token(cfg, next(hf_model.parameters()).dtype),
        )

    def new_cache(self, capacity: int) -> HFKVCache:
        return HFKVCache(self.model, capacity)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        cache: HFKVCache,
        *,
        last_only: bool = False,
        return_hidden: bool = False,
        tree: DraftTree | None = None,
    ) -> ForwardOutput:
        if tree is not None:
            raise NotImplementedError("draft trees need the fast Llama backend")
        n = input_ids.shape[0]
        if cache.length + n > cache.capacity:
            raise ValueError(f"{cache.length + n} positions exceed the cache capacity {cache.capacity}")
        out = self.model(
            input_ids[None],
            cache=cache.inner,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
            output_hidden_states=return_hidden,
        )
        hidden = None
        if return_hidden:
            hidden = out.hidden_states[-1][0]  # every position, as FastLlama
        return ForwardOutput(logits=out.logits[0].float(), hidden=hidden)


def _kv_bytes_per_token(cfg: object, dtype: torch.dtype) -> int:
    """Keys and values of one position for a standard decoder config; 0 where it does not say."""
    layers, heads = getattr(cfg, "num_hidden_layers", None), getattr(cfg, "num_attention_heads", None)
    if not layers or not heads:
        return 0
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads  # type: ignore[attr-defined]
    return 2 * layers * kv_heads * head_dim * dtype.itemsize
