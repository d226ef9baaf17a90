"""DIR/report.md and PNG plots from a results dict (exactly what results.json holds, so a report
can be rebuilt from the file alone: `python -m bench.report DIR`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # the OO API: Agg canvas, no pyplot global state

from bench.summary import OVERALL, PLAIN_METHOD

TABLE_HEADER = "| category | method | speedup | MAT | tok/s | lossless |"


def publish(text: str, results: dict[str, Any], out: Path | None) -> None:
    """A benchmark whose report is one text: printed, and saved under `out` when given."""
    print(text)
    if out is not None:
        save(out, results, text)


def save(out: Path, results: dict[str, Any], text: str) -> None:
    """DIR/results.json and DIR/report.md of a benchmark whose report is one text."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "report.md").write_text(text + "\n")


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def summary_table(results: dict) -> list[str]:
    lines = [TABLE_HEADER, "|---|---|---:|---:|---:|:---:|"]
    for category, methods in results["summary"].items():
        for method, s in methods.items():
            name = f"**{category}**" if category == OVERALL else category
            lines.append(
                f"| {name} | {method} | {_fmt(s['speedup'], '.2f')}x | {_fmt(s['mat'], '.2f')} "
                f"| {_fmt(s['tokens_per_s'], '.1f')} | {_lossless(s['lossless'])} |"
            )
    return lines


def latency_table(results: dict) -> list[str]:
    """Per category and method of our engine: time to first tokens, time per token after it,
    the decode phase's speedup (prefill excluded), the first step's proposing (a drafter that
    keeps its own state catches up on the prompt there), and a step's draft and verify time."""
    lines = ["| category | method | TTFT s | ITL ms | decode speedup | first draft ms | draft ms / step "
             "| verify ms / step |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for category, methods in results["summary"].items():
        for method, s in methods.items():
            if s.get("ttft_s") is None:
                continue
            name = f"**{category}**" if category == OVERALL else category
            lines.append(
                f"| {name} | {method} | {_fmt(s['ttft_s'], '.2f')} | {_fmt(_ms(s['itl_s']), '.1f')} "
                f"| {_fmt(s['decode_speedup'], '.2f')}x | {_fmt(s['first_draft_ms'], '.1f')} "
                f"| {_fmt(s['draft_ms'], '.2f')} "
                f"| {_fmt(s['verify_ms'], '.1f')} |"
            )
    return lines if len(lines) > 2 else ["No method of this run reports its latency."]


def _lossless(value: bool | None) -> str:
    return "n/a" if value is None else "yes" if value else "**no**"


def sampled(results: dict) -> bool:
    return bool((results.get("sampling") or {}).get("temperature"))  # results before sampling runs: greedy


def sampling_text(results: dict) -> str:
    """How the run decoded: greedy, or sampled at a temperature with one seed per prompt."""
    if not sampled(results):
        return "greedy"
    sampling = results["sampling"]
    return (f"sampled at temperature {sampling['temperature']:g} (top-p {sampling.get('top_p', 1.0):g}, "
            f"seeds {sampling['seed']} + prompt index, the same for every method)")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def router_choice_table(runs: list[dict]) -> list[str]:
    """The router's steps per drafter in each category, and per context bucket it crossed."""
    routed = [r for r in runs if r.get("routing")]
    if not routed:
        return []
    lines = ["| category | steps by drafter (share) | steps by context bucket |", "|---|---|---|"]
    for category in dict.fromkeys(r["category"] for r in routed):
        by_drafter: dict[str, int] = {}
        by_bucket: dict[str, int] = {}
        for r in routed:
            if r["category"] != category:
                continue
            for drafter, _, steps in r["routing"]["schedule"]:
                by_drafter[drafter] = by_drafter.get(drafter, 0) + steps
            for span in r["routing"].get("context", []):
                by_bucket[span["bucket"]] = by_bucket.get(span["bucket"], 0) + span["num_steps"]
        total = sum(by_drafter.values()) or 1
        drafters = ", ".join(f"{d} {n / total:.0%}" for d, n in sorted(by_drafter.items(), key=lambda x: -x[1]))
        buckets = ", ".join(f"{b}: {n}" for b, n in by_bucket.items())
        lines.append(f"| {category} | {drafters} | {buckets} |")
    return lines


def draft_cost_section(runs: list[dict]) -> list[str]:
    """Per method of our engine: what proposing cost, per draft token and as a share of the
    method's wall time (a drafter that eats the gain shows here first)."""
    lines = ["| method | draft tokens | draft ms / token | share of wall time |", "|---|---:|---:|---:|"]
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method and r.get("draft_s") is not None]
        tokens = sum(r["num_draft_tokens"] or 0 for r in mine)
        if not mine or not tokens:
            continue
        draft_s, wall_s = sum(r["draft_s"] for r in mine), sum(r["wall_s"] for r in mine)
        lines.append(f"| {method} | {tokens} | {draft_s / tokens * 1e3:.3f} | {draft_s / wall_s:.1%} |")
    return lines if len(lines) > 2 else ["No method of this run drafted."]


def verify_curve_section(curve: dict | None) -> list[str]:
    if curve is None:
        return ["Not measured (--no-verify-curve)."]
    lines = [
        f"One target forward over 1 + k tokens after {curve['context_len']} cached tokens; "
        f"the fastest of {curve['reps']} interleaved repetitions.", "",
        "| k | T(1+k) ms | T(1+k)/T(1) |", "|---:|---:|---:|",
    ]
    points = zip(curve["ks"], curve["step_s"], curve["ratio"])
    lines += [f"| {k} | {t * 1e3:.2f} | {r:.2f} |" for k, t, r in points]
    b = curve["bandwidth_floor"]
    lines += [
        "",
        f"Bandwidth floor of the plain step: {b['weights_bytes'] / 1e6:.0f} MB of weights / "
        f"{b['bandwidth_gb_s']:.1f} GB/s (measured copy) = {b['floor_s'] * 1e3:.2f} ms; the plain step "
        f"takes {b['plain_step_s'] * 1e3:.2f} ms, so it runs at {b['floor_fraction']:.0%} of the "
        f"bandwidth limit.",
        "", "![verify curve](verify_curve.png)",
    ]
    return lines


def losslessness_section(results: dict) -> list[str]:
    """Greedy runs, and sampled ones whose seeded draws are keyed by position, check every output
    of our engine token by token against plain decoding's."""
    if not sampled(results):
        return mismatch_section(results["mismatches"])
    if results["sampling"].get("draws") != "position":
        return ["Not checked token by token: this run sampled with draws taken in turn (`seeded_draws: stream`)."]
    return mismatch_section(results["mismatches"], "output of our engine (seeded draws keyed by position)",
                            "plain sampling's with the same seed")


def mismatch_section(mismatches: list[dict], what: str = "greedy output",
                     reference: str = "plain decoding's") -> list[str]:
    if not mismatches:
        return [f"Every method's {what} equals {reference} on every prompt."]
    lines = [
        "| question | category | method | position | plain token | method token | top-2 gap | near-tie |",
        "|---|---|---|---:|---:|---:|---:|:---:|",
    ]
    for m in mismatches:
        lines.append(
            f"| {m['question_id']} | {m['category']} | {m['method']} | {m['position']} | {m['plain_token']} "
            f"| {m['method_token']} | {_fmt(m['top2_gap'], '.2e')} "
            f"| {'n/a' if m['top2_gap'] is None else 'yes' if m['near_tie'] else '**no**'} |"
        )
    lines += ["", "A near-tie (top-2 gap < 1e-3) can flip under a different kernel's rounding; a wide gap "
                  "at the first difference is a bug. llama.cpp's modes are compared with llama.cpp's plain "
                  "output (n/a: no gap of our target's explains them)."]
    return lines


def machine_section(machine: dict) -> list[str]:
    return [
        f"- CPU: {machine['cpu']} ({machine['cores']} cores, torch threads {machine['torch_threads']})",
        f"- GPU: {machine['gpu'] or 'none'}",
        f"- torch {machine['torch']}, transformers {machine['transformers']}, Python {machine['python']}",
        f"- {machine['platform']}",
    ]


def write_report(results: dict, out: Path) -> list[Path]:
    """Write report.md and the plots into out; returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in ("acceptance_by_position.png", "verify_curve.png"):  # a plot this run has no data for
        (out / stale).unlink(missing_ok=True)
    pngs = [plot_speedup(results, out / "speedup.png")]
    if acceptance := plot_acceptance(results, out / "acceptance_by_position.png"):
        pngs.append(acceptance)
    if results["verify_curve"] is not None:
        pngs.append(plot_verify_curve(results["verify_curve"], out / "verify_curve.png"))
    num_prompts = len({r["question_id"] for r in results["runs"]})
    lines = [
        "# SpecRoute benchmark", "",
        f"Target `{results['target']}` on {results['device']}; {num_prompts} prompts; {sampling_text(results)}, "
        f"at most {results['max_tokens']} new tokens; methods interleaved prompt by prompt after a warm-up.", "",
        "## Speedup by category", "",
        "Speedup = the method's tokens per second / plain decoding's, over the same prompts: plain's total "
        "wall time / the method's wherever the method emits plain's tokens (Spec-Bench's definition). "
        "MAT = new tokens / target forwards, bonus token included (hardware independent). "
        "Lossless = token-identical to plain decoding on every prompt (llama.cpp's modes: to llama.cpp's "
        "plain); n/a in a sampled run, whose outputs follow the target's distribution rather than plain's "
        "tokens (tests/ check that distribution per drafter).", "",
        *summary_table(results), "", "![speedup](speedup.png)", "",
    ]
    if acceptance:
        lines += [
            "## Acceptance by draft position", "",
            "Fraction of the steps that drafted a token at position i in which the target accepted it "
            "(and so every earlier one).", "", "![acceptance by position](acceptance_by_position.png)", "",
        ]
    lines += ["## Latency by category", "",
              "TTFT: from the request's start to its first step's tokens (the prefill included). ITL: the "
              "time per token after the first. Decode speedup: plain's time after its first tokens / the "
              "method's, over the same prompts. First draft: the first step's proposing, where a drafter "
              "with state of its own catches up on the prompt.", "", *latency_table(results), ""]
    if choices := router_choice_table(results["runs"]):
        lines += ["## The router's choices", "", *choices, ""]
    lines += ["## Drafting cost", "", *draft_cost_section(results["runs"]), "",
              "## Verification cost", "", *verify_curve_section(results["verify_curve"]), "",
              "## Losslessness", "", *losslessness_section(results), "",
              "## Machine", "", *machine_section(results["machine"]), "",
              "## Command", "", "```", results["command"], "```", ""]
    (out / "report.md").write_text("\n".join(lines))
    return [out / "report.md", *pngs]


def plot_speedup(results: dict, path: Path) -> Path:
    summary = results["summary"]
    categories = list(summary)
    methods = list(dict.fromkeys(m for c in categories for m in summary[c]))
    fig = Figure(figsize=(min(18.0, max(7.0, 0.4 * len(categories) * len(methods) + 2.0)), 4), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for j, method in enumerate(methods):
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(categories))]
        ys = [summary[c].get(method, {}).get("speedup") or 0.0 for c in categories]
        ax.bar(xs, ys, width, label=method, hatch=(None, "//", "..")[j // 10 % 3])  # 10 colours, then hatched
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")  # plain decoding
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel("speedup over plain (tokens/s)")
    ax.set_title(f"{results['target']}: speedup by category")
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: never over a bar
    fig.savefig(path, dpi=120)
    return path


def plot_acceptance(results: dict, path: Path) -> Path | None:
    """Per drafter method: accepted / drafted at each position, summed over its runs. None when no
    method exposes per-position counts (plain and transformers' peers do not)."""
    curves: dict[str, list[float]] = {}
    for method in dict.fromkeys(r["method"] for r in results["runs"]):
        accepted: list[int] = []
        drafted: list[int] = []
        for r in results["runs"]:
            if r["method"] != method or not r.get("drafted_per_position"):
                continue
            for i, (a, d) in enumerate(zip(r["accepted_per_position"], r["drafted_per_position"])):
                if i == len(drafted):
                    accepted.append(0)
                    drafted.append(0)
                accepted[i] += a
                drafted[i] += d
        if drafted and method != PLAIN_METHOD:
            curves[method] = [a / d for a, d in zip(accepted, drafted) if d]
    if not curves:
        return None
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    for i, (method, rates) in enumerate(curves.items()):  # the colour cycle has 10: then a new line style
        ax.plot(range(1, len(rates) + 1), rates, marker="o", linestyle=("-", "--", ":")[i // 10 % 3], label=method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted / drafted at this position")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


def plot_verify_curve(curve: dict, path: Path) -> Path:
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(curve["ks"], curve["ratio"], marker="o", label="T(1+k) / T(1)")
    b = curve["bandwidth_floor"]
    ax.axhline(b["floor_fraction"], color="gray", linestyle=":", label="bandwidth floor / T(1)")
    ax.set_xlabel("draft tokens verified, k")
    ax.set_ylabel("cost relative to a plain step")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Verification cost at {curve['context_len']} cached tokens")
    ax.legend(fontsize="small")
    fig.savefig(path, dpi=120)
    return path


if __name__ == "__main__":  # rebuild a report from DIR/results.json
    out_dir = Path(sys.argv[1])
    for written in write_report(json.loads((out_dir / "results.json").read_text()), out_dir):
        print(written)
