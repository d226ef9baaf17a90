"""The EAGLE-1 drafter kind (`specroute train-drafter --kind eagle`): a one-layer head trained on the
target's features.

Objective (EAGLE-1, Li et al. 2024): for pairs (f_t, x_{t+1}) predict f_{t+1}, teacher forced:
  loss = SmoothL1(pred, f_{t+1}) + w_cls * CE(p_target(f_{t+1}), p_draft(pred))
where p_target is the target's lm_head on the true next feature and p_draft the draft head on the
predicted one, both over the draft vocabulary (w_cls = 0.1 as in the paper). The input features
get uniform noise U(-noise, noise) (the paper's U(-0.1, 0.1)) so the head learns to draft from
its own slightly-off predicted features. `unroll > 1` adds the training-time test of HASS /
EAGLE-3: draft steps 2..unroll are trained too, each fed the head's own predicted feature of the
step before (detached) and attending as drafting does (`unrolled_predictions`), with the same loss
summed over the steps. It aims at what EAGLE-1 leaves weak: the second and later draft tokens.

Initialization (so training starts from a sane point, not noise):
  * fc = [0 | I], bias 0: the layer's input starts as the feature itself;
  * the decoder layer copies the target's LAST decoder layer where it reads (q/k/v, gate/up, the
    post-attention norm; EAGLE's layer has no input norm, so the target's is dropped) but its
    branches' output projections (o_proj, down_proj) start at zero: the layer starts as the identity,
    pred = f_t, and learns the step to f_{t+1} as residuals. (Copying o/down too adds the last
    layer's large outputs to a stream of another scale: on SmolLM2-135M the held-out loss starts at
    ~99 instead of ~1.5, worse than a random layer's ~2.)
  * the reduced head copies the target's lm_head rows of the draft vocabulary and stays FROZEN
    by default: the regression then aims at exactly the space the target's head reads, and the
    head cannot drift from the target's (`--train-head` unfreezes it).

The noise comes from a generator reseeded from (seed, step) at every step, so, like the data
order (training/loop.py), it is a function of the step and a resumed run repeats the
uninterrupted one exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from training.args import MIN_LR_RATIO, TrainArgs, TrainError
from training.data import Window, draft_head_t
from training.features import FeatureSet
from training.output import data_section, last_entry, mat_section, run_lines, save_net, training_summary, windows_line
from training.trainer import DrafterKind, train
from workers.drafters.checkpoint import CheckpointError
from workers.drafters.eagle import EagleConfig, EagleNet
from workers.models.llama import FastLlama
from workers.target import LoadedModel

FORMAT = "specroute-eagle-train/1"
BETAS = (0.9, 0.95)  # EAGLE's AdamW betas
INIT_TEXT = {
    "target": "fc = [0 | I] and zero o_proj/down_proj (the layer starts as the identity: pred = f_t); q/k/v, "
              "gate/up and the post-attention norm from the target's last layer",
    "random": "torch's default initialization of fc and the decoder layer (seeded)",
}
INITS = tuple(INIT_TEXT)


def init_text(init: str) -> str:
    """The card's line for --init: a named scheme, or a checkpoint folder fine-tuned from."""
    return INIT_TEXT.get(init, f"fc and the decoder layer from the EAGLE checkpoint `{init}` (fine-tuned from it); "
                               "the head from this run's draft vocabulary")


def unroll_text(unroll: int) -> str:
    if unroll == 1:
        return "One draft step per position (EAGLE-1; `--unroll 1`)."
    return (f"Draft steps 1..{unroll} per position (`--unroll {unroll}`, the training-time test): step j is fed "
            "step j-1's predicted feature and attends as drafting does; the loss is summed over the steps.")


@dataclass(frozen=True, kw_only=True)
class EagleTrainArgs(TrainArgs):
    w_cls: float = 0.1
    noise: float = 0.1  # half-width of the uniform noise on input features
    unroll: int = 1  # draft steps trained per position (1: EAGLE-1; more: the training-time test)
    train_head: bool = False
    init: str = "target"  # "target": identity layer reading with the target's last layer; "random": torch's
    # init; else an EAGLE checkpoint folder to fine-tune from (its fc and layer; the head is this run's)
    # EAGLE's defaults of the shared settings
    batch: int = 8
    seq_len: int = 256
    lr: float = 1e-4
    grad_clip: float = 0.5
    eval_windows: int = 64

    def check(self) -> None:
        super().check()
        if self.chunk_len < 2:
            raise TrainError("--chunk-len must be at least 2 (one pair)")
        if self.noise < 0 or self.w_cls < 0:
            raise TrainError("--noise and --w-cls must be non-negative")
        if self.unroll < 1:
            raise TrainError(f"--unroll must be at least 1 (EAGLE-1's single step), got {self.unroll}")
        if self.init not in INITS and not (Path(self.init) / "config.json").is_file():
            raise TrainError(f"--init must be one of {', '.join(INITS)} or an EAGLE checkpoint folder; "
                             f"no {Path(self.init) / 'config.json'}")


def noise_seed(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step) % (2**63)


# -- model ------------------------------------------------------------------------------------------
def eagle_config_for(model: FastLlama, draft_vocab_size: int | None) -> EagleConfig:
    hidden = model.info.hidden_size
    if model.head_dim * model.num_heads != hidden:
        raise TrainError(f"the target's head_dim {model.head_dim} x {model.num_heads} heads is not its hidden size "
                         f"{hidden}; the EAGLE layer assumes head_dim = hidden / heads")
    return EagleConfig(
        hidden_size=hidden, num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads,
        intermediate_size=model.layers[-1].down.w_t.shape[0], vocab_size=model.info.vocab_size,
        rms_norm_eps=model.eps, bias=True, draft_vocab_size=draft_vocab_size,
    )


@torch.no_grad()
def init_from_target(net: EagleNet, model: FastLlama, vocab: torch.Tensor | None) -> None:
    """fc = [0 | I] and zero output projections (the first forward passes f_t through); q/k/v,
    gate/up and the post-attention norm from the target's last layer; the head = the target's rows."""
    cfg = net.cfg
    h, nq, nkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    net.fc.weight.zero_()
    net.fc.weight[:, h:] = torch.eye(h)
    if net.fc.bias is not None:
        net.fc.bias.zero_()
    last, layer = model.layers[-1], net.layers[0]
    qkv = last.qkv.w_t.t().float()  # Linear keeps W^T: [in, out]
    layer.self_attn.q_proj.weight.copy_(qkv[:nq])
    layer.self_attn.k_proj.weight.copy_(qkv[nq : nq + nkv])
    layer.self_attn.v_proj.weight.copy_(qkv[nq + nkv :])
    gate, up = last.gate_up.w_t.t().float().chunk(2, dim=0)
    layer.mlp.gate_proj.weight.copy_(gate)
    layer.mlp.up_proj.weight.copy_(up)
    layer.post_attention_layernorm.weight.copy_(last.post_norm)
    # the branches' output projections start at zero: the target's own o/down write into a residual
    # stream of another scale (on SmolLM2 a verbatim copy starts at loss ~99 against ~1.5 for this)
    layer.self_attn.o_proj.weight.zero_()
    layer.mlp.down_proj.weight.zero_()
    init_head(net, model, vocab)


@torch.no_grad()
def init_head(net: EagleNet, model: FastLlama, vocab: torch.Tensor | None) -> None:
    """The reduced head: the target's lm_head rows of the draft vocabulary."""
    if net.lm_head is not None:
        assert vocab is not None
        net.lm_head.weight.copy_(draft_head_t(model, vocab).t())
        net.draft_vocab.copy_(vocab)


@torch.no_grad()
def init_from_checkpoint(net: EagleNet, path: str, model: FastLlama) -> None:
    """fc and the decoder layer from a trained EAGLE checkpoint (checked against the target's sizes);
    the head stays this run's (its draft vocabulary may differ from the checkpoint's)."""
    try:
        source = EagleNet.load(path, model.info.hidden_size, model.info.vocab_size)
    except CheckpointError as e:
        raise TrainError(f"--init: {e}") from None
    state = {k: v.float() for k, v in source.state_dict().items() if not k.startswith(("lm_head", "draft_vocab"))}
    current = net.state_dict()
    own = {k for k in current if not k.startswith(("lm_head", "draft_vocab"))}
    if state.keys() != own or any(state[k].shape != current[k].shape for k in own):
        raise TrainError(f"--init {path}: its fc and layer do not have this target's EAGLE shapes "
                         f"(missing {sorted(own - state.keys())}, unexpected {sorted(state.keys() - own)})")
    net.load_state_dict(state, strict=False)  # the head is this run's


# -- data -------------------------------------------------------------------------------------------
@dataclass
class Batch:
    inputs: torch.Tensor  # [B, T, h] f_t
    next_ids: torch.Tensor  # [B, T] x_{t+1}
    targets: torch.Tensor  # [B, T, h] f_{t+1}
    mask: torch.Tensor  # [B, T] bool: a real pair (windows shorter than T are padded at the end)


def gather(fs: FeatureSet, windows: list[tuple[int, int]], device: torch.device) -> Batch:
    t = max(n for _, n in windows)
    offsets = torch.arange(t + 1)
    idx = torch.stack([first + offsets.clamp(max=n) for first, n in windows])  # padding repeats a valid row
    feats = fs.features[idx].to(device=device, dtype=torch.float32)  # [B, T + 1, h]
    mask = torch.stack([offsets[:t] < n for _, n in windows]).to(device)
    return Batch(feats[:, :-1], fs.ids[idx[:, 1:]].to(device), feats[:, 1:], mask)


# -- loss -------------------------------------------------------------------------------------------
@dataclass
class TargetParts:
    """What the loss borrows from the target (never trained)."""

    embed: torch.Tensor  # [vocab, h], the target's dtype
    head_t: torch.Tensor  # [h, V] float32: the target's lm_head over the draft vocabulary
    cos: torch.Tensor  # [seq_len, d] float32
    sin: torch.Tensor  # [seq_len, d] float32, signed form


def unroll_mask(t: int, step: int, device: torch.device | None = None) -> torch.Tensor:
    """The keys the queries of draft step `step` (1-based) see, as in drafting: [t, step * t] bool over
    the keys of steps 1..step side by side. Query s of step j continues the draft that began after the
    true pair s - j + 1: it sees the true pairs 0 .. s - j + 1 (step 1's keys) and, of each step
    2 <= i <= j, the one key at s - j + i (that draft's earlier fed-back pairs, itself last)."""
    s = torch.arange(t, device=device)[:, None]
    r = torch.arange(t, device=device)[None, :]
    return torch.cat([r <= s - step + 1] + [r == s - step + i for i in range(2, step + 1)], dim=1)


def unrolled_predictions(net: EagleNet, embeds: torch.Tensor, feats: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Predicted features [B, T, h] of draft steps 1..steps at every position, in parallel (the
    training-time test of HASS / EAGLE-3). Step 1 is EAGLE-1's teacher-forced pass on (f_s, x_{s+1});
    step j at s reads step j-1's prediction of f_s (made at s - 1, detached) with the true x_{s+1}, and
    attends as drafting does (`unroll_mask`): so the layer learns to draft from its own features."""
    layer = net.layers[0]  # EAGLE-1: one decoder layer
    t = feats.shape[1]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    preds: list[torch.Tensor] = []
    inputs = feats
    for j in range(1, steps + 1):
        if j > 1:
            prev = preds[-1].detach()
            inputs = torch.cat((torch.zeros_like(prev[:, :1]), prev[:, :-1]), dim=1)
        x = net.fc(torch.cat((embeds, inputs), dim=-1))
        q, k, v = layer.qkv(x, cos, sin)
        keys.append(k)
        values.append(v)
        if j == 1:
            out = layer.attend(q, k, v, causal=t > 1)
        else:
            out = layer.attend(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), unroll_mask(t, j, x.device))
        preds.append(layer.finish(x, out))
    return preds


def eagle_loss(
    net: EagleNet, parts: TargetParts, batch: Batch, w_cls: float, noise: float = 0.0,
    generator: torch.Generator | None = None, unroll: int = 1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The objective: SmoothL1 + w_cls * CE summed over draft steps 1..unroll. Stats: `loss`, `reg`,
    `cls`, `top1` of step 1 (EAGLE-1's, comparable across runs) and `top1_j` of each later step."""
    feats = batch.inputs
    if noise > 0:
        u = torch.rand(feats.shape, generator=generator, device=feats.device, dtype=feats.dtype)
        feats = feats + (2 * u - 1) * noise
    t = feats.shape[1]
    preds = unrolled_predictions(net, parts.embed[batch.next_ids].float(), feats, parts.cos[:t], parts.sin[:t],
                                 unroll)
    draft_head_t = net.lm_head.weight.t() if net.lm_head is not None else parts.head_t
    objective = feats.new_zeros(())
    stats: dict[str, float] = {}
    for j, pred_j in enumerate(preds, 1):
        mask = batch.mask.clone()
        mask[:, : j - 1] = False  # step j at s continues a draft that began at s - j + 1 >= 0
        pred, target = pred_j[mask], batch.targets[mask]  # [M, h]
        reg = F.smooth_l1_loss(pred, target, reduction="none").mean(-1).mean()
        with torch.no_grad():
            p = torch.softmax(target @ parts.head_t, dim=-1)  # the target's distribution over the draft vocab
        logits = pred @ draft_head_t
        cls = -(p * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
        objective = objective + reg + w_cls * cls
        with torch.no_grad():
            acc = (logits.argmax(-1) == p.argmax(-1)).float().mean().item()
        if j == 1:
            stats |= {"loss": (reg + w_cls * cls).item(), "reg": reg.item(), "cls": cls.item(), "top1": acc,
                      "n": pred.shape[0]}
        else:
            stats[f"top1_{j}"] = acc
    return objective, stats


# -- the kind ---------------------------------------------------------------------------------------
EVAL_STEPS = 2  # held-out agreement is reported for draft steps 1 and 2 at least (what k = 2 drafts)


class EagleKind(DrafterKind[EagleTrainArgs]):
    name = "eagle"
    format = FORMAT
    betas = BETAS
    reads = "EAGLE trains on"
    count = "pairs"
    record_lr = True
    net: EagleNet
    parts: TargetParts
    vocab: torch.Tensor | None
    generator: torch.Generator

    def prepare(self, loaded: LoadedModel) -> None:
        if self.args.chunk_len > loaded.model.info.max_position:
            raise TrainError(f"--chunk-len {self.args.chunk_len} exceeds the target's "
                             f"{loaded.model.info.max_position} positions")

    def build(self, model: FastLlama, fs: FeatureSet, vocab: torch.Tensor | None
              ) -> tuple[EagleNet, list[torch.nn.Parameter]]:
        args, device = self.args, self.device
        net = EagleNet(eagle_config_for(model, None if vocab is None else len(vocab)))
        if args.init == "target":
            init_from_target(net, model, vocab)
        else:
            init_head(net, model, vocab)
            if args.init != "random":
                init_from_checkpoint(net, args.init, model)
        net.to(device)
        if net.lm_head is not None:
            net.lm_head.weight.requires_grad_(args.train_head)
        max_t = min(args.seq_len, int((fs.bounds[1:] - fs.bounds[:-1]).max()) - 1)  # the longest window
        view = model.view()
        self.parts = TargetParts(
            embed=view.embed.to(device), head_t=draft_head_t(model, vocab).to(device=device, dtype=torch.float32),
            cos=view.cos[:max_t].to(device=device, dtype=torch.float32),
            sin=view.sin[:max_t].to(device=device, dtype=torch.float32),
        )
        self.net, self.vocab, self.generator = net.train(), vocab, torch.Generator(device=device)
        return net, [p for p in net.parameters() if p.requires_grad]

    def annotate(self, record: dict[str, Any]) -> None:
        record["draft_vocab"]["head"] = ("the target's own lm_head" if self.vocab is None
                                         else "trainable" if self.args.train_head else "frozen")

    def loss(self, fs: FeatureSet, windows: list[Window], step: int) -> tuple[torch.Tensor, dict[str, float]]:
        args = self.args
        self.generator.manual_seed(noise_seed(args.seed, step))
        return eagle_loss(self.net, self.parts, gather(fs, windows, self.device), args.w_cls, args.noise,
                          self.generator, args.unroll)

    def scores(self, fs: FeatureSet, windows: list[Window]) -> dict[str, float]:
        """Step-1 loss terms and top-1 agreement (draft argmax == target argmax), no noise, and the
        agreement of later draft steps fed the head's own features. Later steps' counts differ by a
        position per window from step 1's "n": negligible in the average."""
        return eagle_loss(self.net, self.parts, gather(fs, windows, self.device), self.args.w_cls,
                          unroll=max(self.args.unroll, EVAL_STEPS))[1]

    def report(self, train: dict[str, float] | None, scores: dict[str, float] | None) -> str:
        return (", ".join(f"{k} {v:.4f}" for k, v in (train or {}).items())
                + (f"; held out loss {scores['loss']:.4f} top1 {scores['top1']:.4f}" if scores else ""))

    def summary(self, record: dict[str, Any]) -> dict[str, Any]:
        return training_summary(record, self.args, train_final=True)

    def save(self, out: Path, summary: dict[str, Any]) -> None:
        """The EAGLE layout: config.json + model.safetensors."""
        save_net(out, self.net, summary, self.args.save_dtype)

    def card(self, record: dict[str, Any]) -> str:
        return render_card(record, self.args, self.net.cfg)


def train_eagle(args: EagleTrainArgs, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train (or resume) an EAGLE-1 head under args.out; returns the training record."""
    return train(args, EagleKind, log)


def _fmt_eval(ev: dict[str, float] | None) -> str:
    if not ev:
        return "n/a"
    later = "".join(f", draft step {k.removeprefix('top1_')} {v:.4f}" for k, v in ev.items() if k.startswith("top1_"))
    return (f"loss {ev['loss']:.4f} (SmoothL1 {ev['reg']:.4f}, CE {ev['cls']:.4f}), top-1 agreement {ev['top1']:.4f}"
            + (f" (fed its own features:{later[1:]})" if later else ""))


def render_card(record: dict[str, Any], args: EagleTrainArgs, cfg: EagleConfig) -> str:
    corpus, vocab, last = record["corpus"], record["draft_vocab"], last_entry(record)
    features = (f"in {corpus.get('extract_s')} s ({corpus.get('extract_tokens_per_s')} tokens/s on "
                f"{corpus.get('extract_device')})")
    params = sum(p.numel() for n, p in EagleNet(cfg).named_parameters() if not n.startswith("lm_head"))
    return f"""# EAGLE-1 drafter for `{args.target}`

A one-layer EAGLE-1 head that drafts from the target's final-norm hidden states. Load it with

```yaml
drafters:
  - {{kind: eagle, name: eagle, path: {args.out}, draft_len: 4}}
```

{run_lines(record, args, features)}
- Parameters: {params:,} (fc + decoder layer) + the draft head {vocab['size']} x {cfg.hidden_size} ({vocab['head']})

{data_section(record)}

{corpus['chunks']} chunks of at most {args.chunk_len} tokens, teacher forced through the target (no
generation). {windows_line(record, args, "pairs")}

## Draft vocabulary

{vocab['size']} token ids (`draft_vocab`; the most frequent in the corpus, the target's end-of-sequence
tokens first); they cover **{vocab['coverage']:.2%}** of the corpus tokens. Head: the target's lm_head rows
for them, {vocab['head']}.

## Objective and settings

EAGLE-1: SmoothL1(predicted f_t+1, f_t+1) + {args.w_cls} x cross-entropy(target's distribution on the
true feature, head's distribution on the predicted one), over the draft vocabulary; input features get
uniform noise U(-{args.noise}, {args.noise}). {unroll_text(args.unroll)}
AdamW (betas {BETAS}, weight decay {args.weight_decay}), lr {args.lr} with {args.warmup_steps()} warmup steps
and cosine decay to {MIN_LR_RATIO} x lr at {args.steps} steps, gradient clipping {args.grad_clip}, batch
{args.batch} x {args.seq_len}, seed {args.seed}.
Initialization (`--init {args.init}`): {init_text(args.init)}.

## Results (held-out windows)

- Before training: {_fmt_eval(record.get('eval_initial'))}
- After step {record['step']}: {_fmt_eval(last.get('eval'))}
- Last training average: {_fmt_eval(last.get('train')) if last.get('train') else 'n/a'}

{mat_section("To be filled in by `specroute bench` (draft_len and the number of prompts per category in the "
             "columns).")}"""
