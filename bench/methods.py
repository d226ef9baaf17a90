"""The methods a benchmark compares, behind one interface: run one prompt, return its record.

  plain        our engine without a draft (the baseline every speedup is relative to)
  NAME         our engine with configured drafter NAME at its static draft_len
  hf           transformers `generate`, greedy: the peer without speculation
  hf-pld       transformers prompt lookup (`prompt_lookup_num_tokens=10`)
  hf-assisted  transformers assisted generation; the assistant is the first `model` drafter's model
  router       SpecRoute's adaptive routing: classifier, policy, live statistics of this run
  llama-cpp*   llama.cpp on the target's GGUF file, plain and its speculation (bench/llama_cpp.py)
All run with the same token budget, EOS set and sampling parameters. Greedy, outputs must be
identical (llama.cpp's to its own plain output); sampled (`--temperature`), each prompt has one
seed for every method, and the outputs follow the target's distribution rather than plain's
tokens (llama.cpp's modes run greedy only).
Drafters that learn from traffic (suffix) keep one memory per method (`TrafficMemories`); a
fixed-drafter method's domain is the prompt's category, the router's its classifier's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig

from bench.llama_cpp import MODES as LLAMA_CPP_MODES
from bench.llama_cpp import LlamaCppMethod, check_llama_cpp
from bench.prompts import BenchPrompt
from bench.records import RunRecord
from bench.summary import LLAMA_CPP_PLAIN, PLAIN_METHOD
from workers.config import EngineConfig, ModelDrafterConfig
from workers.drafters.suffix import SuffixCaches, SuffixDrafter
from workers.engine import PLAIN, GenerationResult, SpecEngine
from workers.routing import Router
from workers.routing import generate as route
from workers.sampling import SamplingParams
from workers.target import gguf_file

if TYPE_CHECKING:  # its import takes seconds; only the hf peers load a transformers model
    from transformers import PreTrainedModel

HF_METHODS = ("hf", "hf-pld", "hf-assisted")
ROUTER_METHOD = "router"
PROMPT_LOOKUP_NUM_TOKENS = 10  # transformers' documented example value


class Method(Protocol):
    name: str

    def run(self, prompt: BenchPrompt, prompt_ids: list[int], params: SamplingParams) -> RunRecord: ...


def check_methods(
    methods: list[str], config: EngineConfig, llama_cpp: Path | None = None, *, greedy: bool = True,
) -> list[str]:
    """The methods to run, plain first (it is every other method's baseline), then llama.cpp's
    plain where any of its modes runs (their reference), duplicates dropped. `llama_cpp`: the
    directory of llama.cpp's binaries; `greedy`: False for a sampled run, which llama.cpp's modes
    do not take. Raises ValueError naming the first method that cannot run."""
    valid = [PLAIN_METHOD, *(d.name for d in config.drafters), ROUTER_METHOD, *HF_METHODS, *LLAMA_CPP_MODES]
    for name in methods:
        if name not in valid:
            raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(valid)}")
    if "hf-assisted" in methods and assistant_config(config) is None:
        raise ValueError("method 'hf-assisted' needs a drafter of kind 'model' in the engine config "
                         "(its model is the assistant); none is configured")
    if not greedy and (peers := [m for m in methods if m in LLAMA_CPP_MODES]):
        raise ValueError(f"method {peers[0]!r} runs greedy only (its sampler draws other random numbers, and its "
                         "speculation is compared with its own plain output); drop --temperature or the method")
    check_llama_cpp(methods, llama_cpp, gguf_file(config.target))
    first = [PLAIN_METHOD, *([LLAMA_CPP_PLAIN] if set(methods) & set(LLAMA_CPP_MODES) else [])]
    return list(dict.fromkeys([*first, *methods]))


def token_checked(method: str, params: SamplingParams, config: EngineConfig) -> bool:
    """Whether `method`'s outputs must repeat its reference's tokens: greedy decoding, or, sampled,
    our engine's methods where seeded draws are keyed by position (`seeded_draws`), which give
    plain sampling's tokens under any drafter; transformers' samplers draw numbers of their own."""
    return params.greedy or (config.seeded_draws == "position" and method not in HF_METHODS)


def assistant_config(config: EngineConfig) -> ModelDrafterConfig | None:
    return next((d for d in config.drafters if isinstance(d, ModelDrafterConfig)), None)


@dataclass
class TrafficMemories:
    """The memories of the engine's learning drafters, one set per method: every method runs the
    same prompts, so a memory shared between methods would hold the very output a method is
    about to produce (another method's run of the same prompt)."""

    engine: SpecEngine
    _by_method: dict[str, list[SuffixCaches]] = field(default_factory=dict)

    @property
    def drafters(self) -> list[SuffixDrafter]:
        return [d for d in self.engine.drafters.values() if isinstance(d, SuffixDrafter)]

    @contextmanager
    def of(self, method: str) -> Iterator[None]:
        """Run `method`'s requests on its own memories (created empty on its first use)."""
        memories = self._by_method.setdefault(method, [d.new_caches() for d in self.drafters])
        for drafter, caches in zip(self.drafters, memories):
            drafter.caches = caches
        yield

    def reset(self) -> None:
        """Forget every method's memories."""
        self._by_method.clear()


@dataclass
class EngineMethod:
    name: str
    engine: SpecEngine
    drafter: str  # PLAIN or a configured drafter name; k is the drafter's static draft_len

    def run(self, prompt: BenchPrompt, prompt_ids: list[int], params: SamplingParams) -> RunRecord:
        t0 = time.perf_counter()
        result = self.engine.generate(prompt_ids, params, self.drafter, domain=prompt.category)
        return engine_record(prompt, self.name, result, time.perf_counter() - t0)


@dataclass
class RouterMethod:
    """Every request through the router, statistics accumulating over the run as in service."""

    name: str
    router: Router

    def run(self, prompt: BenchPrompt, prompt_ids: list[int], params: SamplingParams) -> RunRecord:
        t0 = time.perf_counter()
        result = route(self.router, prompt_ids, params, prompt.text)
        return engine_record(prompt, self.name, result, time.perf_counter() - t0)


def engine_record(prompt: BenchPrompt, method: str, result: GenerationResult, wall_s: float) -> RunRecord:
    """The record of one run of our engine, routed or not: its counts and timings per step."""
    return RunRecord(
        question_id=prompt.question_id, category=prompt.category, method=method,
        token_ids=result.token_ids, num_new_tokens=len(result.token_ids), wall_s=wall_s,
        num_steps=result.num_steps, num_draft_tokens=result.num_draft_tokens,
        num_accepted_tokens=result.num_accepted_tokens,
        accepted_per_position=result.accepted_per_position, drafted_per_position=result.drafted_per_position,
        routing=result.routing.to_json() if result.routing is not None else None,
        draft_s=sum(s.draft_s for s in result.steps), verify_s=sum(s.verify_s for s in result.steps),
        ttft_s=result.ttft_s, first_draft_s=result.steps[0].draft_s if result.steps else None,
    )


@dataclass
class ForwardCount:
    num_calls: int = 0
    num_tokens: int = 0  # input tokens over all calls


@contextmanager
def count_forwards(model: torch.nn.Module) -> Iterator[ForwardCount]:
    """Count the calls of a model's forward (a pre-hook sees every one, whatever path generate
    takes) and the tokens they were fed."""
    count = ForwardCount()

    def hook(module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        count.num_calls += 1
        count.num_tokens += int(ids.shape[-1]) if ids is not None else 0

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield count
    finally:
        handle.remove()


@dataclass
class HFMethod:
    name: str
    model: PreTrainedModel
    eos_token_ids: frozenset[int]  # the engine's stop set, so both stop at the same token
    pad_token_id: int | None
    assistant: PreTrainedModel | None = None
    prompt_lookup_num_tokens: int | None = None

    def run(self, prompt: BenchPrompt, prompt_ids: list[int], params: SamplingParams) -> RunRecord:
        # a fresh config: the checkpoint's own generation defaults (sampling, penalties) must not
        # leak into the comparison (top_k 0: the whole vocabulary, as our engine samples)
        gen_config = GenerationConfig(
            max_new_tokens=params.max_tokens, do_sample=not params.greedy, eos_token_id=sorted(self.eos_token_ids),
            pad_token_id=self.pad_token_id, prompt_lookup_num_tokens=self.prompt_lookup_num_tokens,
            **({} if params.greedy else {"temperature": params.temperature, "top_k": params.top_k,
                                         "top_p": params.top_p}),
        )
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)  # generate samples from the global stream
        t0 = time.perf_counter()
        input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.model.device)
        with count_forwards(self.model) as count:
            out = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=gen_config,
                assistant_model=self.assistant,
            )
        wall_s = time.perf_counter() - t0
        token_ids = _until_eos(out[0, len(prompt_ids):].tolist(), self.eos_token_ids)
        # With a cache, forward i feeds [the tokens not yet cached + its candidates]: the whole
        # prompt first, then the one token emitted last. So the tokens fed over all forwards are
        # prompt + (forwards - 1) + candidates, which gives the candidate count exactly.
        num_draft = count.num_tokens - len(prompt_ids) - (count.num_calls - 1)
        return RunRecord(
            question_id=prompt.question_id, category=prompt.category, method=self.name,
            token_ids=token_ids, num_new_tokens=len(token_ids), wall_s=wall_s,
            num_steps=count.num_calls, num_draft_tokens=num_draft,
            # every forward emits its accepted candidates plus one token of its own
            num_accepted_tokens=len(token_ids) - count.num_calls,
            accepted_per_position=None, drafted_per_position=None,
        )


def _until_eos(token_ids: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """Cut after the first EOS, as the engine does (generate pads finished rows in a batch)."""
    for i, token in enumerate(token_ids):
        if token in eos_token_ids:
            return token_ids[: i + 1]
    return token_ids


def build_methods(
    names: list[str], engine: SpecEngine, hf_model: PreTrainedModel | None,
    assistant: PreTrainedModel | None = None, router: Router | None = None, llama_cpp: Path | None = None,
) -> list[Method]:
    """Method objects for names already checked by `check_methods`. hf_model is the target as a
    transformers model (needed by every hf method); assistant by hf-assisted; router by router;
    llama_cpp (the binaries' directory) by llama.cpp's modes."""
    eos = engine.target.model.info.eos_token_ids
    pad = engine.tokenizer.pad_token_id
    pad = pad if pad is not None else min(eos, default=None)
    methods: list[Method] = []
    for name in names:
        if name == PLAIN_METHOD:
            methods.append(EngineMethod(name, engine, PLAIN))
        elif name in engine.drafters:
            methods.append(EngineMethod(name, engine, name))
        elif name == ROUTER_METHOD:
            if router is None:
                raise ValueError("method 'router' needs a Router")
            methods.append(RouterMethod(name, router))
        elif name in HF_METHODS:
            if hf_model is None or (name == "hf-assisted" and assistant is None):
                raise ValueError(f"method {name!r} needs its transformers model loaded")
            methods.append(HFMethod(
                name, hf_model, eos, pad,
                assistant=assistant if name == "hf-assisted" else None,
                prompt_lookup_num_tokens=PROMPT_LOOKUP_NUM_TOKENS if name == "hf-pld" else None,
            ))
        elif name in LLAMA_CPP_MODES:
            gguf = gguf_file(engine.config.target)
            if llama_cpp is None or gguf is None:
                raise ValueError(f"method {name!r} needs a llama.cpp build and a GGUF target")
            methods.append(LlamaCppMethod(name, llama_cpp, gguf, engine.tokenizer, torch.get_num_threads()))
        else:
            raise ValueError(f"unknown method {name!r}")
    return methods
