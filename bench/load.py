"""`specroute load`: concurrent streaming clients against a running SpecRoute server.

Each client loops over Spec-Bench prompts until the deadline, streaming chat completions and
timing them the way vLLM's serving benchmark does: time to first token (TTFT), the gaps between
streamed chunks (ITL; a speculative step sends its tokens in one chunk), time per output token
after the first (TPOT) and end-to-end latency. Runs with `--speculation none` and `auto` against
the same server give the side-by-side throughput of plain and speculative serving.

With `turns` > 1 each client holds conversations: a prompt, then follow-ups that carry the
earlier turns and answers, as a chat client sends them; the report gives the share of the later
turns' prompt tokens found in a replica's prefix cache and their TTFT, which is what sending a
conversation back to the replica holding it (`replica_routing`) is for. `think_s` pauses a client
before each later turn, as its user reads the answer: meanwhile the other clients' requests move
the replicas' queues, as in served traffic (a closed loop without pauses sends the next turn at
once, to the replica that has just freed a slot, which a least-loaded choice then prefers anyway).

A long prompt (`long_prompt`) can be sent once, a third into the run, while the clients decode:
the gaps in the other streams while it is prefilled show whether it stalls them (chunked
prefill should keep those gaps near the ordinary ITL).
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import requests

from bench.prompts import BenchPrompt


@dataclass
class RequestTiming:
    ok: bool
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_at: list[float] = field(default_factory=list)  # perf_counter() of each content chunk
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None
    sent_at: float = 0.0  # perf_counter() when the request was sent
    cached_tokens: int = 0  # of prompt_tokens, those a prefix cache held
    turn: int = 0  # the request's place in its conversation (0: its first)
    text: str = ""  # the answer, which the conversation's next turn carries

    @property
    def itl_s(self) -> list[float]:
        """The gaps between content chunks."""
        return [b - a for a, b in zip(self.chunk_at, self.chunk_at[1:])]

    def gaps(self, start: float, end: float, inside: bool = True) -> list[float]:
        """The gaps whose later chunk came in [start, end] (inside False: the others)."""
        return [b - a for a, b in zip(self.chunk_at, self.chunk_at[1:]) if (start <= b <= end) == inside]

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.completion_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass
class LoadArgs:
    url: str
    prompts: list[BenchPrompt]
    clients: int
    duration_s: float
    max_tokens: int
    speculation: str  # "auto", "none" or a drafter name
    model: str | None = None
    timeout_s: float = 300.0
    long_prompt: BenchPrompt | None = None  # sent once, at a third of the duration
    turns: int = 1  # requests per conversation: the prompt, then FOLLOW_UPS with the earlier turns
    think_s: float = 0.0  # a client's pause before a later turn (its user reading the answer)


# what a conversation's later turns ask, in turn
FOLLOW_UPS = ("Go on, in more detail.", "Now sum up your answers in one sentence.", "Give one more example.")


def long_prompt_text(prompts: list[BenchPrompt], num_tokens: int) -> BenchPrompt:
    """A prompt of about `num_tokens` tokens (English runs ~4 characters a token; the report gives
    the server's count) made of the benchmark prompts themselves, asked to be summarised."""
    parts, size, i = ["Summarize the following requests in two sentences."], 0, 0
    while size < 4 * num_tokens:
        text = prompts[i % len(prompts)].text
        parts.append(text)
        size += len(text) + 2
        i += 1
    return BenchPrompt("long", "long", "\n\n".join(parts)[: 4 * num_tokens])


def one_request(session: requests.Session, args: LoadArgs, prompt: BenchPrompt,
                messages: list[dict[str, str]] | None = None) -> RequestTiming:
    """One streamed chat request: `prompt`'s, or `messages` (a conversation's later turn)."""
    body = {
        "messages": messages or prompt.conversation(), "max_tokens": args.max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "speculation": {"drafter": args.speculation},
    }
    if args.model:
        body["model"] = args.model
    if prompt.prediction is not None:
        body["prediction"] = {"type": "content", "content": prompt.prediction}
    if prompt.response_format is not None:
        body["response_format"] = prompt.response_format.model_dump(by_alias=True, exclude_none=True)
    t0 = time.perf_counter()
    timing = RequestTiming(ok=False, sent_at=t0)
    try:
        with session.post(f"{args.url}/v1/chat/completions", json=body, stream=True, timeout=args.timeout_s) as r:
            if r.status_code != 200:
                return RequestTiming(ok=False, error=f"HTTP {r.status_code}: {r.text[:200]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                data = line[6:]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    return RequestTiming(ok=False, error=str(event["error"])[:200])
                now = time.perf_counter()
                if event.get("choices") and (content := event["choices"][0]["delta"].get("content")):
                    if timing.ttft_s is None:
                        timing.ttft_s = now - t0
                    timing.chunk_at.append(now)
                    timing.text += content
                if usage := event.get("usage"):
                    timing.prompt_tokens = usage["prompt_tokens"]
                    timing.completion_tokens = usage["completion_tokens"]
                    timing.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (requests.RequestException, ValueError) as e:
        return RequestTiming(ok=False, error=f"{type(e).__name__}: {e}"[:200])
    timing.e2e_s = time.perf_counter() - t0
    timing.ok = True
    return timing


def run_load(args: LoadArgs) -> dict:
    """Run the clients for `duration_s` (requests in flight at the deadline finish); the summary."""
    deadline = time.perf_counter() + args.duration_s
    timings: list[RequestTiming] = []
    lock = threading.Lock()
    cursor = [0]

    def client() -> None:
        with requests.Session() as session:
            while time.perf_counter() < deadline:
                with lock:
                    prompt = args.prompts[cursor[0] % len(args.prompts)]
                    cursor[0] += 1
                messages = prompt.conversation()
                for turn in range(args.turns):
                    if turn:
                        time.sleep(args.think_s)
                        if time.perf_counter() >= deadline:
                            break
                    timing = one_request(session, args, prompt, messages)
                    timing.turn = turn
                    with lock:
                        timings.append(timing)
                    if not timing.ok:
                        break
                    messages = [*messages, {"role": "assistant", "content": timing.text},
                                {"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]}]

    long: list[RequestTiming] = []

    def send_long(prompt: BenchPrompt) -> None:
        time.sleep(args.duration_s / 3)
        with requests.Session() as session:
            long.append(one_request(session, args, prompt))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, daemon=True) for _ in range(args.clients)]
    if args.long_prompt is not None:
        threads.append(threading.Thread(target=send_long, args=(args.long_prompt,), daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = summarize(timings, time.perf_counter() - t0, args)
    if long:
        summary["long_prompt"] = long_prompt_summary(long[0], timings)
    return summary


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def summarize(timings: list[RequestTiming], wall_s: float, args: LoadArgs) -> dict:
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s for t in ok if t.ttft_s is not None]
    itl = [gap for t in ok for gap in t.itl_s]
    tpot = [v for t in ok if (v := t.tpot_s) is not None]
    e2e = [t.e2e_s for t in ok if t.e2e_s is not None]
    tokens = sum(t.completion_tokens for t in ok)
    later = [t for t in ok if t.turn > 0]
    later_prompt = sum(t.prompt_tokens for t in later)
    return {
        "speculation": args.speculation, "clients": args.clients, "duration_s": args.duration_s,
        "wall_s": wall_s, "requests": len(timings), "errors": len(timings) - len(ok),
        "error_samples": [t.error for t in timings if not t.ok][:5],
        "completion_tokens": tokens, "tokens_per_s": tokens / wall_s if wall_s > 0 else None,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "tpot_p50_s": _pct(tpot, 50), "tpot_p99_s": _pct(tpot, 99),
        "e2e_p50_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99),
        "turns": args.turns, "prompt_tokens": sum(t.prompt_tokens for t in ok),
        "cached_tokens": sum(t.cached_tokens for t in ok),
        # a conversation's later turns: the share of their prompts found cached, their first tokens' wait
        "later_turns": len(later),
        "later_cached_share": sum(t.cached_tokens for t in later) / later_prompt if later_prompt else None,
        "later_ttft_p50_s": _pct([t.ttft_s for t in later if t.ttft_s is not None], 50),
    }


def long_prompt_summary(long: RequestTiming, others: list[RequestTiming]) -> dict:
    """The long request's own timings, and the other streams' gaps while it was prefilled (from
    sending it to its first token) against their gaps otherwise."""
    end = long.sent_at + (long.ttft_s if long.ttft_s is not None else 0.0)
    during = [g for t in others if t.ok for g in t.gaps(long.sent_at, end)]
    outside = [g for t in others if t.ok for g in t.gaps(long.sent_at, end, inside=False)]
    return {
        "ok": long.ok, "error": long.error, "prompt_tokens": long.prompt_tokens, "ttft_s": long.ttft_s,
        "e2e_s": long.e2e_s, "others_itl_during_prefill_p50_s": _pct(during, 50),
        "others_itl_during_prefill_p99_s": _pct(during, 99),
        "others_itl_during_prefill_max_s": max(during, default=None),
        "others_itl_outside_p99_s": _pct(outside, 99), "num_gaps_during_prefill": len(during),
    }


def write_load_report(runs: list[dict], out: Path, command: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    (out / "load.json").write_text(json.dumps({"runs": runs, "command": command}, indent=2))

    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v * 1e3:.0f}"

    lines = [
        "| speculation | clients | requests | errors | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| TPOT p50 / p99 ms | e2e p50 / p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        lines.append(
            f"| {r['speculation']} | {r['clients']} | {r['requests']} | {r['errors']} | {r['tokens_per_s']:.1f} "
            f"| {ms(r['ttft_p50_s'])} / {ms(r['ttft_p99_s'])} | {ms(r['itl_p50_s'])} / {ms(r['itl_p99_s'])} "
            f"| {ms(r['tpot_p50_s'])} / {ms(r['tpot_p99_s'])} | {ms(r['e2e_p50_s'])} / {ms(r['e2e_p99_s'])} |"
        )
    for r in runs:
        if r.get("later_turns"):
            lines += ["", (
                f"{r['speculation']}, {r['clients']} clients, conversations of {r['turns']} turns: "
                f"{r['later_turns']} later turns found {100 * r['later_cached_share']:.0f}% of their prompt tokens "
                f"cached, TTFT p50 {ms(r['later_ttft_p50_s'])} ms")]
        if (long := r.get("long_prompt")) is not None:
            lines += ["", (
                f"{r['speculation']}, {r['clients']} clients: a {long['prompt_tokens']}-token prompt "
                f"({'ok' if long['ok'] else long['error']}) had its first token after {ms(long['ttft_s'])} ms; "
                f"the other streams' gaps meanwhile: p50 {ms(long['others_itl_during_prefill_p50_s'])}, p99 "
                f"{ms(long['others_itl_during_prefill_p99_s'])}, max {ms(long['others_itl_during_prefill_max_s'])} ms "
                f"({long['num_gaps_during_prefill']} gaps), against p99 {ms(long['others_itl_outside_p99_s'])} ms "
                "otherwise")]
    report = out / "load.md"
    report.write_text("\n".join(["# SpecRoute load run", "", *lines, "", "```", command, "```", ""]))
    return report

