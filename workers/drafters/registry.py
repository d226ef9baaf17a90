"""Drafter kinds by name, built from their configs."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from workers.config import (
    DrafterConfig,
    EagleDrafterConfig,
    GrammarDrafterConfig,
    LookaheadDrafterConfig,
    MedusaDrafterConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    PredictionDrafterConfig,
    SuffixDrafterConfig,
)
from workers.drafters.base import Drafter
from workers.drafters.checkpoint import CheckpointError
from workers.drafters.eagle import EagleDrafter, EagleNet
from workers.drafters.grammar import GrammarDrafter
from workers.drafters.lookahead import LookaheadDrafter
from workers.drafters.medusa import MedusaDrafter, MedusaHeads
from workers.drafters.model import ModelDrafter
from workers.drafters.ngram import NgramDrafter
from workers.drafters.prediction import PredictionDrafter
from workers.drafters.remote import DraftService, RemoteDrafter
from workers.drafters.suffix import SuffixDrafter
from workers.models.base import CausalLM
from workers.models.cpu import cpu_bfloat16_pays
from workers.models.hf import HFCausalLM
from workers.models.llama import FastLlama
from workers.target import LoadedModel, ModelLoadError, load_model

log = logging.getLogger(__name__)


def input_embeddings(model: CausalLM) -> torch.Tensor:
    """A model's input embedding matrix [vocab, hidden] (what a distilled drafter shares)."""
    if isinstance(model, FastLlama):
        return model.embed
    assert isinstance(model, HFCausalLM)
    return model.model.get_input_embeddings().weight.detach()


def build_model_drafter(
    config: ModelDrafterConfig, vocab_size: int | None, embeddings: torch.Tensor | None, max_num_seqs: int = 1,
    max_model_len: int | None = None,
) -> ModelDrafter:
    """`vocab_size`: the target's (None: not checked here); `embeddings`: the target's, for a
    drafter that shares them (workers/target.py); `max_num_seqs`: requests drafting at once;
    `max_model_len`: the target's context limit, when configured (ModelDrafter).

    A drafter's dtype is a speed choice only (verification keeps the output the target's), so
    bfloat16 on a CPU that computes it far slower than float32 drafts in float32 instead."""
    if (config.model.dtype == "bfloat16" and torch.device(config.model.device).type == "cpu"
            and not cpu_bfloat16_pays()):
        log.warning("drafter %r: this CPU has no fast bfloat16 products; drafting in float32", config.name)
        config = config.model_copy(update={"model": config.model.model_copy(update={"dtype": "float32"})})
    try:
        loaded = load_model(config.model, embeddings)
    except ModelLoadError as e:
        raise ModelLoadError(f"drafter {config.name!r}: {e}") from None
    if config.tree is not None and not isinstance(loaded.model, FastLlama):
        raise ModelLoadError(f"drafter {config.name!r}: draft trees need the fast Llama backend for the drafter's "
                             "model (model.backend: fast or auto)")
    if vocab_size is not None and loaded.model.info.vocab_size != vocab_size:
        raise ModelLoadError(
            f"drafter {config.name!r}: vocabulary size {loaded.model.info.vocab_size} does not "
            f"match the target's {vocab_size}"
        )
    return ModelDrafter(config, loaded.model, loaded.draft_vocab, max_num_seqs, max_model_len)


def _build_eagle_drafter(config: EagleDrafterConfig, target: LoadedModel) -> EagleDrafter:
    model = target.model
    if not isinstance(model, FastLlama):
        raise ModelLoadError(f"drafter {config.name!r}: EAGLE drafts over the target's embeddings and rope tables, "
                             "which needs the fast Llama backend (target backend: fast or auto)")
    try:
        net = EagleNet.load(config.resolved_path(), model.info.hidden_size, model.info.vocab_size)
    except CheckpointError as e:
        raise ModelLoadError(f"drafter {config.name!r}: {e}") from None
    return EagleDrafter(config, net.to(device=model.device, dtype=model.dtype), model.view())


def _build_medusa_drafter(config: MedusaDrafterConfig, target: LoadedModel) -> MedusaDrafter:
    model = target.model
    try:
        heads = MedusaHeads.load(config.resolved_path(), model.info.hidden_size, model.info.vocab_size)
    except CheckpointError as e:
        raise ModelLoadError(f"drafter {config.name!r}: {e}") from None
    if heads.lm_head is None and not heads.cfg.per_head_vocab and not isinstance(model, FastLlama):
        raise ModelLoadError(f"drafter {config.name!r}: heads without their own vocabulary head use the target's "
                             "lm_head, which needs the fast Llama backend")
    head_t = model.view().head_t if isinstance(model, FastLlama) else None
    return MedusaDrafter(config, heads.to(device=model.device, dtype=getattr(model, "dtype", torch.float32)),
                         model.info.vocab_size, head_t)


def build_drafter(
    config: DrafterConfig, target: LoadedModel, service: DraftService | None = None, max_num_seqs: int = 1,
    max_model_len: int | None = None, built: Mapping[str, Drafter] | None = None,
) -> Drafter:
    """`service`: where a drafter with its own deployment runs (None: build it here, colocated);
    `max_num_seqs`: the requests that may draft at once (the scheduler's); `max_model_len`: the
    target's context limit, when configured; `built`: the engine's drafters built so far (a
    lookahead drafter's pool_from_traffic is one of them)."""
    if getattr(config, "tree", None) is not None and not target.model.supports_tree:
        raise ModelLoadError(f"drafter {config.name!r}: draft trees need the fast Llama backend "
                             "(target backend: fast or auto)")
    if isinstance(config, LookaheadDrafterConfig):
        if not target.model.supports_tree:
            raise ModelLoadError(f"drafter {config.name!r}: lookahead decoding runs its window as a draft tree, "
                                 "which needs the fast Llama backend (target backend: fast or auto)")
        traffic = None
        if config.pool_from_traffic is not None:
            traffic = (built or {}).get(config.pool_from_traffic)
            if not isinstance(traffic, SuffixDrafter):
                raise ModelLoadError(f"drafter {config.name!r}: pool_from_traffic {config.pool_from_traffic!r} is "
                                     "not a suffix drafter of this engine")
        return LookaheadDrafter(config, traffic)
    if isinstance(config, NgramDrafterConfig):
        return NgramDrafter(config)
    if isinstance(config, PredictionDrafterConfig):
        return PredictionDrafter(config)
    if isinstance(config, GrammarDrafterConfig):
        return GrammarDrafter(config)
    if isinstance(config, SuffixDrafterConfig):
        return SuffixDrafter(config, target.model.info.vocab_size)
    if isinstance(config, ModelDrafterConfig):
        if service is not None:
            return RemoteDrafter(config, service, target.model.info.vocab_size)
        return build_model_drafter(config, target.model.info.vocab_size, input_embeddings(target.model),
                                   max_num_seqs, max_model_len)
    if isinstance(config, EagleDrafterConfig):
        return _build_eagle_drafter(config, target)
    if isinstance(config, MedusaDrafterConfig):
        return _build_medusa_drafter(config, target)
    raise TypeError(f"unknown drafter config {type(config).__name__}")


def build_drafters(
    configs: Sequence[DrafterConfig], target: LoadedModel, services: Mapping[str, DraftService] | None = None,
    max_num_seqs: int = 1, max_model_len: int | None = None,
) -> dict[str, Drafter]:
    services = services or {}
    built: dict[str, Drafter] = {}
    # lookahead drafters last: one may read a suffix drafter's memory (pool_from_traffic)
    for c in sorted(configs, key=lambda c: isinstance(c, LookaheadDrafterConfig)):
        built[c.name] = build_drafter(c, target, services.get(c.name), max_num_seqs, max_model_len, built)
    return {c.name: built[c.name] for c in configs}
