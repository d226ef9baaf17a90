"""EAGLE-1 feature drafter: one decoder layer that autoregresses on the target's features.

Input at position t is fc(concat(embed(x_{t+1}), f_t)): the target's final hidden state at t and
the token that followed it (the token shifted one step, which settles the feature's
uncertainty). The layer predicts f_{t+1}; the target's lm_head (here, optionally, its rows for
a reduced draft vocabulary, as EAGLE-3 and FR-Spec do) turns that into the next token. Drafting
feeds its own predicted features back for k tokens.

Checkpoints use the official EAGLE layout, so heads trained elsewhere load as they are:
`config.json` (Llama fields: hidden_size, num_attention_heads, num_key_value_heads,
intermediate_size, rms_norm_eps, vocab_size, bias) and weights under `fc.*`, `layers.0.self_attn.*`,
`layers.0.mlp.*`, `layers.0.post_attention_layernorm.weight` (layer 0 has no input norm). SpecRoute's
additions, both optional: `lm_head.weight` [draft_vocab, hidden] with `draft_vocab` (the token id
of each row). Weights load from safetensors only: a pickle can run code.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from workers.drafters.base import Draft, DraftContext, DraftRequest, draft_tokens, token_ids_of
from workers.drafters.checkpoint import CheckpointError, missing_weights, read_config, write_config
from workers.models.base import TargetView
from workers.sampling import log_probs
from workers.tree import TreeGrowth, grow_tree

WEIGHT_FILES = ("model.safetensors", "pytorch_model.safetensors")


@dataclass(frozen=True)
class EagleConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary
    rms_norm_eps: float = 1e-5
    bias: bool = True  # fc has a bias (EAGLE-1's default)
    draft_vocab_size: int | None = None  # rows of the reduced lm_head; None: the target's lm_head

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EagleConfig:
        required = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [f for f in required if f not in data]
        if missing:
            raise CheckpointError(f"config.json lacks {', '.join(missing)}")
        return cls(
            hidden_size=int(data["hidden_size"]), num_attention_heads=int(data["num_attention_heads"]),
            num_key_value_heads=int(data.get("num_key_value_heads", data["num_attention_heads"])),
            intermediate_size=int(data["intermediate_size"]), vocab_size=int(data["vocab_size"]),
            rms_norm_eps=float(data.get("rms_norm_eps", 1e-5)), bias=bool(data.get("bias", True)),
            draft_vocab_size=data.get("draft_vocab_size"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"architectures": ["EagleLlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
                "hidden_act": "silu", **asdict(self)}


class EagleLayer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE-1's layer 0)."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.self_attn = nn.Module()
        self.self_attn.q_proj = nn.Linear(h, nh * d, bias=False)
        self.self_attn.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.self_attn.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.self_attn.o_proj = nn.Linear(nh * d, h, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.mlp.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated queries [B, nh, T, d], keys and values [B, nkv, T, d] of x [B, T, h]; cos, sin:
        [T, d] (sin signed for the roll form of rotate_half)."""
        b, t, _ = x.shape
        a = self.self_attn
        q = a.q_proj(x).view(b, t, self.nh, self.d).transpose(1, 2)
        k = a.k_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        v = a.v_proj(x).view(b, t, self.nkv, self.d).transpose(1, 2)
        return q * cos + q.roll(self.d // 2, dims=-1) * sin, k * cos + k.roll(self.d // 2, dims=-1) * sin, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
               causal: bool = False) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=self.nkv != self.nh)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention output attn [B, nh, T, d] and the MLP."""
        b, t, _ = x.shape
        x = x + self.self_attn.o_proj(attn.transpose(1, 2).reshape(b, t, self.nh * self.d))
        m = self.mlp
        h = self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: EagleCache | None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [B, T, h]; cos, sin: [T, d]; mask: [T, cached + T] what each new row sees (a draft
        tree's), else causal."""
        t = x.shape[1]
        q, k, v = self.qkv(x, cos, sin)
        causal = t > 1 and mask is None
        if cache is not None:  # batch 1: append, attend over everything cached
            start = cache.length
            k, v = cache.append(k[0], v[0])
            k, v = k[None], v[None]
            if start > 0 and causal:
                end = start + t
                mask = torch.arange(end, device=x.device) <= torch.arange(start, end, device=x.device)[:, None]
                causal = False
        return self.finish(x, self.attend(q, k, v, mask, causal))

    def forward_packed(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       caches: Sequence[EagleCache], lengths: Sequence[int]) -> torch.Tensor:
        """Several sequences' new rows packed in one block, x [1, N, h] (lengths[i] rows of
        sequence i, in order), cos, sin [N, d] at each row's position: the products run once for
        all rows; each sequence's rows attend, causally, over its own cache."""
        q, k, v = self.qkv(x, cos, sin)
        attn, start = [], 0
        for cache, n in zip(caches, lengths):
            rows, past = slice(start, start + n), cache.length
            keys, values = cache.append(k[0, :, rows], v[0, :, rows])
            mask = None
            if n > 1 and past:  # causal over the new rows, after everything cached
                mask = torch.arange(past + n, device=x.device) <= torch.arange(past, past + n, device=x.device)[:, None]
            attn.append(self.attend(q[:, :, rows], keys[None], values[None], mask, causal=n > 1 and not past))
            start += n
        return self.finish(x, torch.cat(attn, dim=2))


@dataclass
class EagleCache:
    k: torch.Tensor  # [nkv, capacity, d]
    v: torch.Tensor
    length: int = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        if end > self.k.shape[1]:  # a draft tree's rows past the request's end: grow
            more = end - self.k.shape[1] + 64
            self.k = torch.cat([self.k, self.k.new_empty(self.k.shape[0], more, self.k.shape[2])], dim=1)
            self.v = torch.cat([self.v, self.v.new_empty(self.v.shape[0], more, self.v.shape[2])], dim=1)
        self.k[:, self.length : end] = k
        self.v[:, self.length : end] = v
        self.length = end
        return self.k[:, :end], self.v[:, :end]


class EagleNet(nn.Module):
    """fc + one decoder layer (+ an optional reduced-vocabulary head). Shared by training and
    drafting; the target's embeddings and lm_head are passed in, never owned."""

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.bias)
        self.layers = nn.ModuleList([EagleLayer(cfg)])
        self.lm_head: nn.Linear | None = None
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("draft_vocab", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def forward(
        self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        cache: EagleCache | None = None, mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predicted next features [B, T, h] from embed(x_{t+1}) and f_t, both [B, T, h]."""
        x = self.fc(torch.cat((embeds, features), dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin, cache, mask)
        return x

    def forward_packed(self, embeds: torch.Tensor, features: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       caches: Sequence[EagleCache], lengths: Sequence[int]) -> torch.Tensor:
        """Pairs of several sequences packed in one block (embeds, features [N, h]; cos, sin [N, d];
        lengths[i] rows of sequence i, in order), appended to each one's cache: predicted next
        features [N, h]."""
        x = self.fc(torch.cat((embeds, features), dim=-1))[None]
        for layer in self.layers:
            x = layer.forward_packed(x, cos, sin, caches, lengths)
        return x[0]

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, out_dir: str | Path, extra_config: dict[str, Any] | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / WEIGHT_FILES[0]))
        write_config(out, {**self.cfg.to_json(), **(extra_config or {})})

    @classmethod
    def load(cls, path: str | Path, hidden_size: int, vocab_size: int) -> EagleNet:
        """A checkpoint folder in the EAGLE layout, checked against the target's sizes."""
        folder = Path(path)
        cfg = EagleConfig.from_json(read_config(folder, "EAGLE"))
        if cfg.hidden_size != hidden_size:
            raise CheckpointError(f"{folder}: EAGLE hidden size {cfg.hidden_size} does not match the target's "
                                  f"hidden size {hidden_size}")
        if cfg.vocab_size != vocab_size:
            raise CheckpointError(f"{folder}: EAGLE vocabulary size {cfg.vocab_size} does not match the target's "
                                  f"vocabulary size {vocab_size}")
        weights = next((folder / name for name in WEIGHT_FILES if (folder / name).is_file()), None)
        if weights is None:
            raise missing_weights(folder / WEIGHT_FILES[0])
        state = load_file(str(weights))
        state.pop("embed_tokens.weight", None)  # official checkpoints may carry the target's embeddings
        net = cls(cfg)
        missing, unexpected = net.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{weights}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        return net.eval()


@dataclass
class EagleState:
    cache: EagleCache
    num_pairs: int = 0  # (f_t, x_{t+1}) pairs with true features in the cache: t < num_pairs
    last_feature: torch.Tensor | None = None  # predicted feature of the newest token
    tokens: list[int] = field(default_factory=list)


class EagleDrafter:
    """Drafts with an EagleNet over a FastLlama target's embeddings, lm_head and rope tables."""

    needs_hidden_states: ClassVar[bool] = True
    cheap: ClassVar[bool] = False

    def __init__(self, config: Any, net: EagleNet, target: TargetView) -> None:
        self.config = config
        self.name = config.name
        self.net = net
        self.embed = target.embed  # [vocab, h]
        self.cos, self.sin = target.cos, target.sin  # [max_position, d]
        if net.lm_head is not None:
            self.head_t = net.lm_head.weight.detach().t().contiguous()  # [h, draft_vocab]
            self.vocab_ids = net.draft_vocab
        else:
            self.head_t = target.head_t  # [h, vocab]
            self.vocab_ids = None
        self.vocab_size = target.info.vocab_size

    def begin(self, ctx: DraftContext) -> EagleState:
        cfg = self.net.cfg
        shape = (cfg.num_key_value_heads, ctx.max_len, cfg.head_dim)
        dtype, device = self.embed.dtype, self.embed.device
        return EagleState(EagleCache(torch.empty(shape, dtype=dtype, device=device),
                                     torch.empty(shape, dtype=dtype, device=device)))

    @torch.inference_mode()
    def propose(self, state: EagleState, ctx: DraftContext, k: int) -> Draft:
        if ctx.tree_shape(self.config.tree) is None:
            return self.propose_batch([DraftRequest(state, ctx, k)])[0]
        feature = self._catch_up([DraftRequest(state, ctx, k)])[0]
        if feature is None:  # a one-token prompt: no feature yet to draft from
            return self._draft([], [])
        return self._propose_tree(state, ctx, feature, k)

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Chains: one forward catches every request up on its pairs, then each draft position
        runs the layer once for all the requests still drafting (one row each, over its own
        cache). Trees propose request by request."""
        if any(r.ctx.tree_shape(self.config.tree) is not None for r in requests):
            return [self.propose(r.state, r.ctx, r.k) for r in requests]
        features = self._catch_up(requests)
        drafted: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        rows = [b for b, f in enumerate(features) if f is not None and requests[b].k > 0]
        i = 0
        while rows:
            logits = torch.stack([features[b] for b in rows]) @ self.head_t  # [B, draft_vocab]
            fed = []
            for b, row in zip(rows, logits):
                ctx = requests[b].ctx
                tokens, p = draft_tokens(row[None], ctx, len(ctx.token_ids) + i, self.vocab_ids, self.vocab_size)
                token = int(tokens[0])
                drafted[b].append(token)
                if p is not None:
                    probs[b].append(p)
                if i < requests[b].k - 1:  # feed (predicted feature, drafted token): the next feature
                    fed.append(b)
            if fed:
                device = self.embed.device
                out = self._feed([(requests[b].state, torch.tensor(drafted[b][-1:], device=device), features[b][None])
                                  for b in fed])
                for b, feature in zip(fed, out):
                    features[b] = feature
            rows, i = fed, i + 1
        return [self._draft(d, p) for d, p in zip(drafted, probs)]

    def _catch_up(self, requests: Sequence[DraftRequest]) -> list[torch.Tensor | None]:
        """Feed every request the true pairs of the tokens accepted since its last proposal, all
        in one forward: the predicted feature of each one's newest token (None before its first
        pair)."""
        pending = []
        for r in requests:
            if r.ctx.features is None:
                raise RuntimeError("the EAGLE drafter needs the target's hidden states")
            n_true = len(r.ctx.token_ids) - 1  # features are known for every token but the newest
            if n_true > r.state.num_pairs:  # pairs (f_t, x_{t+1}) for the tokens accepted since last time
                ids = torch.tensor(r.ctx.token_ids[r.state.num_pairs + 1 : n_true + 1], dtype=torch.long,
                                   device=self.embed.device)
                pending.append((r.state, ids, r.ctx.features[r.state.num_pairs : n_true]))
        if pending:
            for (state, ids, _), feature in zip(pending, self._feed(pending)):
                state.last_feature = feature
                state.num_pairs += ids.shape[0]
        return [r.state.last_feature for r in requests]

    def _feed(self, pairs: Sequence[tuple[EagleState, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        """Feed each state its pairs (token ids [n], features [n, h]) at its next cache positions,
        every state's in one packed forward: each state's last predicted feature."""
        lengths = [ids.shape[0] for _, ids, _ in pairs]
        positions = torch.cat([torch.arange(s.cache.length, s.cache.length + n)
                               for (s, _, _), n in zip(pairs, lengths)]).to(self.embed.device)
        out = self.net.forward_packed(
            self.embed[torch.cat([ids for _, ids, _ in pairs])], torch.cat([f for _, _, f in pairs]),
            self.cos[positions], self.sin[positions], [s.cache for s, _, _ in pairs], lengths,
        )
        return [out[end - 1] for end in itertools.accumulate(lengths)]

    @staticmethod
    def _draft(drafted: list[int], probs: list[torch.Tensor]) -> Draft:
        return Draft(torch.tensor(drafted, dtype=torch.long), torch.cat(probs) if probs else None)

    def _propose_tree(self, state: EagleState, ctx: DraftContext, root_feature: torch.Tensor, k: int) -> Draft:
        """A dynamic draft tree of depth k (workers/tree.py). Each expanded node runs the layer on
        (its parent's predicted feature, its token) at the position of its depth, seeing the
        true pairs and its own ancestors' rows in the cache, as a chain through it would."""
        cache, device = state.cache, self.embed.device
        feature_of: dict[int, torch.Tensor] = {-1: root_feature}  # expanded node -> predicted feature

        def expand(growth: TreeGrowth, nodes: list[int]) -> torch.Tensor:
            positions, mask = growth.level_inputs(nodes, state.num_pairs, cache.length, device)
            rows = torch.tensor([growth.row[n] for n in nodes], dtype=torch.long, device=device)
            tokens = token_ids_of(rows, self.vocab_ids)
            inputs = torch.stack([feature_of[growth.parent[n]] for n in nodes])
            out = self.net(self.embed[tokens][None], inputs[None], self.cos[positions], self.sin[positions],
                           cache, mask)[0]
            feature_of.update(zip(nodes, out))
            return log_probs(out @ self.head_t, ctx.params)

        tree = self.config.tree
        root = log_probs(root_feature[None] @ self.head_t, ctx.params)[0]
        rows, shape = grow_tree(root, expand, k, tree.topk, tree.nodes)
        token_ids = token_ids_of(torch.tensor(rows, dtype=torch.long, device=device), self.vocab_ids)
        return Draft(token_ids.cpu(), tree=shape)

    def commit(self, state: EagleState, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        # drafted pairs carried predicted features: drop them all; true ones are fed next time
        state.cache.length = state.num_pairs

    def end(self, state: EagleState) -> None:
        state.cache = None  # type: ignore[assignment]
