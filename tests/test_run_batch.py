"""`specroute run-batch`: OpenAI's batch file format answered by the service (vLLM's run-batch).
The file is checked whole first; the local path starts the tiny app, answers and stops it
(tests/test_serve.py runs a batch against a running server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import tiny_serve_config

from router.cli import main
from router.run_batch import BatchFileError, free_port, read_batch
from workers.config import EngineConfig

MODEL = "tiny-batch-model"


def _write(path: Path, lines: list[object]) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _line(custom_id: str, url: str = "/v1/chat/completions", **body: object) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": MODEL, **body}}


@pytest.mark.parametrize(("line", "needle"), [
    ("{not json", "line 2: line: Invalid JSON"),
    ({"custom_id": "b", "method": "GET", "url": "/v1/completions", "body": {}}, "line 2: method: Input should be 'POST'"),
    ({"custom_id": "b", "method": "POST", "url": "/v1/embeddings", "body": {}}, "line 2: url: Input should be"),
    ({"custom_id": "b", "method": "POST", "url": "/v1/completions"}, "line 2: body: Field required"),
    ({**_line("b"), "extra": 1}, "line 2: extra: Extra inputs are not permitted"),
    (_line("a"), "line 2: custom_id 'a' repeats line 1's"),
])
def test_a_bad_line_names_itself_before_anything_is_sent(tmp_path: Path, line: object, needle: str) -> None:
    path = _write(tmp_path / "in.jsonl", [_line("a"), line])
    with pytest.raises(BatchFileError, match=needle.replace("(", r"\(").replace("'", "'")):
        read_batch(path)
    assert main(["run-batch", "-i", str(path), "-o", str(tmp_path / "out.jsonl"), "--url", "http://127.0.0.1:9"]) == 2
    assert not (tmp_path / "out.jsonl").exists()


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BatchFileError, match="no requests"):
        read_batch(_write(tmp_path / "in.jsonl", ["", "  "]))


def test_run_batch_starts_the_service_answers_in_input_order_and_stops_it(
    tiny_config: EngineConfig, tmp_path: Path,
) -> None:
    import ray

    config, _ = tiny_serve_config(tiny_config, tmp_path, MODEL)
    chat = [{"role": "user", "content": "Count: one two three"}]
    lines = [
        _line("chat", messages=chat, max_tokens=12, temperature=0),
        _line("text", url="/v1/completions", prompt="Count: one two three", max_tokens=12, temperature=0),
        _line("resp", url="/v1/responses", input="Count: one two", max_output_tokens=8, temperature=0),
        _line("bad", messages=chat, max_tokens=-1),  # refused by the service
        _line("streamed", messages=chat, max_tokens=4, stream=True),  # refused before it is sent
        _line("again", messages=chat, max_tokens=12, temperature=0),
    ]
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(_write(tmp_path / "in.jsonl", lines)), "-o", str(out),
                 "--config", str(config), "--concurrency", "3"]) == 1  # two of six failed
    assert not ray.is_initialized()  # the service it started is stopped
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [line["custom_id"] for line in lines]
    assert len({g["id"] for g in got}) == len(got) and all(g["id"].startswith("batch_req_") for g in got)
    assert all(g["error"] is None and g["response"]["request_id"] for g in got)
    status = {g["custom_id"]: g["response"]["status_code"] for g in got}
    assert status == {"chat": 200, "text": 200, "resp": 200, "bad": 400, "streamed": 400, "again": 200}
    body = {g["custom_id"]: g["response"]["body"] for g in got}
    assert body["chat"]["object"] == "chat.completion" and body["chat"]["usage"]["completion_tokens"] == 12
    assert body["text"]["object"] == "text_completion" and body["resp"]["object"] == "response"
    assert body["chat"]["choices"][0]["message"] == body["again"]["choices"][0]["message"]  # greedy: the same answer
    assert body["bad"]["error"]["param"] == "max_tokens"
    assert body["streamed"]["error"]["param"] == "stream"


def test_a_server_that_does_not_answer_is_an_error_per_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "in.jsonl", [_line("a"), _line("b")])
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(path), "-o", str(out), "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["a", "b"]
    assert all(g["response"] is None and g["error"]["code"] == "request_failed" for g in got)
