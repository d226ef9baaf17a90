"""llama.cpp's server as the peer under concurrency: methods `llama-cpp-server` (plain decoding)
and `llama-cpp-server-ngram` (its n-gram speculation) of `specroute bench --concurrency`
(bench/concurrency.py runs the closed loop).

At level c a `llama-server` with c parallel slots (continuous batching, its default) serves the
requests our methods serve, on the target's own GGUF file with the same thread count. A prompt
goes as our token ids (the same chat template), greedy or with the request's own seed, at most
max_tokens new tokens, without llama.cpp's prompt cache (`cache_prompt: false`: our engine keeps
none across requests either). Tokens stream back, so TTFT and TPOT are read off the client's
clock as ours are; the mean batch is the server's own count of busy slots per decode. A server
starts per level (its slot count) and answers one request before the level is timed.

Build: `llama-server` beside the other llama.cpp binaries (docs/benchmarks.md, "Building llama.cpp").
"""

from __future__ import annotations

import json
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import requests
from prometheus_client.parser import text_string_to_metric_families

from bench.llama_cpp import LlamaCppError, crash_hint
from workers.sampling import SamplingParams

BINARY = "llama-server"
# method -> the server's own flags: plain decoding, and its n-gram speculation (prompt lookup)
SERVER_MODES: dict[str, tuple[str, ...]] = {
    "llama-cpp-server": (),
    "llama-cpp-server-ngram": ("--spec-type", "ngram-simple"),
}
_START_TIMEOUT_S = 120.0
_REQUEST_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Completion:
    """One request as the client saw it (perf_counter seconds)."""

    token_ids: list[int]
    first: float | None  # the first token's arrival
    done: float


class LlamaServer:
    """A `llama-server` process for one level: `slots` requests decode in one batch, each with room
    for `slot_context` tokens (prompt and output)."""

    def __init__(self, directory: Path, gguf: Path, slots: int, slot_context: int, threads: int,
                 args: tuple[str, ...] = ()) -> None:
        port = _free_port()
        self.cmd = [str(directory / BINARY), "-m", str(gguf), "-np", str(slots), "-c", str(slots * slot_context),
                    "-t", str(threads), "-tb", str(threads), "--host", "127.0.0.1", "--port", str(port),
                    "--metrics", "--no-webui", *args]
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise self._failed(f"exited with {self.proc.returncode}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        self.__exit__(None, None, None)
        raise self._failed(f"did not answer /health in {_START_TIMEOUT_S:.0f} s")

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def _failed(self, what: str) -> LlamaCppError:
        self.log.seek(0)
        code = self.proc.returncode if self.proc is not None else None
        return LlamaCppError(f"{' '.join(self.cmd)} {what}:\n{self.log.read()[-2000:]}{crash_hint(code)}")

    def complete(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """One request, streamed; raises LlamaCppError when the server fails it."""
        body = {"prompt": prompt_ids, "n_predict": params.max_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "stream": True, "cache_prompt": False,
                "return_tokens": True}
        if params.seed is not None:
            body["seed"] = params.seed
        token_ids: list[int] = []
        first = None
        with requests.post(f"{self.url}/completion", json=body, stream=True, timeout=_REQUEST_TIMEOUT_S) as r:
            if r.status_code != 200:
                raise LlamaCppError(f"llama-server answered {r.status_code}: {r.text[:500]}")
            for line in r.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[len(b"data: "):])
                if "error" in event:
                    raise LlamaCppError(f"llama-server failed a request: {event['error']}")
                if event.get("tokens"):
                    token_ids += event["tokens"]
                    first = first if first is not None else time.perf_counter()
                if event.get("stop"):
                    break
        return Completion(token_ids, first, time.perf_counter())

    def decode_counts(self) -> DecodeCounts:
        """Its decode calls so far and the slots busy in them (its /metrics)."""
        samples = {sample.name.removeprefix("llamacpp:"): sample.value
                   for family in text_string_to_metric_families(requests.get(f"{self.url}/metrics", timeout=10).text)
                   for sample in family.samples}
        decodes = samples.get("n_decode_total", 0.0)
        return DecodeCounts(decodes, samples.get("n_busy_slots_per_decode", 0.0) * decodes)


@dataclass(frozen=True)
class DecodeCounts:
    num_decodes: float
    num_busy_slots: float  # summed over the decodes

    def mean_batch_since(self, before: DecodeCounts) -> float | None:
        """Requests per decode between the two counts (None: no decode between them)."""
        decodes = self.num_decodes - before.num_decodes
        return (self.num_busy_slots - before.num_busy_slots) / decodes if decodes > 0 else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
