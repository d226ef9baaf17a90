"""The target's weight formats side by side: `python -m bench.weights`.

One process holds the target once per format (`target.weights`); prompt by prompt, every format
runs plain decoding and prompt lookup in turn, so drift on a shared machine hits them alike.
Reported per format: the plain step (decode only), prefill per prompt token, end-to-end tokens/s
(prefill included), prompt lookup's speedup, and on how many prompts prompt lookup's output
equals the same format's plain output (where not, bench's mismatch report names the tie); then
the verify curve T(1 + k) / T(1), the bytes a plain step streams with their bandwidth floor, and
the resident memory of a process holding the target in that format alone (a replica's share).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from bench.prompts import SPEC_BENCH, load_prompts
from bench.verify_cost import measure_verify_curve
from workers.config import EngineConfig, NgramDrafterConfig, TargetConfig
from workers.engine import GenerationResult, SpecEngine
from workers.sampling import SamplingParams

NO_DENSE_PREFILL = ":no-dense-prefill"  # a format's suffix: int4 prompt rows on the int4 kernel


def target_config(spec: str) -> TargetConfig:
    """A `--formats` entry: a `target.weights` value, int4 optionally with NO_DENSE_PREFILL."""
    weights = spec.removesuffix(NO_DENSE_PREFILL)
    return TargetConfig(weights=weights, dense_prefill=weights == spec)


def _decode_ms(r: GenerationResult) -> float:
    return (r.wall_s - r.prefill_s) / r.num_steps * 1e3


def _resident_mib(spec: str, prompt: str) -> float:
    """VmRSS of a fresh process that loaded the target as `spec` says and decoded a few tokens."""
    code = ("import torch, sys; torch.set_num_threads(2)\n"
            "from bench.weights import target_config\n"
            "from workers.config import EngineConfig\n"
            "from workers.engine import SpecEngine\n"
            "from workers.sampling import SamplingParams\n"
            f"e = SpecEngine.from_config(EngineConfig(target=target_config({spec!r}), drafters=[]))\n"
            "e.generate(e.encode(sys.argv[1]), SamplingParams(max_tokens=16))\n"
            "print(next(l for l in open('/proc/self/status') if l.startswith('VmRSS')).split()[1])\n")
    out = subprocess.run([sys.executable, "-c", code, prompt], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[-1]) / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--heldout-mod", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--formats", default="float32,int4",
                    help=f"target.weights values; int4{NO_DENSE_PREFILL}: int4 with its prompt rows on the int4 kernel")
    args = ap.parse_args()
    torch.set_num_threads(2)
    formats = args.formats.split(",")
    engines = {f: SpecEngine.from_config(EngineConfig(target=target_config(f), drafters=[NgramDrafterConfig()]))
               for f in formats}
    prompts = load_prompts(args.prompts, args.per_category, None, args.heldout_mod)
    params = SamplingParams(max_tokens=args.max_tokens)
    runs: dict[tuple[str, str], list[GenerationResult]] = {(f, m): [] for f in formats for m in ("plain", "ngram")}
    first = prompts[0].text
    for f in formats:  # warm-up
        engines[f].generate(engines[f].encode(first), SamplingParams(max_tokens=8))
    for p in prompts:
        for f in formats:
            ids = engines[f].encode(p.text)
            runs[f, "plain"].append(engines[f].generate(ids, params))
            runs[f, "ngram"].append(engines[f].generate(ids, params, drafter="ngram"))
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, greedy\n")
    print("| weights | plain step ms (median) | prefill ms / prompt token | plain tokens/s | ngram speedup "
          "| ngram = plain |")
    print("|---|---:|---:|---:|---:|:---:|")
    for f in formats:
        plain, ngram = runs[f, "plain"], runs[f, "ngram"]
        tokens = sum(len(r.token_ids) for r in plain)
        wall = sum(r.wall_s for r in plain)
        prefill = sum(r.prefill_s for r in plain) / sum(len(r.prompt_token_ids) for r in plain) * 1e3
        same = sum(a.token_ids == b.token_ids for a, b in zip(plain, ngram))
        print(f"| {f} | {statistics.median(_decode_ms(r) for r in plain):.1f} | {prefill:.2f} | {tokens / wall:.1f} "
              f"| {wall / sum(r.wall_s for r in ngram):.2f}x | {same}/{len(plain)} |")

    print("\n| weights | T(1) ms | T(2)/T(1) | T(6)/T(1) | weights MB a step | floor ms | resident MiB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for f in formats:
        curve = measure_verify_curve(engines[f].target.model, ks=(1, 5))
        (t1, t2, t6), floor = curve["step_s"], curve["bandwidth_floor"]
        print(f"| {f} | {t1 * 1e3:.1f} | {t2 / t1:.2f} | {t6 / t1:.2f} | {floor['weights_bytes'] / 1e6:.0f} "
              f"| {floor['floor_s'] * 1e3:.1f} | {_resident_mib(f, first):.0f} |")


if __name__ == "__main__":
    main()
