"""Medusa-1 heads: parallel draft heads on the target's last hidden state.

From the target's feature f_p at the newest position whose forward has run (p = len - 2: the
newest token, the one the target just emitted, has not been through it yet), head i proposes
token p + 2 + i through residual blocks x + SiLU(W x + b) and a vocabulary head. The heads run
together in one batched product, over every request of a batch at once (`propose_batch`); no
state is carried between steps.

Checkpoints use Medusa's layout, so heads trained elsewhere load as they are: `config.json`
(`medusa_num_heads`, `medusa_num_layers`) and `medusa_lm_head.safetensors` with keys
`{i}.{j}.linear.weight|bias` (block j of head i) and `{i}.{L}.weight` (its vocabulary head,
L = medusa_num_layers). SpecRoute's heads may leave out the per-head vocabulary heads and share
one instead: `lm_head.weight` [draft_vocab, hidden] with `draft_vocab` (token id per row), or
none at all (the target's lm_head). Safetensors only: a pickle can run code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from workers.drafters.base import Draft, DraftContext, DraftRequest, draft_tokens, token_ids_of
from workers.drafters.checkpoint import CheckpointError, missing_weights, read_config, write_config
from workers.sampling import log_probs
from workers.tree import grow_tree

WEIGHT_FILE = "medusa_lm_head.safetensors"


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # Medusa's init: each head starts as the identity

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int | None = None  # a shared reduced head; None: own heads or the target's
    per_head_vocab: bool = False  # Medusa's own layout: one full vocabulary head per head


class MedusaHeads(nn.Module):
    def __init__(self, cfg: MedusaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList(
            nn.Sequential(*[ResBlock(cfg.hidden_size) for _ in range(cfg.num_layers)],
                          *([nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)] if cfg.per_head_vocab else []))
            for _ in range(cfg.num_heads)
        )
        self.lm_head: nn.Linear | None = None
        if cfg.draft_vocab_size is not None:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("draft_vocab", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[..., h] -> [num_heads, ..., h] (shared head) or [num_heads, ..., vocab] (own heads)."""
        return torch.stack([head(features) for head in self.heads])

    def state_dict_medusa(self) -> dict[str, torch.Tensor]:
        """Medusa's key names: {i}.{j}... for the heads, shared head keys as they are."""
        out = {}
        for key, value in self.state_dict().items():
            out[key.removeprefix("heads.")] = value.detach().contiguous()
        return out

    def save(self, out_dir: str | Path, extra_config: dict[str, Any] | None = None) -> None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        save_file(self.state_dict_medusa(), str(out / WEIGHT_FILE))
        config = {"medusa_num_heads": self.cfg.num_heads, "medusa_num_layers": self.cfg.num_layers,
                  "hidden_size": self.cfg.hidden_size, "vocab_size": self.cfg.vocab_size,
                  "draft_vocab_size": self.cfg.draft_vocab_size, **(extra_config or {})}
        write_config(out, config)

    @classmethod
    def load(cls, path: str | Path, hidden_size: int, vocab_size: int) -> MedusaHeads:
        folder = Path(path)
        data = read_config(folder, "Medusa")
        if "medusa_num_heads" not in data:
            raise CheckpointError(f"{folder / 'config.json'} lacks medusa_num_heads")
        weights = folder / WEIGHT_FILE
        if not weights.is_file():
            raise missing_weights(weights)
        state = load_file(str(weights))
        num_heads, num_layers = int(data["medusa_num_heads"]), int(data.get("medusa_num_layers", 1))
        block = state.get("0.0.linear.weight")
        if block is None:
            raise CheckpointError(f"{weights}: no 0.0.linear.weight (not a Medusa head file)")
        if block.shape[1] != hidden_size:
            raise CheckpointError(f"{folder}: Medusa hidden size {block.shape[1]} does not match the target's "
                                  f"hidden size {hidden_size}")
        own = state.get(f"0.{num_layers}.weight")
        if own is not None and own.shape[0] != vocab_size:
            raise CheckpointError(f"{folder}: Medusa vocabulary size {own.shape[0]} does not match the target's "
                                  f"vocabulary size {vocab_size}")
        if own is None and data.get("vocab_size", vocab_size) != vocab_size:
            raise CheckpointError(f"{folder}: Medusa vocabulary size {data['vocab_size']} does not match the "
                                  f"target's vocabulary size {vocab_size}")
        shared = state.get("lm_head.weight")
        cfg = MedusaConfig(num_heads, num_layers, hidden_size, vocab_size,
                           draft_vocab_size=None if shared is None else shared.shape[0], per_head_vocab=own is not None)
        net = cls(cfg)
        missing, unexpected = net.load_state_dict({("heads." + k if k[0].isdigit() else k): v
                                                   for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{weights}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
        return net.eval()


class MedusaDrafter:
    needs_hidden_states: ClassVar[bool] = True
    cheap: ClassVar[bool] = False

    def __init__(self, config: Any, heads: MedusaHeads, vocab_size: int, target_head_t: torch.Tensor | None) -> None:
        """`target_head_t`: the target's output head ([h, vocab], TargetView.head_t), for heads
        that share it (no head of their own and no vocabulary per head)."""
        self.config = config
        self.name = config.name
        self.heads = heads
        self.vocab_size = vocab_size
        self.vocab_ids: torch.Tensor | None = None
        self.head_t: torch.Tensor | None = None  # [h, vocab'] when the heads share one
        if heads.lm_head is not None:
            self.head_t = heads.lm_head.weight.detach().t().contiguous()
            self.vocab_ids = heads.draft_vocab
        elif not heads.cfg.per_head_vocab:
            if target_head_t is None:
                raise ValueError("heads without their own vocabulary head need the target's")
            self.head_t = target_head_t

    def begin(self, ctx: DraftContext) -> None:
        return None

    @torch.inference_mode()
    def propose(self, state: None, ctx: DraftContext, k: int) -> Draft:
        return self.propose_batch([DraftRequest(state, ctx, k)])[0]

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Every request's heads in one product: the features of their newest run positions
        stacked [B, h], each request's tail (chain or tree, greedy or sampled) its own."""
        drafts: list[Draft | None] = [None] * len(requests)
        live: list[tuple[int, int]] = []  # (request, its newest run position)
        for b, r in enumerate(requests):
            if r.ctx.features is None:
                raise RuntimeError("the Medusa drafter needs the target's hidden states")
            p = len(r.ctx.token_ids) - 2  # the newest position the target has run
            if p < 0 or min(r.k, self.heads.cfg.num_heads) == 0:
                drafts[b] = Draft(torch.empty(0, dtype=torch.long, device=r.ctx.features.device))
            else:
                live.append((b, p))
        if live:
            features = torch.stack([requests[b].ctx.features[p] for b, p in live])  # [B, h]
            k_max = min(max(requests[b].k for b, _ in live), self.heads.cfg.num_heads)
            out = self.heads(features)[:k_max]  # [k, B, h] or [k, B, vocab]
            logits = out @ self.head_t if self.head_t is not None else out
            for i, (b, _) in enumerate(live):
                r = requests[b]
                drafts[b] = self._draft(logits[: min(r.k, k_max), i], r.ctx)
        return [d for d in drafts if d is not None]

    def _draft(self, logits: torch.Tensor, ctx: DraftContext) -> Draft:
        """A request's draft from its heads' logits [k, vocab'], head d for token p + 2 + d."""
        k = logits.shape[0]
        if (tree := ctx.tree_shape(self.config.tree)) is not None:
            # head d scores every node at depth d + 1, whatever its parent: Medusa's candidate tree
            lp = log_probs(logits, ctx.params)
            rows_list, shape = grow_tree(lp[0], lambda g, nodes: lp[[g.depth[n] for n in nodes]], k, tree.topk,
                                         tree.nodes)
            tree_rows = torch.tensor(rows_list, dtype=torch.long, device=logits.device)
            return Draft(token_ids_of(tree_rows, self.vocab_ids), tree=shape)
        tokens, probs = draft_tokens(logits, ctx, len(ctx.token_ids), self.vocab_ids, self.vocab_size)
        return Draft(tokens.to(torch.long), probs)

    def commit(self, state: None, ctx: DraftContext, num_new: int, num_accepted: int) -> None:
        pass

    def end(self, state: None) -> None:
        pass
