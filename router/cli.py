"""The `specroute` command line: serve, run-batch, generate, bench, load, policy, train-*, gen-answers.

Heavy imports (torch, Ray) happen inside each command so `specroute --help` stays instant and a
bad argument is reported before any model loads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

from router.run_batch import DEFAULT_CONCURRENCY
from router.serve import ServeError
from workers.config import (
    DEFAULT_TARGET_MODEL,
    PLAIN,
    ConfigError,
    RoutingConfig,
    ToolCallParser,
    check_speculation,
    load_engine_config,
    load_routing_config,
)
from workers.result import Logprob, RequestError
from workers.text_stream import stream_delta

DEFAULT_SERVE_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "serve.cpu.yaml"
# `specroute serve`'s flags (vLLM's names) that set a field of the application's args, by dotted path
SERVE_ARG_FLAGS: dict[str, str] = {
    "served_model_name": "served_model_name",
    "api_key": "api_key",
    "max_model_len": "engine.target.max_model_len",
    "chat_template": "engine.target.chat_template",
    "tool_call_parser": "engine.target.tool_call_parser",
    "generation_config": "engine.target.generation_config",
    "max_num_seqs": "engine.scheduler.max_num_seqs",
    "max_num_batched_tokens": "engine.scheduler.max_num_batched_tokens",
    "num_replicas": "num_replicas",
}


class CLIError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""


def _comma_list(value: str, flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise CLIError(f"{flag} is empty")
    return items


def _levels(value: str, flag: str = "--concurrency") -> list[int]:
    """Positive client counts, ascending, each once."""
    levels = []
    for item in _comma_list(value, flag):
        if not item.isdigit() or int(item) < 1:
            raise CLIError(f"{flag}: {item!r} is not a positive number of clients")
        levels.append(int(item))
    return sorted(set(levels))


def _existing_file(path: Path, flag: str) -> Path:
    if not path.is_file():
        raise CLIError(f"{flag}: no file {path}")
    return path


def routing_config(policy: Path | None, config: Path | None = None) -> RoutingConfig:
    """The router's config: a Serve config's `routing` args (else every default), its policy
    replaced by --policy where one is given."""
    routing = load_routing_config(config)
    return routing if policy is None else routing.model_copy(update={"policy": _existing_file(policy, "--policy")})


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _draft_len(text: str) -> int | None:
    return None if text == "auto" else _positive_int(text)


def _output_format(response_format: str | None) -> Any:
    """--response-format's JSON (OpenAI's object) as the engine's OutputFormat; None: free text."""
    if response_format is None:
        return None
    from pydantic import ValidationError

    from router.schemas import GenerationRequestBase

    try:
        return GenerationRequestBase.model_validate({"response_format": json.loads(response_format)}).output_format
    except (json.JSONDecodeError, ValidationError) as e:
        raise ValueError(f"--response-format: {e}") from None


class _Printout:
    """The output's text printed as it is generated, each step's part as soon as no stop string
    or incomplete character may still change it (as the server streams it)."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...]) -> None:
        self.decode, self.stop = decode, stop
        self.sent = ""

    def __call__(self, output_ids: list[int]) -> None:
        if delta := stream_delta(self.decode(output_ids), self.sent, self.stop):
            self.sent += delta
            sys.stdout.write(delta)
            sys.stdout.flush()

    def finish(self, text: str) -> None:
        """The rest of the final text (a stop string cut, held-back tails), then a newline."""
        print(text[len(self.sent) :] if text.startswith(self.sent) else f"\n{text}", flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    from policies.schema import PolicyError, load_policy

    # what the files and flags alone decide is refused before torch and the model load (seconds)
    if not args.prompt.strip():
        raise CLIError("--prompt is empty")
    config, routing = load_engine_config(args.config), routing_config(args.policy, args.config)
    try:
        load_policy(routing.policy_path())
    except PolicyError as e:
        raise CLIError(str(e)) from None
    try:  # as the router checks a request's, against the config's drafters
        check_speculation(args.drafter, args.draft_len, [d.name for d in config.drafters], config.max_draft_len)
    except RequestError as e:
        raise CLIError(f"--{e.param.removeprefix('speculation.').replace('_', '-')}: {e}") from None
    from workers.sampling import SamplingParams  # torch, not yet the model stack

    penalties = {name: value for name in ("presence_penalty", "frequency_penalty", "repetition_penalty")
                 if (value := getattr(args, name)) is not None}
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, min_p=args.min_p, seed=args.seed, stop=tuple(args.stop or ()),
            extra_stop_token_ids=frozenset(args.stop_token_id or ()), ignore_eos=args.ignore_eos,
            min_tokens=args.min_tokens, logprobs=args.logprobs, **penalties,
            allowed_token_ids=None if args.allowed_token_id is None else frozenset(args.allowed_token_id),
            output_format=_output_format(args.response_format),
        )
    except ValueError as e:
        raise CLIError(str(e)) from None

    from policies.stats import MemoryStats
    from workers.engine import SpecEngine
    from workers.reasoning import prompt_reasoning_start, reasoning_tokens, split_output
    from workers.routing import Router, Speculation
    from workers.routing import generate as route
    from workers.target import ModelLoadError

    try:
        engine = SpecEngine.from_config(config)
        # one request: a measured cost curve would cost more than it could save
        router = Router.from_config(engine, routing.model_copy(update={"calibrate": False}), MemoryStats())
        prompt_ids = engine.encode(args.prompt, chat=not args.raw)
        if args.prediction:
            params = dataclasses.replace(params, prediction=tuple(engine.encode_text(args.prediction)))
        if args.bad_word:
            params = dataclasses.replace(params, bad_words=engine.bad_word_ids(args.bad_word))
        printout = None if args.json else _Printout(functools.partial(
            engine.tokenizer.decode, skip_special_tokens=params.skip_special_tokens), params.stop)
        result = route(router, prompt_ids, params, args.prompt, Speculation(args.drafter, args.draft_len),
                       on_output=printout)
    except (ModelLoadError, PolicyError, RequestError) as e:
        raise CLIError(str(e)) from None

    if printout is not None:
        printout.finish(result.text)
        return 0
    assert result.routing is not None
    thinking: dict[str, Any] = {}
    if config.target.reasoning_parser is not None and not args.raw:  # a chat's thinking apart from its answer
        start = prompt_reasoning_start(prompt_ids, engine.tokenizer.decode)
        parts = split_output(result.text, start)
        decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=params.skip_special_tokens)
        thinking = {"reasoning": parts.reasoning, "content": parts.content,
                    "num_reasoning_tokens": reasoning_tokens(result.token_ids, decode, start)}
    print(json.dumps({
        "text": result.text,
        "token_ids": result.token_ids,
        "finish_reason": result.finish_reason,
        **result.routing.to_json(),
        "drafters_used": result.drafters,
        "num_prompt_tokens": result.num_prompt_tokens,
        "num_steps": result.num_steps,
        "num_draft_tokens": result.num_draft_tokens,
        "num_accepted_tokens": result.num_accepted_tokens,
        "mean_acceptance_length": round(result.mean_acceptance_length, 4),
        "accepted_per_position": result.accepted_per_position,
        "wall_s": round(result.wall_s, 4),
        **thinking,
        **({} if result.prediction is None else {"prediction_tokens": dataclasses.asdict(result.prediction)}),
        **({} if result.logprobs is None else {"logprobs": [
            {**_logprob_json(e.chosen), "top_logprobs": [_logprob_json(t) for t in e.top]} for e in result.logprobs
        ]}),
    }))
    return 0


def _logprob_json(entry: Logprob) -> dict[str, Any]:
    return {"token": entry.token, "token_id": entry.token_id, "logprob": entry.logprob}


def cmd_bench(args: argparse.Namespace) -> int:
    _existing_file(args.prompts, "--prompts")  # the files and flags first: the imports take seconds
    methods = _comma_list(args.methods, "--methods")
    config, routing = load_engine_config(args.config), routing_config(args.policy, args.config)
    concurrency = _levels(args.concurrency) if args.concurrency is not None else None

    from bench.llama_cpp import llama_cpp_dir
    from bench.runner import BenchArgs, run_bench
    from policies.schema import PolicyError
    from workers.target import ModelLoadError

    bench_args = BenchArgs(
        prompts=args.prompts, per_category=args.per_category, max_tokens=args.max_tokens,
        methods=methods, out=args.out, config=config,
        categories=args.categories.split(",") if args.categories else None,
        warmup=args.warmup, verify_curve=not args.no_verify_curve, command=" ".join(sys.argv),
        routing=routing, heldout_mod=args.heldout_mod, concurrency=concurrency,
        file_order=args.order == "file", prime=args.prime, llama_cpp=llama_cpp_dir(args.llama_cpp),
        temperature=args.temperature, top_p=args.top_p, seed=args.seed, rounds=args.rounds,
    )
    try:
        run_bench(bench_args)
    except (ValueError, ModelLoadError, PolicyError) as e:
        raise CLIError(str(e)) from None
    return 0


def cmd_load(args: argparse.Namespace) -> int:
    _existing_file(args.prompts, "--prompts")
    modes = _comma_list(args.speculation, "--speculation")
    levels = _levels(args.clients, "--clients")
    from bench.load import LoadArgs, long_prompt_text, run_load, write_load_report  # torch: seconds
    from bench.prompts import load_prompts

    try:
        prompts = load_prompts(args.prompts, args.per_category, None, args.heldout_mod)
    except ValueError as e:
        raise CLIError(str(e)) from None
    long = long_prompt_text(prompts, args.long_prompt_tokens) if args.long_prompt_tokens else None
    runs = []
    for clients in levels:
        for mode in modes:
            print(f"load: {clients} clients, {args.duration:g} s, speculation {mode} ...", file=sys.stderr)
            runs.append(run_load(LoadArgs(args.url.rstrip("/"), prompts, clients, args.duration, args.max_tokens,
                                          mode, args.model, long_prompt=long, turns=args.turns,
                                          think_s=args.think)))
    report = write_load_report(runs, args.out, " ".join(sys.argv))
    print(report.read_text())
    return 0 if all(r["errors"] == 0 for r in runs) else 1


def cmd_run_batch(args: argparse.Namespace) -> int:
    from router.control import API_KEY_ENV
    from router.run_batch import BatchFileError, describe, free_port, progress, read_batch, run_batch
    from router.serve import load_serve_config, serve, shutdown

    try:
        batch = read_batch(_existing_file(args.input_file, "--input-file"))
    except BatchFileError as e:
        raise CLIError(str(e)) from None
    api_key = args.api_key or os.environ.get(API_KEY_ENV)

    def answer(base_url: str) -> int:
        with args.output_file.open("w", encoding="utf-8") as out:
            summary = run_batch(batch, base_url, out, args.concurrency, api_key, progress(len(batch)))
        print(describe(summary, args.output_file), file=sys.stderr)
        return 0 if summary.num_failed == 0 else 1

    if args.url is not None:
        return answer(args.url)
    config = _existing_file(args.config, "--config")
    prefix = (load_serve_config(config)["applications"][0].get("route_prefix") or "/").rstrip("/")
    port = free_port()
    serve(config, host="127.0.0.1", port=port, blocking=False)
    try:
        return answer(f"http://127.0.0.1:{port}{prefix}")
    finally:
        shutdown()


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The application args `specroute serve`'s flags set (the config's own where a flag is absent);
    a fixed replica count replaces the config's autoscaling."""
    overrides = {path: getattr(args, dest) for dest, path in SERVE_ARG_FLAGS.items() if getattr(args, dest) is not None}
    if args.num_replicas is not None:
        overrides["autoscaling_config"] = None
    return overrides


def cmd_serve(args: argparse.Namespace) -> int:
    from router.serve import serve

    overrides = serve_overrides(args)
    try:
        serve(_existing_file(args.config, "--config"), host=args.host, port=args.port, blocking=True,
              overrides=overrides)
    except ConfigError as e:  # name the flag that set a field the config refuses
        flags = [f"--{dest.replace('_', '-')}" for dest, path in SERVE_ARG_FLAGS.items()
                 if path in overrides and path in str(e)]
        raise ConfigError(f"{e} (set by {', '.join(flags)})" if flags else str(e)) from None
    return 0


def cmd_policy_check(args: argparse.Namespace) -> int:
    from policies.schema import PolicyError, check_policy_drafters, load_policy

    if args.drafters is None:
        configured = {d.name for d in load_engine_config(DEFAULT_SERVE_CONFIG).drafters} | {PLAIN}
    else:
        configured = set(_comma_list(args.drafters, "--drafters"))
    try:
        policy = load_policy(args.file)  # its errors name the file
    except PolicyError as e:
        raise CLIError(str(e)) from None
    try:
        usable = check_policy_drafters(policy, configured)
    except PolicyError as e:
        raise CLIError(f"policy {args.file}: {e}") from None
    for line in usable.ignored:
        print(f"warning: {line}; an engine without it ignores it", file=sys.stderr)
    print(f"ok: policy {policy.version}, {len(policy.domains)} domains")
    return 0


def cmd_train_classifier(args: argparse.Namespace) -> int:
    from policies.classifier import ClassifierError, read_examples, train, write_artefact

    try:
        examples = [e for path in args.data for e in read_examples(path)]
        result = train(examples, holdout_mod=args.holdout_mod)
        command = "specroute train-classifier " + " ".join(
            [*(f"--data {p}" for p in args.data), f"--out {args.out}", f"--holdout-mod {args.holdout_mod}"]
        )
        card = write_artefact(result, args.out, args.data, command)
    except ClassifierError as e:
        raise CLIError(str(e)) from None
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror}") from None
    acc = "n/a" if result.heldout_accuracy is None else f"{result.heldout_accuracy:.4f}"
    print(f"ok: trained on {result.n_train} prompts, held-out accuracy {acc} on {result.n_heldout}; wrote {card}")
    return 0


DRAFTER_KINDS_TRAINABLE = ("eagle", "medusa", "model")


def cmd_train_drafter(args: argparse.Namespace) -> int:
    if args.kind not in DRAFTER_KINDS_TRAINABLE:
        raise CLIError(f"--kind: unknown drafter kind {args.kind!r} (available: {', '.join(DRAFTER_KINDS_TRAINABLE)})")
    from training.args import TrainError
    from training.corpus import CorpusError
    from training.eagle import EagleTrainArgs, train_eagle
    from training.medusa import MedusaTrainArgs, train_medusa
    from training.model import ModelTrainArgs, train_model
    from workers.target import ModelLoadError

    cls, train = {"eagle": (EagleTrainArgs, train_eagle), "medusa": (MedusaTrainArgs, train_medusa),
                  "model": (ModelTrainArgs, train_model)}[args.kind]
    fields = {f.name for f in dataclasses.fields(cls)}
    # flags left at their default are not given (None, or False for switches): the kind's own default applies;
    # a given 0 is kept (`0 in (None, False)` is true in Python)
    given = {k: v for k, v in vars(args).items()
             if k not in ("command", "func", "kind") and v is not None and v is not False}
    if wrong := sorted(k for k in given if k not in fields):
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in wrong)
        raise CLIError(f"{flags}: not an option of --kind {args.kind}")
    given["out"] = str(args.out)
    command = f"specroute train-drafter --kind {args.kind} " + " ".join(
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in given.items() if k != "resume"
    ) + (" --resume" if args.resume else "")
    try:
        record = train(cls(**given, command=command), log=lambda line: print(line, file=sys.stderr))
    except (TrainError, CorpusError, ModelLoadError) as e:
        raise CLIError(str(e)) from None
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror}") from None
    last = record["history"][-1] if record["history"] else {}
    before, after = record.get("eval_initial") or {}, last.get("eval") or {}
    if args.kind in ("eagle", "model"):
        what = "loss" if args.kind == "eagle" else "KL"
        scores = (f"held-out {what} {before['loss']:.4f} -> {after['loss']:.4f}, top-1 agreement "
                  f"{before['top1']:.4f} -> {after['top1']:.4f}" if before and after else "no held-out windows")
    else:
        scores = ", ".join(f"head {i} top-1 {before[f'top1_{i}']:.4f} -> {after[f'top1_{i}']:.4f}"
                           for i in range(record["args"]["num_heads"]) if f"top1_{i}" in after and before) \
            or "no held-out windows"
    print(f"ok: {args.kind} drafter at step {record['step']}/{record['args']['steps']}, {scores}; "
          f"draft vocabulary {record['draft_vocab']['size']} covers {record['draft_vocab']['coverage']:.2%}; "
          f"wrote {args.out / 'CARD.md'}")
    return 0


def cmd_gen_answers(args: argparse.Namespace) -> int:
    for path in args.prompts:
        _existing_file(path, "--prompts")
    from training.answers import check_sampling, generate_answers, read_prompts  # torch: seconds
    from training.corpus import CorpusError
    from workers.config import ModelConfig
    from workers.target import ModelLoadError, load_hf

    try:
        check_sampling(args.temperature, args.samples)  # before the model loads
        rows, skipped = read_prompts(args.prompts, args.heldout_mod, args.limit)
        if not rows:
            raise CLIError("--prompts: no prompts to answer (every one is held out)")
        model, tokenizer, _ = load_hf(ModelConfig(model=args.target, device=args.device))
        stats = generate_answers(model, tokenizer, rows, args.out, max_tokens=args.max_tokens, batch=args.batch,
                                 max_prompt_tokens=args.max_prompt_tokens, temperature=args.temperature,
                                 samples=args.samples, seed=args.seed, log=lambda line: print(line, file=sys.stderr))
    except (CorpusError, ModelLoadError) as e:
        raise CLIError(str(e)) from None
    except OSError as e:
        raise CLIError(f"cannot write {args.out}: {e.strerror}") from None
    print(f"ok: {stats['written']} answers ({stats['tokens']} tokens) in {stats['wall_s']} s; "
          f"{stats['already_done']} already in {args.out}, {stats['too_long']} prompts over "
          f"--max-prompt-tokens, {skipped} held-out Spec-Bench questions skipped; wrote {args.out}")
    return 0


def _non_negative_int(text: str) -> int:
    return 0 if text.strip() == "0" else _positive_int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specroute", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the Ray Serve app (OpenAI-compatible HTTP)")
    serve.add_argument("--config", type=Path, default=DEFAULT_SERVE_CONFIG, help="Serve config YAML")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    # vLLM's serve flags: each sets a field of the config's application args (SERVE_ARG_FLAGS)
    serve.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model names clients send (responses carry the first)")
    serve.add_argument("--api-key", help="the key the inference endpoints require (default: the config's, "
                       "else $SPECROUTE_API_KEY)")
    serve.add_argument("--max-model-len", type=_positive_int, metavar="N", help="prompt + generated tokens a request "
                       "may take")
    serve.add_argument("--chat-template", metavar="FILE_OR_JINJA", help="the target's chat template")
    serve.add_argument("--tool-call-parser", choices=get_args(ToolCallParser), help="how the target writes tool calls")
    serve.add_argument("--generation-config", choices=("auto", "vllm"),
                       help="auto: omitted sampling fields take the model's generation_config.json values")
    serve.add_argument("--max-num-seqs", type=_positive_int, metavar="N", help="requests a replica runs batched")
    serve.add_argument("--max-num-batched-tokens", type=_positive_int, metavar="N", help="tokens a step computes")
    serve.add_argument("--num-replicas", type=_positive_int, metavar="N", help="target replicas")
    serve.set_defaults(func=cmd_serve)

    rb = sub.add_parser("run-batch", help="answer an OpenAI batch file (JSONL) through the service (vLLM's "
                        "run-batch)")
    rb.add_argument("-i", "--input-file", type=Path, required=True,
                    help="one request a line: custom_id, method POST, url (/v1/chat/completions, /v1/completions, "
                         "/v1/responses), body")
    rb.add_argument("-o", "--output-file", type=Path, required=True,
                    help="one answer a line, in input order (OpenAI's batch output)")
    rb.add_argument("--url", help="a running server (default: start one from --config, stopped after)")
    rb.add_argument("--config", type=Path, default=DEFAULT_SERVE_CONFIG, help="Serve config YAML, without --url")
    rb.add_argument("--concurrency", type=_positive_int, default=DEFAULT_CONCURRENCY, help="requests in flight at once")
    rb.add_argument("--api-key", help="the server's api_key (default: $SPECROUTE_API_KEY)")
    rb.set_defaults(func=cmd_run_batch)

    gen = sub.add_parser("generate", help="generate in-process (no Ray)")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--drafter", default="auto", help="auto, none, or a configured drafter name")
    gen.add_argument("--draft-len", type=_draft_len, default=None, help="auto or K")
    gen.add_argument("--max-tokens", type=_positive_int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", help="a token that ends the output (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="generate past end-of-sequence")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this share of the likeliest's")
    gen.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens")
    gen.add_argument("--allowed-token-id", type=int, action="append", help="only these tokens (repeatable)")
    gen.add_argument("--bad-word", action="append", help="a word never written (repeatable)")
    for penalty in ("presence", "frequency", "repetition"):
        gen.add_argument(f"--{penalty}-penalty", type=float, default=None, help="default: none")
    gen.add_argument("--prediction", default=None, metavar="TEXT",
                     help="the output expected (e.g. the file an edit rewrites): drafted from, never emitted as is")
    gen.add_argument("--response-format", default=None, metavar="JSON",
                     help='what the output must match, as OpenAI\'s object: \'{"type": "json_object"}\' or '
                          '\'{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}\'')
    gen.add_argument("--raw", action="store_true", help="no chat template: the prompt as is")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's logprob and its position's N likeliest")
    gen.add_argument("--config", type=Path, default=DEFAULT_SERVE_CONFIG,
                     help=f"engine or Serve config YAML (default: deploy/{DEFAULT_SERVE_CONFIG.name}, the service's)")
    gen.add_argument("--policy", type=Path, default=None, help="routing policy YAML (default: the shipped one)")
    gen.add_argument("--json", action="store_true", help="one JSON object with the statistics")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="benchmark methods side by side on Spec-Bench-format prompts")
    bench.add_argument("--prompts", type=Path, required=True, help="JSONL in Spec-Bench's format")
    bench.add_argument("--per-category", type=_positive_int, default=5)
    bench.add_argument("--categories", default=None, help="comma-separated subset of categories")
    bench.add_argument("--max-tokens", type=_positive_int, default=128)
    bench.add_argument("--methods", default="plain,ngram,hf,hf-pld")
    bench.add_argument("--out", type=Path, required=True)
    bench.add_argument("--config", type=Path, default=None, help="engine or Serve config YAML")
    bench.add_argument("--warmup", type=int, default=1, help="prompts run per method before timing")
    bench.add_argument("--no-verify-curve", action="store_true", help="skip the T(1+k)/T(1) curve")
    bench.add_argument("--policy", type=Path, default=None, help="routing policy YAML of the router method")
    bench.add_argument("--heldout-mod", type=_positive_int, default=None,
                       help="only question_id %% N == 0: the split the classifier never trained on")
    bench.add_argument("--order", choices=("category", "file"), default="category",
                       help="the selected prompts by category (default) or in file order: a workload whose "
                            "requests must run as a service would see them (bench/workloads/)")
    bench.add_argument("--prime", type=_non_negative_int, default=0,
                       help="run the first N prompts through every method untimed first: what learns from "
                            "traffic (the suffix drafter's memory, the router's statistics) starts warm")
    bench.add_argument("--concurrency", default=None, metavar="C1,C2,...",
                       help="closed-loop client counts: run the methods (plain, drafters, router, plain-serial, "
                            "llama-cpp-server[-ngram]) "
                            "under concurrent load instead, and report throughput and latency per level")
    bench.add_argument("--rounds", type=_positive_int, default=1,
                       help="under --concurrency: run each method this many times per level, the order rotated "
                            "each round, and report its fastest round (on a machine whose speed drifts)")
    bench.add_argument("--llama-cpp", type=Path, default=None, metavar="DIR",
                       help="llama.cpp's binaries, for methods llama-cpp, llama-cpp-ngram, llama-cpp-lookup "
                            "(and llama-cpp-server, llama-cpp-server-ngram under --concurrency; "
                            "default: $LLAMA_CPP_BIN)")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="0 (default): greedy, every output checked against plain's; above 0: sampled, "
                            "the same seed per prompt for every method")
    bench.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling of a sampled run")
    bench.add_argument("--seed", type=int, default=0, help="a sampled run's prompt i draws from seed + i")
    bench.set_defaults(func=cmd_bench)

    load = sub.add_parser("load", help="concurrent streaming clients against a running server")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--prompts", type=Path, required=True, help="JSONL in Spec-Bench's format")
    load.add_argument("--per-category", type=_positive_int, default=5)
    load.add_argument("--heldout-mod", type=_positive_int, default=None)
    load.add_argument("--clients", default="8", help="comma-separated client counts, run one after another")
    load.add_argument("--duration", type=float, default=60.0, help="seconds per mode")
    load.add_argument("--max-tokens", type=_positive_int, default=128)
    load.add_argument("--speculation", default="none,auto", help="comma-separated modes, run one after another")
    load.add_argument("--model", default=None)
    load.add_argument("--turns", type=_positive_int, default=1,
                      help="requests per conversation: each later turn carries the earlier ones and their answers")
    load.add_argument("--think", type=float, default=0.0, metavar="SECONDS",
                      help="a client's pause before each later turn of a conversation (its user reading)")
    load.add_argument("--long-prompt-tokens", type=_positive_int, default=None,
                      help="send one prompt of about this many tokens a third into each run: do the other "
                           "streams stall while it is prefilled?")
    load.add_argument("--out", type=Path, required=True)
    load.set_defaults(func=cmd_load)

    policy = sub.add_parser("policy", help="routing policy tools")
    policy_sub = policy.add_subparsers(dest="policy_command", required=True)
    check = policy_sub.add_parser("check", help="validate a policy YAML file (exit 2 when invalid)")
    check.add_argument("file", type=Path, metavar="FILE.yaml")
    check.add_argument(
        "--drafters", default=None,
        help=f"comma-separated drafters the engine has (default: those of deploy/{DEFAULT_SERVE_CONFIG.name}, "
             f"plus {PLAIN})",
    )
    check.set_defaults(func=cmd_policy_check)

    tc = sub.add_parser("train-classifier", help="train the domain classifier (held-out split never trained on)")
    tc.add_argument("--data", type=Path, action="append", required=True,
                    help="JSONL: Spec-Bench (question_id, category, turns) or {text, domain} lines (repeatable)")
    tc.add_argument("--out", type=Path, required=True, help="folder for the artefact and its CARD.md")
    tc.add_argument("--holdout-mod", type=_positive_int, default=5,
                    help="question_id %% N == 0 is held out: never trained on, scored (default 5)")
    tc.set_defaults(func=cmd_train_classifier)

    td = sub.add_parser("train-drafter", help="train a drafter on the target's features (EAGLE-1 head, Medusa-1 "
                                              "heads, a distilled small model)")
    td.add_argument("--kind", default="eagle", help="eagle, medusa or model")
    td.add_argument("--target", default=DEFAULT_TARGET_MODEL, help="the target model (default: the shipped one)")
    td.add_argument("--data", required=True,
                    help="comma list of sources: stdlib (Python's standard library source), pydoc (Python's "
                         "documentation topics), chat:PATH.jsonl ({prompt, answer} lines, e.g. from gen-answers; never "
                         "held-out Spec-Bench); NAME*W weights a source's share (default 1)")
    td.add_argument("--out", type=Path, required=True,
                    help="drafter folder: config.json, the weights (safetensors), CARD.md")
    # defaults None: each kind's own default (training/eagle.py, medusa.py, model.py) applies
    td.add_argument("--max-tokens", type=_positive_int, default=None, help="corpus size cap (tokens; default 1M)")
    td.add_argument("--draft-vocab", type=_non_negative_int, default=None,
                    help="rows of the draft head: the most frequent corpus tokens (0: all; default 8192)")
    td.add_argument("--chunk-len", type=_positive_int, default=None, help="tokens per target forward (features)")
    td.add_argument("--steps", type=_positive_int, default=None, help="default 2000")
    td.add_argument("--batch", type=_positive_int, default=None)
    td.add_argument("--seq-len", type=_positive_int, default=None, help="positions per training window")
    td.add_argument("--lr", type=float, default=None, help="peak learning rate (AdamW; eagle 1e-4, medusa 1e-3)")
    td.add_argument("--warmup", type=_non_negative_int, default=None, help="warmup steps (default: 5%% of --steps)")
    td.add_argument("--weight-decay", type=float, default=None)
    td.add_argument("--grad-clip", type=float, default=None)
    td.add_argument("--seed", type=int, default=None)
    td.add_argument("--device", default=None, help="torch device for the target and the training (cpu, cuda)")
    td.add_argument("--save-every", type=_positive_int, default=None, help="checkpoint every N steps (default 500)")
    td.add_argument("--stop-at", type=_positive_int, default=None,
                    help="stop after step N with a checkpoint (the schedule still spans --steps); --resume continues")
    td.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    td.add_argument("--eval-windows", type=_non_negative_int, default=None, help="held-out windows for the report")
    td.add_argument("--eval-data", default=None,
                    help="sources (as --data) of separate held-out text, e.g. chat: answers to prompts never "
                         "trained on; default: a random share of --data's windows, which flatters a drafter")
    td.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="dtype of the saved drafter weights (training is float32)")
    eagle = td.add_argument_group("eagle")
    eagle.add_argument("--w-cls", type=float, default=None, help="weight of the cross-entropy term (EAGLE: 0.1)")
    eagle.add_argument("--noise", type=float, default=None, help="uniform noise U(-x, x) on input features (0.1)")
    eagle.add_argument("--train-head", action="store_true", help="train the draft head too (default: frozen)")
    eagle.add_argument("--init", default=None,
                       help="target (default): an identity layer reading with the target's last layer's weights; "
                            "random: torch's; or an EAGLE checkpoint folder to fine-tune from")
    eagle.add_argument("--unroll", type=_positive_int, default=None,
                       help="draft steps trained per position, each fed the head's own features (default 1: "
                            "EAGLE-1; 2-3: the training-time test of HASS / EAGLE-3)")
    medusa = td.add_argument_group("medusa")
    medusa.add_argument("--num-heads", type=_positive_int, default=None, help="heads (default 3)")
    medusa.add_argument("--decay", type=float, default=None, help="head i's loss weight decay^i (Medusa: 0.8)")
    medusa.add_argument("--num-layers", type=_positive_int, default=None,
                        help="medusa: residual blocks per head (default 1); model: decoder layers (default 2)")
    td.add_argument("--features", default=None,
                    help="an earlier run's train_state/features.safetensors instead of running the target")
    model = td.add_argument_group("model")
    model.add_argument("--init-layers", default=None,
                       help="the target's layers the model starts from, comma list (default: the first "
                            "--num-layers - 1 and the last)")
    td.set_defaults(func=cmd_train_drafter)

    ga = sub.add_parser("gen-answers", help="the target's answers to prompts: chat data for train-drafter")
    ga.add_argument("--prompts", type=Path, action="append", required=True,
                    help="JSONL: Spec-Bench questions (first turn, train split only) or {prompt} lines (repeatable)")
    ga.add_argument("--out", type=Path, required=True, help="JSONL of {prompt, answer} lines (continued if present)")
    ga.add_argument("--target", default=DEFAULT_TARGET_MODEL, help="the target model (default: the shipped one)")
    ga.add_argument("--max-tokens", type=_positive_int, default=256, help="answer length cap (tokens)")
    ga.add_argument("--batch", type=_positive_int, default=8, help="prompts per generate call")
    ga.add_argument("--max-prompt-tokens", type=_positive_int, default=1024, help="longer prompts are skipped")
    ga.add_argument("--heldout-mod", type=_positive_int, default=5,
                    help="Spec-Bench question_id %% N == 0 is held out: never answered (default 5)")
    ga.add_argument("--limit", type=_positive_int, default=None, help="answer at most the first N prompts")
    ga.add_argument("--temperature", type=float, default=0.0,
                    help="0 (default): greedy answers; > 0: sample from the target's distribution at this temperature")
    ga.add_argument("--samples", type=_positive_int, default=1,
                    help="answers per prompt (more than 1 needs --temperature > 0)")
    ga.add_argument("--seed", type=int, default=0, help="seeds the sampling")
    ga.add_argument("--device", default="cpu")
    ga.set_defaults(func=cmd_gen_answers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ConfigError, ServeError, RequestError) as e:  # the user's mistake: one line, exit status 2
        print(f"specroute {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
