"""`specroute bench --concurrency 1,2,4,8,16`: throughput and latency under concurrent load.

Closed loop, in-process: at concurrency c, c clients each send their next prompt the moment their
last one finishes, until every prompt has run; every method gets the same prompts in the same
order. Methods:
  plain         continuous batching without drafts (the baseline each speedup is relative to)
  NAME          continuous batching, every request drafting with NAME at its static draft_len
  router        continuous batching under the router (per request and step: drafter and k, capped
                by the batch's goodput rule); one router for the whole run, warm after level one
  plain-serial  one sequence per target forward, requests interleaved step by step: the
                engine without batching
  llama-cpp-server, llama-cpp-server-ngram  llama.cpp's server on the target's GGUF file, one
                slot per client, plain or with its n-gram speculation, the same closed loop over
                HTTP (bench/llama_server.py); its outputs come from other kernels, not compared
With `rounds` > 1 every level runs each method that many times, the methods' order rotated each
round, and reports each method's fastest round (a run of the same requests is only slowed down
by what else the machine does) with every round's tokens/s beside it.
Greedy, every request's output is compared with its single-request plain output; sampled, each
request draws from its own seed (the same for every method) and plain's outputs are compared (equal
where the target computes a row alike in any batch, as int4 and bfloat16 targets do), while a
drafting method's are only distributed as plain's.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from bench.llama_server import SERVER_MODES, LlamaServer
from bench.methods import TrafficMemories, token_checked
from bench.prompts import BenchPrompt
from workers.batch import BatchEngine
from workers.config import PLAIN
from workers.engine import Generation, SpecEngine, StepOrder
from workers.routing import RoutedBatch, RoutedStep, Router
from workers.sampling import SamplingParams
from workers.structured import OutputFormat

PLAIN_METHOD, SERIAL_METHOD, ROUTER_METHOD = "plain", "plain-serial", "router"
PLAIN_METHODS = (PLAIN_METHOD, SERIAL_METHOD)  # outputs compared with plain decoding alone, sampled too


@dataclass(frozen=True)
class Request:
    prompt: BenchPrompt
    prompt_ids: list[int]
    seed: int | None = None  # a sampled request's own seed, the same for every method
    prediction: tuple[int, ...] = ()  # the prompt's predicted output (BenchPrompt.prediction), as token ids
    output_format: OutputFormat | None = None  # what the output must match (BenchPrompt.output_format)

    def params(self, params: SamplingParams) -> SamplingParams:
        return replace(params, prediction=self.prediction, output_format=self.output_format,
                       **({} if self.seed is None else {"seed": self.seed}))


@dataclass(frozen=True)
class ServerPeer:
    """Where llama.cpp's server methods find it, and what each of its slots must hold."""

    directory: Path  # llama.cpp's binaries
    gguf: Path  # the target's file
    threads: int  # as our engine's
    slot_context: int  # the longest prompt plus max_tokens


@dataclass
class _Timing:
    """One request's clock: sent, first token, finished (perf_counter seconds)."""

    sent: float
    first: float | None = None
    done: float | None = None
    num_tokens: int = 0


@dataclass(frozen=True)
class LevelResult:
    tokens_per_s: float  # every request's new tokens over the level's wall time
    speedup: float  # tokens_per_s over plain's at the same concurrency
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float  # per request: (finish - first token) / (tokens - 1)
    tpot_p99: float
    mean_batch_size: float  # requests per target forward
    host_ms_per_step: float | None  # the wall time around the target forwards, per step: scheduling,
    # drafting, routing, sampling, verification (None: plain-serial, whose steps do not split it out)
    num_mismatches: int | None  # requests whose output differs from their single-request plain output,
    # in the round that differs most (None: not compared, a sampled drafting method's)
    wall_s: float
    tokens_per_s_rounds: list[float]  # every round's, in order; the fields above are the fastest round's


@dataclass
class _Run:
    outputs: dict[int, list[int]]  # request index -> tokens
    timings: list[_Timing]
    batch_sizes: list[float]
    wall_s: float
    forward_s: float | None  # in target forwards (None: not measured)
    num_forwards: int


@dataclass
class _Step:
    """What one step of a method did."""

    batch_size: int  # requests in the forward (0: none ran)
    emitted: list[tuple[Any, int]]  # (request handle, tokens emitted)
    forward_s: float | None  # in target forwards (None: not measured)
    num_forwards: int


def check_concurrency_methods(methods: Sequence[str], engine_drafters: Sequence[str],
                              llama_cpp: Path | None = None, gguf: Path | None = None) -> list[str]:
    """The methods to run, plain first; llama.cpp's server modes only with a llama.cpp build
    (`llama_cpp`, its binaries' directory) and a GGUF target."""
    valid = [PLAIN_METHOD, *engine_drafters, ROUTER_METHOD, SERIAL_METHOD, *SERVER_MODES]
    for name in methods:
        if name not in valid:
            raise ValueError(f"unknown method {name!r} under --concurrency; valid methods: {', '.join(valid)}")
    for name in (m for m in methods if m in SERVER_MODES):
        if llama_cpp is None:
            raise ValueError(f"method {name!r} needs a llama.cpp build: pass --llama-cpp DIR or set "
                             "LLAMA_CPP_BIN (docs/benchmarks.md, 'Building llama.cpp')")
        if not (llama_cpp / "llama-server").is_file():
            raise ValueError(f"method {name!r}: no llama-server in {llama_cpp}")
        if gguf is None:
            raise ValueError(f"method {name!r} serves the target's GGUF file; the configured target is not one")
    return list(dict.fromkeys([PLAIN_METHOD, *methods]))


def run_levels(
    engine: SpecEngine, router: Router | None, requests: Sequence[Request], methods: Sequence[str],
    levels: Sequence[int], params: SamplingParams, reference: Sequence[list[int]], peer: ServerPeer | None = None,
    rounds: int = 1,
) -> dict[str, dict[str, LevelResult]]:
    """summary.concurrency: per level, per method. `reference`: each request's plain output alone
    (with its own seed, sampled); `peer`: llama.cpp, for its server's methods; `rounds`: runs of
    each method per level (the fastest reported)."""
    out: dict[str, dict[str, LevelResult]] = {}
    memories = TrafficMemories(engine)
    for c in levels:
        runs: dict[str, list[_Run]] = {m: [] for m in methods}
        for r in range(rounds):
            for method in [*methods[r % len(methods):], *methods[: r % len(methods)]]:
                memories.reset()  # each run learns from its own requests only (bench/methods.py)
                with memories.of(method):
                    runs[method].append(_run(engine, router, requests, params, c, method, peer))
        base = _tokens_per_s(max(runs[PLAIN_METHOD], key=_tokens_per_s))
        out[str(c)] = {m: _result(each, base, reference if _compared(m, params, engine) else None)
                       for m, each in runs.items()}
    return out


def _compared(method: str, params: SamplingParams, engine: SpecEngine) -> bool:
    """Whether a method's outputs are compared with each request's plain output alone: where they
    must repeat its tokens (`token_checked`), and plain decoding's always."""
    return method not in SERVER_MODES and (method in PLAIN_METHODS or token_checked(method, params, engine.config))


def _run(engine: SpecEngine, router: Router | None, requests: Sequence[Request], params: SamplingParams, c: int,
         method: str, peer: ServerPeer | None = None) -> _Run:
    if method in SERVER_MODES:
        assert peer is not None
        return _served(peer, SERVER_MODES[method], requests, params, c)
    if method == SERIAL_METHOD:
        return _serial(engine, requests, params, c)
    if method == ROUTER_METHOD:
        assert router is not None
        return run_routed(RoutedBatch(router), requests, params, c)
    order = StepOrder() if method == PLAIN_METHOD else StepOrder(method, engine.default_draft_len(method))
    return _batched(BatchEngine(engine), requests, params, c, order)


def _tokens_per_s(run: _Run) -> float:
    return sum(t.num_tokens for t in run.timings) / run.wall_s


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (inclusive method; 0.0 of none)."""
    if not values:
        return 0.0
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q) - 1]


def _result(runs: list[_Run], plain_tokens_per_s: float, reference: Sequence[list[int]] | None) -> LevelResult:
    """The fastest of a method's rounds, its mismatches counted over every round."""
    run = max(runs, key=_tokens_per_s)
    ttft = [t.first - t.sent for t in run.timings if t.first is not None]
    tpot = [(t.done - t.first) / (t.num_tokens - 1) for t in run.timings
            if t.first is not None and t.done is not None and t.num_tokens > 1]
    tps = _tokens_per_s(run)
    return LevelResult(
        tokens_per_s=tps, speedup=tps / plain_tokens_per_s,
        ttft_p50=percentile(ttft, 50), ttft_p99=percentile(ttft, 99),
        tpot_p50=percentile(tpot, 50), tpot_p99=percentile(tpot, 99),
        mean_batch_size=statistics.fmean(run.batch_sizes) if run.batch_sizes else 0.0,
        host_ms_per_step=(None if run.forward_s is None
                          else 1e3 * (run.wall_s - run.forward_s) / max(1, run.num_forwards)),
        num_mismatches=None if reference is None else max(
            sum(r.outputs[i] != ref for i, ref in enumerate(reference)) for r in runs),
        wall_s=run.wall_s, tokens_per_s_rounds=[_tokens_per_s(r) for r in runs],
    )


def _closed_loop(
    requests: Sequence[Request], concurrency: int, send: Callable[[Request], Any],
    step: Callable[[], _Step], output: Callable[[Any], list[int]],
) -> _Run:
    """Drive `step` until every request finished, keeping `concurrency` in flight. `send` starts a
    request and returns its handle; a handle counts as finished when `output` of it is final (its
    `.finished`)."""
    queue = deque(enumerate(requests))
    timings: list[_Timing] = [_Timing(0.0) for _ in requests]
    handles: dict[Any, int] = {}
    outputs: dict[int, list[int]] = {}
    batch_sizes: list[float] = []
    forward_s: float | None = 0.0
    num_forwards = 0
    t0 = time.perf_counter()

    def send_next() -> None:
        i, request = queue.popleft()
        timings[i].sent = time.perf_counter()
        handles[send(request)] = i

    for _ in range(min(concurrency, len(queue))):
        send_next()
    while handles:
        done = step()
        now = time.perf_counter()
        if done.batch_size:
            batch_sizes.append(done.batch_size)
        forward_s = None if forward_s is None or done.forward_s is None else forward_s + done.forward_s
        num_forwards += done.num_forwards
        for handle, n in done.emitted:
            t = timings[handles[handle]]
            if n and t.first is None:
                t.first = now
            t.num_tokens += n
            if handle.finished:
                t.done = now
                outputs[handles.pop(handle)] = output(handle)
                if queue:
                    send_next()
    return _Run(outputs, timings, batch_sizes, time.perf_counter() - t0, forward_s, num_forwards)


def _batched(batch: BatchEngine, requests: Sequence[Request], params: SamplingParams, concurrency: int,
             order: StepOrder) -> _Run:
    def step() -> _Step:
        decoding = batch.schedule()
        done = batch.step({g: order for g in decoding})
        return _Step(done.batch_size, [(g, st.num_emitted) for g, st in done.stats], done.forward_s,
                     int(done.num_rows > 0))

    def output(gen: Generation) -> list[int]:
        ids = gen.output_ids
        gen.close()
        return ids

    return _closed_loop(requests, concurrency,
                        lambda r: batch.add(r.prompt_ids, r.params(params), domain=r.prompt.category), step, output)


def run_routed(batch: RoutedBatch, requests: Sequence[Request], params: SamplingParams, concurrency: int,
               on_step: Callable[[RoutedStep], None] | None = None) -> _Run:
    """The closed loop under the router; `on_step` sees every step."""

    def step() -> _Step:
        done = batch.step()
        if on_step is not None:
            on_step(done)
        return _Step(done.batch.batch_size, [(r, st.num_emitted) for r, st in done.stats], done.batch.forward_s,
                     int(done.batch.num_rows > 0))

    def output(routed: Any) -> list[int]:
        ids = routed.gen.output_ids
        routed.close()
        return ids

    return _closed_loop(requests, concurrency, lambda r: batch.add(r.prompt_ids, r.params(params), r.prompt.text),
                        step, output)


def _serial(engine: SpecEngine, requests: Sequence[Request], params: SamplingParams, concurrency: int) -> _Run:
    """One sequence per forward: each request prefilled on arrival, then a plain step each, in turn."""
    active: list[Generation] = []

    def send(r: Request) -> Generation:
        gen = engine.start(r.prompt_ids, r.params(params))
        active.append(gen)
        return gen

    def step() -> _Step:
        emitted = []
        for gen in list(active):
            emitted.append((gen, gen.step(PLAIN, 0).num_emitted))
            if gen.finished:
                active.remove(gen)
        return _Step(1 if emitted else 0, emitted, None, len(emitted))

    def output(gen: Generation) -> list[int]:
        ids = gen.output_ids
        gen.close()
        return ids

    return _closed_loop(requests, concurrency, send, step, output)


def _served(peer: ServerPeer, args: tuple[str, ...], requests: Sequence[Request], params: SamplingParams,
            concurrency: int) -> _Run:
    """The closed loop against llama.cpp's server (started with `args`): `concurrency` client
    threads, each sending its next request when its last one finishes."""
    queue = deque(enumerate(requests))
    lock = threading.Lock()
    timings = [_Timing(0.0) for _ in requests]
    outputs: dict[int, list[int]] = {}
    errors: list[Exception] = []
    with LlamaServer(peer.directory, peer.gguf, concurrency, peer.slot_context, peer.threads, args) as server:
        server.complete(requests[0].prompt_ids, replace(params, max_tokens=8))  # warm, untimed
        before = server.decode_counts()

        def client() -> None:
            while True:
                with lock:
                    if not queue or errors:
                        return
                    i, request = queue.popleft()
                timings[i].sent = time.perf_counter()
                try:
                    done = server.complete(request.prompt_ids, request.params(params))
                except Exception as e:  # the level fails; the other clients stop after their request
                    errors.append(e)
                    return
                timings[i].first, timings[i].done, timings[i].num_tokens = done.first, done.done, len(done.token_ids)
                outputs[i] = done.token_ids

        t0 = time.perf_counter()
        clients = [threading.Thread(target=client) for _ in range(min(concurrency, len(requests)))]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        wall_s = time.perf_counter() - t0
        if errors:
            raise errors[0]
        after = server.decode_counts()
    mean_batch = after.mean_batch_since(before)
    return _Run(outputs, timings, [] if mean_batch is None else [mean_batch], wall_s, None, 0)


def concurrency_section(summary: dict[str, dict[str, dict]]) -> list[str]:
    methods = list(dict.fromkeys(m for level in summary.values() for m in level))
    lines = ["| concurrency | method | tokens/s | speedup vs plain | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             "| mean batch | host ms / step | mismatches |", "|---|---|---|---|---|---|---|---|---|"]
    for c, level in summary.items():
        for m in methods:
            if (r := level.get(m)) is None:
                continue
            spread = r.get("tokens_per_s_rounds", [])
            rounds = f" ({min(spread):.1f}-{max(spread):.1f})" if len(spread) > 1 else ""
            lines.append(f"| {c} | {m} | {r['tokens_per_s']:.1f}{rounds} | {r['speedup']:.2f}x | "
                         f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {1e3 * r['tpot_p50']:.0f} / "
                         f"{1e3 * r['tpot_p99']:.0f} | {r['mean_batch_size']:.1f} | "
                         f"{_or_dash(r['host_ms_per_step'], '.1f')} | {_or_dash(r['num_mismatches'], 'd')} |")
    return lines


def _or_dash(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def plot_throughput(summary: dict[str, dict[str, dict]], path: Path) -> Path:
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    levels = [int(c) for c in summary]
    for m in dict.fromkeys(m for level in summary.values() for m in level):
        ax.plot(levels, [summary[str(c)][m]["tokens_per_s"] for c in levels], marker="o", label=m)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent clients (closed loop)")
    ax.set_ylabel("tokens / s (all clients)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(path, dpi=110)
    return path


def as_json(summary: dict[str, dict[str, LevelResult]]) -> dict[str, dict[str, dict]]:
    return {c: {m: asdict(r) for m, r in level.items()} for c, level in summary.items()}
