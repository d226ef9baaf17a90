"""`specroute bench`: run methods side by side on Spec-Bench prompts and write results + report.

Measuring (DESIGN.md): one process, the same token budget and sampling for all (greedy unless
`temperature` is set); a warm-up through every method first; then methods interleaved prompt by
prompt, so drift in machine speed (other load, thermal state) hits every method alike. Every
greedy output is checked against plain decoding.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from bench.concurrency import (
    PLAIN_METHODS,
    Request,
    ServerPeer,
    as_json,
    check_concurrency_methods,
    concurrency_section,
    plot_throughput,
    run_levels,
)
from bench.llama_server import SERVER_MODES
from bench.lossless import find_mismatches
from bench.machine import machine_info
from bench.methods import (
    HF_METHODS,
    ROUTER_METHOD,
    TrafficMemories,
    assistant_config,
    build_methods,
    check_methods,
    token_checked,
)
from bench.prompts import BenchPrompt, load_prompts
from bench.records import RunRecord
from bench.report import machine_section, sampling_text, write_report
from bench.summary import reference_method, summarize
from bench.verify_cost import DEFAULT_KS, DEFAULT_REPS, measure_verify_curve
from policies.schema import Policy, load_policy
from policies.stats import MemoryStats
from workers.config import EngineConfig, RoutingConfig
from workers.engine import SpecEngine
from workers.routing import Router, measure_batch_cost, measure_costs
from workers.sampling import SamplingParams
from workers.target import gguf_file, load_hf

if TYPE_CHECKING:  # its import takes seconds; only the hf peers load a transformers model
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


@dataclass
class BenchArgs:
    prompts: Path  # Spec-Bench-format JSONL
    per_category: int  # the first N questions of each category
    max_tokens: int
    methods: list[str]  # plain is always run (the baseline) even when not listed
    out: Path
    config: EngineConfig
    categories: list[str] | None  # None: every category in the file
    warmup: int  # prompts run through every method before timing
    verify_curve: bool
    command: str  # recorded in results and report
    verify_ks: Sequence[int] = DEFAULT_KS
    verify_reps: int = DEFAULT_REPS
    routing: RoutingConfig = field(default_factory=RoutingConfig)  # the router method's policy
    heldout_mod: int | None = None  # keep question_id % N == 0 only: the classifier's held-out split
    concurrency: list[int] | None = None  # closed-loop client counts: the concurrency run instead
    file_order: bool = False  # the selected prompts in file order (a workload), not by category
    prime: int = 0  # the first N prompts run through every method untimed, feeding what learns from traffic
    llama_cpp: Path | None = None  # the directory of llama.cpp's binaries (its methods)
    temperature: float = 0.0  # 0: greedy, outputs checked against plain's; else sampled
    top_p: float = 1.0
    seed: int = 0  # a sampled run's prompt i draws from seed + i, the same for every method
    rounds: int = 1  # under concurrency: runs of each method per level, the fastest reported


def check_formats(prompts: Sequence[BenchPrompt], methods: Sequence[str], config: EngineConfig) -> None:
    """A workload whose prompts carry a `response_format` runs only methods that apply it (ours)."""
    ours = {*PLAIN_METHODS, ROUTER_METHOD, *(d.name for d in config.drafters)}
    if any(p.response_format is not None for p in prompts) and (peers := [m for m in methods if m not in ours]):
        raise ValueError(f"{', '.join(peers)}: these methods do not apply the prompts' response_format")


def encode_checked(engine: SpecEngine, prompts: Sequence[BenchPrompt], params: SamplingParams) -> dict:
    """Each prompt's token ids by question id; a prompt the engine refuses raises ValueError
    naming the question (RequestError is a ValueError)."""
    prompt_ids = {p.question_id: engine.encode(p.chat()) for p in prompts}
    for p in prompts:
        try:
            engine.check_request(prompt_ids[p.question_id], params)
        except ValueError as e:
            raise ValueError(f"question {p.question_id} ({p.category}): {e}") from None
    return prompt_ids


def bench_router(engine: SpecEngine, policy: Policy, routing: RoutingConfig, *, batched: bool) -> Router:
    """A router over fresh in-memory statistics (the run starts cold, as a new service would),
    calibrated as `routing` says; `batched`: also the batch cost curve of the goodput rule."""
    calibrate = routing.calibrate
    costs = measure_costs(engine) if calibrate else None
    batch_cost = measure_batch_cost(engine) if calibrate and batched else None
    return Router(engine, policy, MemoryStats(), costs=costs, seed=routing.seed, batch_cost=batch_cost)


def run_concurrency_bench(args: BenchArgs) -> dict:
    """The concurrency run (bench/concurrency.py): DIR/results.json with summary.concurrency,
    DIR/report.md and DIR/throughput.png."""
    assert args.concurrency
    gguf = gguf_file(args.config.target)
    methods = check_concurrency_methods(args.methods, [d.name for d in args.config.drafters], args.llama_cpp, gguf)
    prompts = load_prompts(args.prompts, args.per_category, args.categories, args.heldout_mod)
    check_formats(prompts, methods, args.config)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens)
    engine = SpecEngine.from_config(args.config)
    prompt_ids = encode_checked(engine, prompts, params)
    requests = [Request(p, prompt_ids[p.question_id], None if params.greedy else args.seed + i,
                        tuple(engine.encode_text(p.prediction or "")), p.output_format)
                for i, p in enumerate(prompts)]
    router = None
    if "router" in methods:
        router = bench_router(engine, load_policy(args.routing.policy_path()), args.routing, batched=True)
    peer = None
    if args.llama_cpp is not None and gguf is not None:
        peer = ServerPeer(args.llama_cpp, gguf, torch.get_num_threads(),
                          max(map(len, prompt_ids.values())) + args.max_tokens)
    warm = requests[: max(0, args.warmup)]
    if warm:  # every method of ours once, unmeasured (llama.cpp's server warms up per level)
        run_levels(engine, router, warm, [m for m in methods if m not in SERVER_MODES], [1], params,
                   [engine.generate(r.prompt_ids, r.params(params)).token_ids for r in warm])
    reference = [engine.generate(r.prompt_ids, r.params(params)).token_ids for r in requests]
    summary = as_json(run_levels(engine, router, requests, methods, args.concurrency, params, reference, peer,
                                 args.rounds))
    results = {
        "target": engine.target.name, "device": str(engine.target.model.device), "max_tokens": args.max_tokens,
        "num_prompts": len(requests), "methods": methods,
        "scheduler": engine.config.scheduler.model_dump(),
        "sampling": {"temperature": params.temperature, "top_p": params.top_p, "seed": args.seed,
                     "draws": args.config.seeded_draws},
        "summary": {"concurrency": summary}, "machine": machine_info(), "command": args.command,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot_throughput(summary, args.out / "throughput.png")
    lines = [
        "# SpecRoute benchmark under concurrency", "",
        f"Target `{results['target']}` on {results['device']}; {len(requests)} prompts; {sampling_text(results)}, "
        f"at most {args.max_tokens} new tokens; closed loop (each client sends its next prompt when its last one "
        f"finishes); scheduler {results['scheduler']}.", "",
        *concurrency_section(summary), "", "![throughput](throughput.png)", "",
        "## Machine", "", *machine_section(results["machine"]), "",
        "## Command", "", "```", args.command, "```", "",
    ]
    (args.out / "report.md").write_text("\n".join(lines))
    return results


def run_bench(args: BenchArgs) -> dict:
    """Run the benchmark, write DIR/results.json, DIR/report.md and the plots; return the results.
    A bad method, category or prompt raises ValueError before any timing starts."""
    if args.concurrency:
        return run_concurrency_bench(args)
    # cheap checks first: a typo must not cost a model load
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    methods = check_methods(args.methods, args.config, args.llama_cpp, greedy=params.greedy)
    prompts = load_prompts(args.prompts, args.per_category, args.categories, args.heldout_mod,
                           file_order=args.file_order)
    if args.prime >= len(prompts):
        raise ValueError(f"--prime {args.prime} leaves none of the {len(prompts)} selected prompts to time")
    check_formats(prompts, methods, args.config)
    policy = load_policy(args.routing.policy_path()) if ROUTER_METHOD in methods else None
    engine = SpecEngine.from_config(args.config)
    prompt_ids = encode_checked(engine, prompts, params)
    # one seed per prompt, shared by every method (greedy ignores it), the prompt's prediction and format
    prompt_params = {p.question_id: replace(params, seed=args.seed + i,
                                            prediction=tuple(engine.encode_text(p.prediction or "")),
                                            output_format=p.output_format)
                     for i, p in enumerate(prompts)}

    load_target = functools.cache(lambda: load_hf(args.config.target)[0])  # the target in transformers
    hf_model: PreTrainedModel | None = load_target() if set(methods) & set(HF_METHODS) else None
    assistant = None
    if "hf-assisted" in methods and (drafter := assistant_config(args.config)) is not None:
        # a drafter distilled for the target shares its embeddings (workers/target.py)
        assistant = load_hf(drafter.model, hf_model.get_input_embeddings().weight.detach())[0]
    router = bench_router(engine, policy, args.routing, batched=False) if policy is not None else None
    runners = build_methods(methods, engine, hf_model, assistant, router, args.llama_cpp)

    memories = TrafficMemories(engine)
    for p in prompts[: max(0, args.warmup)]:
        for method in runners:
            with memories.of(method.name):
                method.run(p, prompt_ids[p.question_id], prompt_params[p.question_id])
    memories.reset()  # the warm-up prompts are timed again: nothing may have learned them

    records: list[RunRecord] = []
    with tqdm(total=len(prompts) * len(runners), desc="bench", unit="run") as bar:
        for i, p in enumerate(prompts):
            for method in runners:
                bar.set_postfix_str(f"{p.category} q{p.question_id} {method.name}")
                with memories.of(method.name):
                    record = method.run(p, prompt_ids[p.question_id], prompt_params[p.question_id])
                if i >= args.prime:  # primed prompts only feed the memories
                    records.append(record)
                bar.update()

    checked = functools.partial(token_checked, params=params, config=args.config)
    mismatches = find_mismatches([r for r in records if checked(r.method)], prompt_ids, load_target)
    for m in mismatches:
        log.warning("method %s differs from %s on question %s at position %d (top-2 gap %s)", m.method,
                    reference_method(m.method), m.question_id, m.position,
                    "n/a" if m.top2_gap is None else f"{m.top2_gap:.2e}")
    curve = None
    if args.verify_curve:
        curve = measure_verify_curve(engine.target.model, ks=args.verify_ks, reps=args.verify_reps)

    results = {
        "target": engine.target.name,
        "device": str(engine.target.model.device),
        "max_tokens": args.max_tokens,
        "runs": [asdict(r) for r in records],
        "sampling": {"temperature": params.temperature, "top_p": params.top_p, "seed": args.seed,
                     "draws": args.config.seeded_draws},
        "summary": {c: {m: asdict(s) for m, s in ms.items()} for c, ms in summarize(records, checked).items()},
        "mismatches": [asdict(m) for m in mismatches],
        "verify_curve": curve,
        "machine": machine_info(),
        "command": args.command,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results))  # compact: token lists are long
    write_report(results, args.out)
    return results
