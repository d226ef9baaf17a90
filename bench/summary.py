"""Per-category and overall summaries of run records: speedup, MAT, tokens/s, losslessness."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from bench.records import MethodSummary, RunRecord

PLAIN_METHOD = "plain"
LLAMA_CPP_PLAIN = "llama-cpp"  # llama.cpp's plain decoding: the reference of its own modes
OVERALL = "overall"


def reference_method(method: str) -> str:
    """Whose output a method's greedy output must equal: plain decoding's, or for llama.cpp's
    modes (other kernels on the quantized weights) llama.cpp's own plain output."""
    return LLAMA_CPP_PLAIN if method.startswith(LLAMA_CPP_PLAIN) else PLAIN_METHOD


def summarize_group(records: Sequence[RunRecord], method: str, checked: bool = True) -> MethodSummary:
    """One method over one group of prompts; plain's records of the same prompts are the baseline.
    The speedup is the ratio of tokens per second, which is plain's wall time over the method's
    wherever the method emits plain's tokens (Spec-Bench's definition) and stays fair where the
    answers differ in length (llama.cpp, sampled runs). `checked`: the method's outputs must repeat
    its reference's tokens (greedy, or sampled with draws keyed by position, `token_checked`);
    otherwise it has no token-wise losslessness: its outputs follow the target's distribution."""
    plain = {r.question_id: r for r in records if r.method == PLAIN_METHOD}
    runs = [r for r in records if r.method == method and r.question_id in plain]
    ref = {r.question_id: r for r in records if r.method == reference_method(method)}
    wall_s = sum(r.wall_s for r in runs)
    plain_wall_s = sum(plain[r.question_id].wall_s for r in runs)
    plain_new = sum(plain[r.question_id].num_new_tokens for r in runs)
    num_new = sum(r.num_new_tokens for r in runs)
    steps = [r.num_steps for r in runs]
    num_steps = sum(s for s in steps if s is not None)
    timed = bool(runs) and all(r.ttft_s is not None for r in runs)
    decode_s = sum(r.wall_s - (r.ttft_s or 0.0) for r in runs)
    plain_decode_s = sum(plain[r.question_id].wall_s - (plain[r.question_id].ttft_s or 0.0) for r in runs)
    after_first = sum(r.num_new_tokens - 1 for r in runs)
    timed_steps = num_steps if timed and None not in steps and num_steps > 0 else 0
    return MethodSummary(
        speedup=num_new * plain_wall_s / (wall_s * plain_new) if wall_s > 0 and plain_new > 0 else None,
        mat=num_new / num_steps if runs and None not in steps and num_steps > 0 else None,
        tokens_per_s=num_new / wall_s if wall_s > 0 else None,
        lossless=(all(r.question_id in ref and r.token_ids == ref[r.question_id].token_ids for r in runs)
                  if checked else None),
        ttft_s=sum(r.ttft_s or 0.0 for r in runs) / len(runs) if timed else None,
        itl_s=decode_s / after_first if timed and after_first > 0 else None,
        decode_speedup=(plain_decode_s / decode_s if timed and decode_s > 0
                        and all(plain[r.question_id].ttft_s is not None for r in runs) else None),
        draft_ms=1e3 * sum(r.draft_s or 0.0 for r in runs) / timed_steps if timed_steps else None,
        first_draft_ms=1e3 * sum(r.first_draft_s or 0.0 for r in runs) / len(runs) if timed else None,
        verify_ms=1e3 * sum(r.verify_s or 0.0 for r in runs) / timed_steps if timed_steps else None,
    )


def summarize(records: Sequence[RunRecord], checked: Callable[[str], bool] = lambda method: True,
              ) -> dict[str, dict[str, MethodSummary]]:
    """{category (in order of appearance), then OVERALL: {method: MethodSummary}}; `checked`:
    which methods' outputs must repeat their reference's tokens (summarize_group)."""
    methods = list(dict.fromkeys(r.method for r in records))
    categories = list(dict.fromkeys(r.category for r in records))
    groups = {c: [r for r in records if r.category == c] for c in categories}
    groups[OVERALL] = list(records)
    return {name: {m: summarize_group(group, m, checked(m)) for m in methods} for name, group in groups.items()}
