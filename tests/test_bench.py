"""`specroute bench`: end to end on the tiny random target, and the summary arithmetic."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from bench.lossless import find_mismatches, first_difference
from bench.methods import check_methods
from bench.prompts import load_prompts
from bench.records import RunRecord
from bench.report import TABLE_HEADER, mismatch_section
from bench.runner import BenchArgs, check_formats, run_bench
from bench.summary import OVERALL, summarize
from workers.config import EngineConfig, NgramDrafterConfig, PredictionDrafterConfig, SuffixDrafterConfig, TargetConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RESULT_KEYS = {"target", "device", "max_tokens", "sampling", "runs", "summary", "mismatches", "verify_curve",
               "machine", "command"}
RUN_KEYS = {"question_id", "category", "method", "token_ids", "num_new_tokens", "wall_s", "num_steps",
            "num_draft_tokens", "num_accepted_tokens", "accepted_per_position"}
METHODS = ["plain", "ngram", "self", "hf", "hf-pld", "hf-assisted"]


def write_questions(path: Path) -> Path:
    """2 categories x 2 questions (plus one more the per-category limit must drop), Spec-Bench format."""
    questions = [
        (1, "summarization", "Summarize: the cat sat on the mat. The cat sat on the mat again."),
        (2, "coding", "Write a Python function that adds two numbers."),
        (3, "summarization", "Summarize: rain fell all day; the river rose; the bridge closed."),
        (4, "coding", "Fix the bug: def f(x): return x +"),
        (5, "summarization", "A third summary the limit drops."),
    ]
    path.write_text("".join(
        json.dumps({"question_id": q, "category": c, "turns": [t, "a second turn, never used"]}) + "\n"
        for q, c, t in questions
    ))
    return path


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory, tiny_config: EngineConfig) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("bench")
    args = BenchArgs(
        prompts=write_questions(tmp / "q.jsonl"), per_category=2, max_tokens=16, methods=METHODS,
        out=tmp / "out", config=tiny_config, categories=None, warmup=1, verify_curve=True,
        command="specroute bench --test", verify_ks=[0, 1, 4], verify_reps=2,
    )
    return run_bench(args), args.out


def test_results_contract(bench_run: tuple[dict, Path]) -> None:
    results, out = bench_run
    on_disk = json.loads((out / "results.json").read_text())
    assert set(on_disk) == RESULT_KEYS
    assert on_disk["max_tokens"] == 16 and on_disk["device"] == "cpu"
    assert len(on_disk["runs"]) == 4 * len(METHODS)  # question 5 dropped by per_category
    assert {r["question_id"] for r in on_disk["runs"]} == {1, 2, 3, 4}
    for run in on_disk["runs"]:
        assert RUN_KEYS <= set(run)
        assert run["num_new_tokens"] == len(run["token_ids"]) <= 16
    assert list(on_disk["summary"]) == ["summarization", "coding", OVERALL]
    for by_method in on_disk["summary"].values():
        assert list(by_method) == METHODS
        assert set(by_method["plain"]) == {"speedup", "mat", "tokens_per_s", "lossless", "ttft_s", "itl_s",
                                           "decode_speedup", "draft_ms", "first_draft_ms", "verify_ms"}
        assert by_method["plain"]["ttft_s"] > 0 and by_method["plain"]["decode_speedup"] == 1.0
        assert by_method["hf"]["ttft_s"] is None  # transformers' generate does not say when its first token came
        assert by_method["plain"]["speedup"] == 1.0 and by_method["plain"]["mat"] == 1.0
        # decisive random logits: no near-ties, so every method must reproduce plain exactly
        assert all(s["lossless"] for s in by_method.values()), by_method
    assert on_disk["mismatches"] == []
    # the draft model equal to the target accepts everything; transformers' plain generate takes
    # one forward per token (the forward hook counts exactly)
    runs = {(r["question_id"], r["method"]): r for r in on_disk["runs"]}
    for q in (1, 2, 3, 4):
        assert on_disk["summary"][OVERALL]["self"]["mat"] > 1.0
        hf = runs[q, "hf"]
        assert hf["num_steps"] == hf["num_new_tokens"] and hf["num_draft_tokens"] == 0
        assert runs[q, "self"]["num_accepted_tokens"] == runs[q, "self"]["num_draft_tokens"]
        # the assistant is the target itself: transformers accepts every candidate too
        assisted = runs[q, "hf-assisted"]
        assert assisted["num_steps"] < assisted["num_new_tokens"]
        assert 0 < assisted["num_accepted_tokens"] <= assisted["num_draft_tokens"]
    curve = on_disk["verify_curve"]
    assert curve["ks"] == [0, 1, 4] and curve["ratio"][0] == 1.0
    assert set(curve["bandwidth_floor"]) == {"weights_bytes", "bandwidth_gb_s", "floor_s", "plain_step_s",
                                             "floor_fraction"}
    assert curve["bandwidth_floor"]["weights_bytes"] > 0 and curve["bandwidth_floor"]["bandwidth_gb_s"] > 0
    assert results["summary"] == on_disk["summary"]


def test_report_and_plots(bench_run: tuple[dict, Path]) -> None:
    _, out = bench_run
    report = (out / "report.md").read_text()
    assert TABLE_HEADER in report and "specroute bench --test" in report
    assert "| k | T(1+k) ms | T(1+k)/T(1) |" in report
    # what proposing cost, per drafting method of our engine: self drafted in this run, plain never does
    assert "| method | draft tokens | draft ms / token | share of wall time |" in report
    draft_rows = [line for line in report.splitlines() if line.startswith("| self |") and "%" in line]
    assert len(draft_rows) == 1 and not any(line.startswith("| plain |") and "%" in line for line in report.splitlines())
    # latency per category for our engine's methods; the router's steps by drafter and context bucket
    assert "| category | method | TTFT s | ITL ms | decode speedup |" in report
    assert any(line.startswith("| coding | self |") for line in report.splitlines())
    for name in ("speedup.png", "acceptance_by_position.png", "verify_curve.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name


def test_cli_bench(tmp_path: Path, tiny_config: EngineConfig, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import main

    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(tiny_config.model_dump(mode="json")))
    prompts = write_questions(tmp_path / "q.jsonl")
    common = ["bench", "--prompts", str(prompts), "--per-category", "1", "--max-tokens", "8",
              "--config", str(config), "--warmup", "0", "--no-verify-curve"]
    out = tmp_path / "out"
    assert main([*common, "--categories", "coding", "--methods", "plain,ngram", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(r["question_id"], r["method"]) for r in results["runs"]] == [(2, "plain"), (2, "ngram")]
    assert results["verify_curve"] is None and not (out / "verify_curve.png").exists()

    # the router: lossless, its decision recorded per run; --heldout-mod 2 keeps even question ids
    routed = tmp_path / "routed"
    assert main([*common, "--methods", "router", "--heldout-mod", "2", "--per-category", "2", "--out", str(routed)]) == 0
    results = json.loads((routed / "results.json").read_text())
    runs = [r for r in results["runs"] if r["method"] == "router"]
    assert [r["question_id"] for r in runs] == [2, 4] and not results["mismatches"]
    for r in runs:
        assert r["routing"]["domain"] in ("code", "summarization", "chat")
        assert sum(steps for _, _, steps in r["routing"]["schedule"]) == r["num_steps"]
        assert [span["bucket"] for span in r["routing"]["context"]] == ["0-512"]
    assert all(s["lossless"] for s in results["summary"]["overall"].values())
    report = (routed / "report.md").read_text()
    assert "| category | steps by drafter (share) | steps by context bucket |" in report
    assert any(line.startswith("| coding |") and "0-512:" in line for line in report.splitlines())

    assert main([*common, "--methods", "plain,ngarm", "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "ngarm" in err and "ngram" in err  # names the bad method and lists the valid ones
    assert not (tmp_path / "bad").exists()


def test_cli_bench_primes_a_workload_in_file_order(tmp_path: Path, tiny_config: EngineConfig) -> None:
    """--order file keeps the file's order; --prime N runs the first N untimed, feeding each
    method's own suffix memory; a `messages` line is rendered as the whole conversation."""
    from router.cli import main

    engine = tiny_config.model_copy(update={"drafters": [*tiny_config.drafters, SuffixDrafterConfig()]})
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(engine.model_dump(mode="json")))
    lines = [{"question_id": f"q{i}", "category": "ab"[i % 2], "turns": [f"List the numbers {i} {i} {i} {i}."]}
             for i in range(4)]
    lines[3]["messages"] = [{"role": "user", "content": "Name a color."}, {"role": "assistant", "content": "Blue."},
                            {"role": "user", "content": lines[3]["turns"][0]}]
    prompts = tmp_path / "workload.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in lines))
    loaded = load_prompts(prompts, 10, file_order=True)
    assert [p.question_id for p in loaded] == ["q0", "q1", "q2", "q3"]
    assert [p.question_id for p in load_prompts(prompts, 10)] == ["q0", "q2", "q1", "q3"]  # by category
    assert loaded[3].chat()[1] == {"role": "assistant", "content": "Blue."} and loaded[3].text == lines[3]["turns"][0]

    out = tmp_path / "out"
    assert main(["bench", "--prompts", str(prompts), "--per-category", "10", "--max-tokens", "12", "--config",
                 str(config), "--warmup", "1", "--no-verify-curve", "--order", "file", "--prime", "2",
                 "--methods", "plain,suffix", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert [(r["question_id"], r["method"]) for r in results["runs"]] == [
        ("q2", "plain"), ("q2", "suffix"), ("q3", "plain"), ("q3", "suffix")]
    assert not results["mismatches"]
    assert main(["bench", "--prompts", str(prompts), "--config", str(config), "--prime", "4", "--methods", "plain",
                 "--out", str(tmp_path / "none")]) == 2  # nothing left to time


def test_cli_bench_sends_each_prompt_its_prediction(tmp_path: Path, tiny_config: EngineConfig) -> None:
    """A line's `prediction` reaches every method of ours: the prediction drafter drafts from it
    (from the first step on) and proposes nothing for a line without one."""
    from router.cli import main

    engine = tiny_config.model_copy(update={"drafters": [*tiny_config.drafters, PredictionDrafterConfig()]})
    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(engine.model_dump(mode="json")))
    lines = [{"question_id": "p", "category": "a", "turns": ["Fix this: teh cat"], "prediction": "the cat sat"},
             {"question_id": "q", "category": "a", "turns": ["Name a color."]}]
    prompts = tmp_path / "edits.jsonl"
    prompts.write_text("".join(json.dumps(q) + "\n" for q in lines))
    assert [p.prediction for p in load_prompts(prompts, 10)] == ["the cat sat", None]
    out = tmp_path / "out"
    assert main(["bench", "--prompts", str(prompts), "--per-category", "10", "--max-tokens", "12", "--config",
                 str(config), "--no-verify-curve", "--methods", "plain,prediction", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    drafted = {r["question_id"]: r["num_draft_tokens"] for r in results["runs"] if r["method"] == "prediction"}
    assert drafted["p"] > 0 and drafted["q"] == 0
    assert not results["mismatches"]


def test_cli_bench_sampled(tmp_path: Path, tiny_config: EngineConfig, capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature: every method samples with one seed per prompt; a rerun draws the same tokens.
    With draws keyed by position (the default) our methods give plain sampling's tokens and are
    checked as greedy runs are (transformers' sampler is not); with draws taken in turn (rejection
    sampling) no token-wise losslessness is claimed. Greedy-only peers and levels are refused by name."""
    from router.cli import main

    config, stream_config = tmp_path / "engine.yaml", tmp_path / "stream.yaml"
    config.write_text(yaml.safe_dump(tiny_config.model_dump(mode="json")))
    stream_config.write_text(yaml.safe_dump({**tiny_config.model_dump(mode="json"), "seeded_draws": "stream"}))
    prompts = write_questions(tmp_path / "q.jsonl")
    common = ["bench", "--prompts", str(prompts), "--per-category", "2", "--max-tokens", "12",
              "--warmup", "0", "--no-verify-curve", "--methods", "plain,self,router,hf"]
    runs = {}
    for name, extra in (("a", ["--temperature", "1.0", "--seed", "7"]), ("b", ["--temperature", "1.0", "--seed", "7"]),
                        ("c", ["--temperature", "1.0", "--seed", "8"]), ("greedy", [])):
        assert main([*common, "--config", str(config), *extra, "--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    for name in ("s", "s2"):
        assert main([*common, "--config", str(stream_config), "--temperature", "1.0", "--seed", "7",
                     "--out", str(tmp_path / name)]) == 0
        runs[name] = json.loads((tmp_path / name / "results.json").read_text())
    sampled, streamed = runs["a"], runs["s"]
    assert sampled["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 7, "draws": "position"}
    assert streamed["sampling"]["draws"] == "stream" and runs["greedy"]["sampling"]["temperature"] == 0.0

    def tokens(results: dict) -> dict:
        return {(r["question_id"], r["method"]): r["token_ids"] for r in results["runs"]}

    for a, b in (("a", "b"), ("s", "s2")):  # seeded: the run repeats exactly, the router's draws too
        assert tokens(runs[a]) == tokens(runs[b])
    assert tokens(runs["a"]) != tokens(runs["c"])
    # sampled, not greedy: the random tiny target's samples leave its argmax path
    assert any(tokens(runs["a"])[key] != ids for key, ids in tokens(runs["greedy"]).items() if key[1] == "plain")

    # draws keyed by position: every method of ours repeats plain sampling's tokens, checked
    plain = {q: ids for (q, m), ids in tokens(sampled).items() if m == "plain"}
    assert all(ids == plain[q] for (q, m), ids in tokens(sampled).items() if m in ("self", "router"))
    assert {m: s["lossless"] for m, s in sampled["summary"][OVERALL].items()} == \
           {"plain": True, "self": True, "router": True, "hf": None}
    assert sampled["mismatches"] == []
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| yes |" in report and "| n/a |" in report and "equals plain sampling's with the same seed" in report

    # draws in turn: the target drafting for itself accepts every draft (rejection sampling, p = q)
    self_runs = [r for r in streamed["runs"] if r["method"] == "self"]
    assert sum(r["num_accepted_tokens"] for r in self_runs) == sum(r["num_draft_tokens"] for r in self_runs) > 0
    assert all(s["lossless"] is None for s in streamed["summary"][OVERALL].values()) and streamed["mismatches"] == []
    report = (tmp_path / "s" / "report.md").read_text()
    assert "sampled at temperature 1" in report and "| n/a |" in report and "Not checked token by token" in report

    common = [*common[:-2], "--config", str(config), *common[-2:]]  # --methods last
    assert main([*common[:-1], "plain,llama-cpp", "--temperature", "0.7", "--out", str(tmp_path / "bad")]) == 2
    assert "'llama-cpp' runs greedy only" in capsys.readouterr().err
    assert main([*common, "--temperature", "-1", "--out", str(tmp_path / "bad")]) == 2
    assert "temperature" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_bad_methods_and_categories(tmp_path: Path) -> None:
    config = EngineConfig(drafters=[NgramDrafterConfig()])
    assert check_methods(["ngram", "hf", "ngram"], config) == ["plain", "ngram", "hf"]
    assert check_methods(["router"], config) == ["plain", "router"]
    with pytest.raises(ValueError, match="hf-assisted.*kind 'model'"):
        check_methods(["hf-assisted"], config)
    prompts = write_questions(tmp_path / "q.jsonl")
    with pytest.raises(ValueError, match="unknown category 'poetry'.*available: summarization, coding"):
        load_prompts(prompts, 1, ["poetry"])
    assert [p.question_id for p in load_prompts(prompts, 2, ["coding", "summarization"])] == [1, 3, 2, 4]


def _record(
    qid: int, category: str, method: str, wall_s: float, tokens: list[int], steps: int | None,
) -> RunRecord:
    return RunRecord(qid, category, method, tokens, len(tokens), wall_s, steps, None, None, None, None)


def test_summary_arithmetic() -> None:
    records = [
        _record(1, "a", "plain", 2.0, [1, 2, 3, 4], 4), _record(1, "a", "ngram", 1.0, [1, 2, 3, 4], 2),
        _record(2, "a", "plain", 4.0, [5, 6], 2), _record(2, "a", "ngram", 1.0, [5, 6], 1),
        _record(3, "b", "plain", 3.0, [7, 8], 2), _record(3, "b", "ngram", 6.0, [7, 9], 2),
        _record(3, "b", "hf-pld", 3.0, [7, 8], None),
    ]
    summary = summarize(records)
    assert list(summary) == ["a", "b", OVERALL]
    a, b, overall = summary["a"], summary["b"], summary[OVERALL]
    assert a["plain"].speedup == 1.0 and a["plain"].mat == 1.0
    assert a["ngram"].speedup == pytest.approx(6.0 / 2.0)  # ratio of wall sums, not mean of ratios (2, 4)
    assert a["ngram"].mat == pytest.approx(6 / 3) and a["ngram"].tokens_per_s == pytest.approx(6 / 2.0)
    assert a["ngram"].lossless and not b["ngram"].lossless
    assert b["ngram"].speedup == pytest.approx(0.5)
    assert b["hf-pld"].mat is None and b["hf-pld"].lossless  # forwards unknown: no MAT
    assert overall["ngram"].speedup == pytest.approx(9.0 / 8.0) and not overall["ngram"].lossless
    assert overall["hf-pld"].speedup == pytest.approx(1.0)  # only over the prompts it ran on
    assert "hf-pld" not in summary["a"] or summary["a"]["hf-pld"].speedup is None


def test_latency_summary_arithmetic() -> None:
    """TTFT, time per token after the first, the decode phase's speedup, per-step draft and verify."""
    def timed(qid: int, method: str, wall: float, ttft: float, draft: float, verify: float) -> RunRecord:
        return replace(_record(qid, "a", method, wall, [1, 2, 3, 4, 5], 5 if method == "plain" else 2),
                       ttft_s=ttft, draft_s=draft, verify_s=verify, first_draft_s=draft / 2)

    records = [timed(1, "plain", 3.0, 1.0, 0.0, 2.0), timed(1, "ngram", 2.0, 1.0, 0.2, 0.8),
               timed(2, "plain", 5.0, 3.0, 0.0, 2.0), timed(2, "ngram", 4.0, 3.0, 0.2, 0.8)]
    s = summarize(records)["a"]["ngram"]
    assert s.ttft_s == pytest.approx(2.0) and s.itl_s == pytest.approx(2.0 / 8)  # 8 tokens after the first
    assert s.decode_speedup == pytest.approx(4.0 / 2.0)  # prefill excluded; the wall speedup is 8 / 6
    assert s.draft_ms == pytest.approx(1e3 * 0.4 / 4) and s.verify_ms == pytest.approx(1e3 * 1.6 / 4)
    assert s.first_draft_ms == pytest.approx(100.0)
    assert summarize([_record(1, "a", "plain", 1.0, [1], 1)])["a"]["plain"].ttft_s is None  # not timed: n/a


class _FixedLogits(torch.nn.Module):
    """A stand-in target whose next-token logits are the same rows whatever the input."""

    def __init__(self, rows: list[list[float]]) -> None:
        super().__init__()
        self.rows = torch.tensor(rows)
        self.device = torch.device("cpu")
        self.calls = 0

    def forward(self, input_ids: torch.Tensor, logits_to_keep: int) -> SimpleNamespace:
        self.calls += 1
        return SimpleNamespace(logits=self.rows[-logits_to_keep:][None])


def test_mismatch_position_and_gap() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    # rows predict generated positions 0, 1, 2 (after plain's 2 tokens): gaps 2.0, 5e-4, 1.0
    target = _FixedLogits([[0.0, 2.0, 0.0], [1.0, 0.0, 1.0005], [0.0, 0.0, 1.0]])
    records = [
        _record(7, "a", "plain", 1.0, [1, 2], 2), _record(7, "a", "ngram", 1.0, [1, 0], 1),
        _record(7, "a", "hf", 1.0, [1, 2, 2], 3), _record(8, "a", "plain", 1.0, [4], 1),
        _record(8, "a", "ngram", 1.0, [4], 1),
    ]
    mismatches = find_mismatches(records, {7: [9, 9], 8: [9]}, lambda: target)
    assert [(m.method, m.position, m.plain_token, m.method_token, m.near_tie) for m in mismatches] == [
        ("ngram", 1, 2, 0, True), ("hf", 2, None, 2, False),
    ]
    assert mismatches[0].top2_gap == pytest.approx(5e-4, abs=1e-6)
    assert target.calls == 1  # one forward per prompt, however many methods differ on it
    section = "\n".join(mismatch_section([asdict(m) for m in mismatches]))
    assert "| 7 | a | ngram | 1 | 2 | 0 |" in section
    never = find_mismatches(records[-2:], {8: [9]}, lambda: pytest.fail("no mismatch, no model load"))
    assert never == []


def test_cli_bench_under_concurrency(tmp_path: Path, tiny_config: EngineConfig, capsys: pytest.CaptureFixture[str]) -> None:
    """Closed-loop levels: summary.concurrency per level and method, lossless, a table and a plot."""
    from router.cli import main

    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(tiny_config.model_dump(mode="json")))
    prompts = write_questions(tmp_path / "q.jsonl")
    out = tmp_path / "out"
    assert main(["bench", "--prompts", str(prompts), "--per-category", "2", "--max-tokens", "8", "--config", str(config),
                 "--warmup", "1", "--methods", "ngram,router,plain-serial", "--concurrency", "4,1", "--rounds", "2",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    levels = results["summary"]["concurrency"]
    assert list(levels) == ["1", "4"]
    for level in levels.values():
        assert set(level) == {"plain", "ngram", "router", "plain-serial"}
        assert level["plain"]["speedup"] == pytest.approx(1.0)
        for r in level.values():
            assert r["num_mismatches"] == 0 and r["tokens_per_s"] > 0
            assert len(r["tokens_per_s_rounds"]) == 2 and r["tokens_per_s"] == max(r["tokens_per_s_rounds"])
            assert r["ttft_p50"] <= r["ttft_p99"] and r["tpot_p50"] <= r["tpot_p99"]
    assert levels["1"]["plain"]["mean_batch_size"] == pytest.approx(1.0)
    assert levels["4"]["plain"]["mean_batch_size"] > 1.0 and levels["4"]["plain-serial"]["mean_batch_size"] == 1.0
    assert levels["4"]["router"]["host_ms_per_step"] > 0 and levels["4"]["plain-serial"]["host_ms_per_step"] is None
    report = (out / "report.md").read_text()
    assert re.search(r"\| 4 \| router \| [\d.]+ \([\d.]+-[\d.]+\) \|", report)  # the fastest, both rounds
    assert (out / "throughput.png").read_bytes()[:8] == PNG_MAGIC

    assert main(["bench", "--prompts", str(prompts), "--methods", "plain", "--concurrency", "0,2",
                 "--out", str(tmp_path / "bad")]) == 2
    assert "--concurrency" in capsys.readouterr().err


def test_cli_bench_under_concurrency_sampled(tmp_path: Path, tiny_config: EngineConfig) -> None:
    """Sampled load: each request draws from its own seed, so plain decoding one sequence a forward
    reproduces every request's single-request sample, and batched plain decoding does where the
    target computes a row alike in any batch (not this float32 one: a draw at a token boundary may
    differ). A drafting method's outputs are compared too where seeded draws are keyed by position
    (the default); under draws taken in turn they are only distributed as plain's, not compared."""
    from router.cli import main

    config = tmp_path / "engine.yaml"
    config.write_text(yaml.safe_dump(tiny_config.model_dump(mode="json")))
    prompts = write_questions(tmp_path / "q.jsonl")
    runs = {}
    stream_config = tmp_path / "stream.yaml"
    stream_config.write_text(yaml.safe_dump({**tiny_config.model_dump(mode="json"), "seeded_draws": "stream"}))
    for name, seed, engine_config in (("a", "3", config), ("b", "4", config), ("s", "3", stream_config)):
        out = tmp_path / name
        assert main(["bench", "--prompts", str(prompts), "--per-category", "2", "--max-tokens", "8",
                     "--config", str(engine_config), "--warmup", "0", "--methods", "ngram,plain-serial",
                     "--concurrency", "3", "--temperature", "1.0", "--seed", seed, "--out", str(out)]) == 0
        runs[name] = json.loads((out / "results.json").read_text())
    level = runs["a"]["summary"]["concurrency"]["3"]
    assert level["plain-serial"]["num_mismatches"] == 0 and level["plain"]["num_mismatches"] is not None
    assert level["ngram"]["num_mismatches"] is not None and level["ngram"]["tokens_per_s"] > 0
    assert runs["a"]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "seed": 3, "draws": "position"}
    report = (tmp_path / "a" / "report.md").read_text()
    assert "sampled at temperature 1" in report and "| 3 | ngram |" in report and report.count("| - |") == 1
    level = runs["s"]["summary"]["concurrency"]["3"]
    assert level["ngram"]["num_mismatches"] is None and level["plain-serial"]["num_mismatches"] == 0
    assert (tmp_path / "s" / "report.md").read_text().count("| - |") == 2


def test_verify_curve_keeps_each_k_fastest_forward(monkeypatch: pytest.MonkeyPatch, tiny_engine) -> None:
    """Another process only slows a forward down, so the curve reports each k's fastest repetition:
    on a clock where a forward over 1 + k tokens takes 1 + k ms and two of each k's three timed
    repetitions 50 ms more (so the median is slow), the curve reads exactly 1 + k ms."""
    import bench.verify_cost as verify_cost

    model, now, calls = tiny_engine.target.model, [0.0], {}
    real_forward = model.forward

    def forward(input_ids: torch.Tensor, cache, **kwargs):
        n = input_ids.shape[0]
        if n <= 5:  # a verify forward (the context's prefill is longer)
            calls[n] = calls.get(n, 0) + 1
            now[0] += n * 1e-3 + (0.05 if calls[n] in (2, 3) else 0.0)  # call 1 is the warm-up
        return real_forward(input_ids, cache, **kwargs)

    def clock() -> float:
        now[0] += 1e-9  # a tensor copy takes a little time too (the bandwidth measurement divides by it)
        return now[0]

    monkeypatch.setattr(model, "forward", forward)
    monkeypatch.setattr(verify_cost.time, "perf_counter", clock)
    curve = verify_cost.measure_verify_curve(model, context_len=16, ks=[1, 4], reps=3, bandwidth_bytes=1 << 20)
    assert curve["ks"] == [0, 1, 4]
    assert curve["step_s"] == pytest.approx([1e-3, 2e-3, 5e-3], abs=1e-8)
    assert curve["ratio"] == pytest.approx([1.0, 2.0, 5.0], rel=1e-5)


def test_a_workload_with_formats_runs_our_methods_only() -> None:
    """structured.jsonl's lines carry response_format, which the peers would ignore: refused by name."""
    prompts = load_prompts(Path(__file__).resolve().parents[1] / "bench/workloads/structured.jsonl", 1)
    assert all(p.output_format is not None and p.output_format.kind == "json" for p in prompts)
    config = EngineConfig(drafters=[NgramDrafterConfig()])
    check_formats(prompts, ["plain", "ngram", "router", "plain-serial"], config)
    with pytest.raises(ValueError, match="hf-pld"):
        check_formats(prompts, ["plain", "hf-pld"], config)
    check_formats([replace(p, response_format=None) for p in prompts], ["plain", "hf-pld"], config)


def test_the_weights_bench_names_int4_without_its_dense_prefill_copy() -> None:
    from bench.weights import target_config

    assert target_config("int4:no-dense-prefill") == TargetConfig(weights="int4", dense_prefill=False)
    assert target_config("int4") == TargetConfig(weights="int4")
    with pytest.raises(ValueError, match="weights"):
        target_config("int3")
