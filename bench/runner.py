"""`specroute bench`: run methods side by side on Spec-Bench prompts and write results + report.

Measuring (DESIGN.md): one process, greedy, the same token budget for all; a warm-up through
every method first; then methods interleaved prompt by prompt, so drift in machine speed (other
load, thermal state) hits every method alike. Every output is checked against plain decoding.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm
from transformers import PreTrainedModel

from bench.lossless import find_mismatches
from bench.machine import machine_info
from bench.methods import HF_METHODS, ROUTER_METHOD, assistant_config, build_methods, check_methods
from bench.prompts import load_prompts
from bench.records import RunRecord
from bench.report import write_report
from bench.summary import summarize
from bench.verify_cost import DEFAULT_KS, DEFAULT_REPS, measure_verify_curve
from policies.schema import load_policy
from policies.stats import MemoryStats
from workers.config import EngineConfig, RoutingConfig
from workers.engine import SpecEngine
from workers.routing import Router, measure_costs
from workers.sampling import SamplingParams
from workers.target import load_hf

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


def run_bench(args: BenchArgs) -> dict:
    """Run the benchmark, write DIR/results.json, DIR/report.md and the plots; return the results.
    A bad method, category or prompt raises ValueError before any timing starts."""
    # cheap checks first: a typo must not cost a model load
    methods = check_methods(args.methods, args.config)
    prompts = load_prompts(args.prompts, args.per_category, args.categories, args.heldout_mod)
    policy = load_policy(args.routing.policy_path()) if ROUTER_METHOD in methods else None
    params = SamplingParams(max_tokens=args.max_tokens)

    engine = SpecEngine.from_config(args.config)
    prompt_ids = {p.question_id: engine.encode(p.text) for p in prompts}
    for p in prompts:  # RequestError is a ValueError: name the question
        try:
            engine.check_request(prompt_ids[p.question_id], params)
        except ValueError as e:
            raise ValueError(f"question {p.question_id} ({p.category}): {e}") from None

    load_target = functools.cache(lambda: load_hf(args.config.target)[0])  # the target in transformers
    hf_model: PreTrainedModel | None = load_target() if set(methods) & set(HF_METHODS) else None
    assistant = None
    if "hf-assisted" in methods and (drafter := assistant_config(args.config)) is not None:
        # a drafter distilled for the target shares its embeddings (workers/target.py)
        assistant = load_hf(drafter.model, hf_model.get_input_embeddings().weight.detach())[0]
    router = None
    if policy is not None:  # fresh in-memory statistics: the run starts cold, as a new service would
        costs = measure_costs(engine) if args.routing.calibrate else None
        router = Router(engine, policy, MemoryStats(), costs=costs, seed=args.routing.seed)
    runners = build_methods(methods, engine, hf_model, assistant, router)

    for p in prompts[: max(0, args.warmup)]:
        for method in runners:
            method.run(p, prompt_ids[p.question_id], args.max_tokens)

    records: list[RunRecord] = []
    with tqdm(total=len(prompts) * len(runners), desc="bench", unit="run") as bar:
        for p in prompts:
            for method in runners:
                bar.set_postfix_str(f"{p.category} q{p.question_id} {method.name}")
                records.append(method.run(p, prompt_ids[p.question_id], args.max_tokens))
                bar.update()

    mismatches = find_mismatches(records, prompt_ids, load_target)
    for m in mismatches:
        log.warning("method %s differs from plain on question %s at position %d (top-2 gap %.2e)",
                    m.method, m.question_id, m.position, m.top2_gap)
    curve = None
    if args.verify_curve:
        curve = measure_verify_curve(engine.target.model, ks=args.verify_ks, reps=args.verify_reps)

    results = {
        "target": engine.target.name,
        "device": str(engine.target.model.device),
        "max_tokens": args.max_tokens,
        "runs": [asdict(r) for r in records],
        "summary": {c: {m: asdict(s) for m, s in ms.items()} for c, ms in summarize(records).items()},
        "mismatches": [asdict(m) for m in mismatches],
        "verify_curve": curve,
        "machine": machine_info(),
        "command": args.command,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results))  # compact: token lists are long
    write_report(results, args.out)
    return results
