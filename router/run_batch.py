"""OpenAI's batch file format, answered by the service: `specroute run-batch -i IN -o OUT` (vLLM's
run-batch).

Each input line is a request of OpenAI's Batch API: `custom_id` (unique in the file), `method`
"POST", `url` one of ENDPOINTS and the `body` that endpoint takes. The requests go to the service
over HTTP, `concurrency` at a time, so they share its batches, prefix cache and routing exactly as
online traffic does; each output line is OpenAI's batch output, in input order:

    {"id": "batch_req_...", "custom_id": "...", "response": {"status_code": 200, "request_id": "...",
     "body": {...the endpoint's answer or its error...}}, "error": null}

A request the service refuses keeps its status and error body in `response`; a request that got no
answer at all (the connection failed, the time ran out) has `response: null` and an `error`. A
`stream: true` body is answered as a 400 (param `stream`) without being sent: a batch's answers are
whole.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import requests
from pydantic import BaseModel, ConfigDict, ValidationError

from router.schemas import ErrorBody, ErrorResponse

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
DEFAULT_CONCURRENCY = 16  # a replica's default max_ongoing_requests
REQUEST_TIMEOUT_S = 3600.0


class BatchFileError(ValueError):
    """An input file that is not a batch: the first bad line, named."""


class BatchRequestInput(BaseModel):
    """One line of the input file."""

    model_config = ConfigDict(extra="forbid")

    custom_id: str
    method: Literal["POST"]
    url: Literal[ENDPOINTS]  # type: ignore[valid-type]
    body: dict[str, Any]


@dataclass
class BatchSummary:
    num_requests: int = 0
    num_ok: int = 0  # answered 200
    prompt_tokens: int = 0  # as the answers' usage counts them
    completion_tokens: int = 0
    wall_s: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)  # status code (or "no answer") -> requests

    @property
    def num_failed(self) -> int:
        return self.num_requests - self.num_ok


def read_batch(path: Path) -> list[BatchRequestInput]:
    """The requests of a batch file, checked whole before any is sent."""
    out: list[BatchRequestInput] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                request = BatchRequestInput.model_validate_json(line)
            except ValidationError as e:
                problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'line'}: {err['msg']}" for err in e.errors())
                raise BatchFileError(f"{path} line {number}: {problems}") from None
            if (first := seen.setdefault(request.custom_id, number)) != number:
                raise BatchFileError(f"{path} line {number}: custom_id {request.custom_id!r} repeats line {first}'s")
            out.append(request)
    if not out:
        raise BatchFileError(f"{path}: no requests")
    return out


def answer(session: requests.Session, base_url: str, request: BatchRequestInput, api_key: str | None) -> dict[str, Any]:
    """One request's output line."""
    line: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": request.custom_id,
                            "response": None, "error": None}
    if request.body.get("stream"):
        error = ErrorBody(message="stream: a batch request is answered whole; send it without stream", param="stream")
        line["response"] = {"status_code": 400, "request_id": f"req_{uuid.uuid4().hex}",
                            "body": ErrorResponse(error=error).model_dump()}
        return line
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = session.post(base_url + request.url, json=request.body, headers=headers, timeout=REQUEST_TIMEOUT_S)
        body = r.json()
    except (requests.RequestException, ValueError) as e:
        line["error"] = {"code": "request_failed", "message": f"{type(e).__name__}: {e}"}
        return line
    request_id = r.headers.get("x-request-id") or (body.get("id") if isinstance(body, dict) else None)
    line["response"] = {"status_code": r.status_code, "request_id": request_id or f"req_{uuid.uuid4().hex}",
                        "body": body}
    return line


def run_batch(
    batch: list[BatchRequestInput], base_url: str, out: TextIO, concurrency: int = DEFAULT_CONCURRENCY,
    api_key: str | None = None, on_done: Callable[[int], None] | None = None,
) -> BatchSummary:
    """Answer `batch` through the service at `base_url`, writing each output line to `out` in input
    order as soon as the lines before it are written; `on_done(n)`: n requests answered so far."""
    local = threading.local()

    def send(request: BatchRequestInput) -> dict[str, Any]:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        return answer(local.session, base_url.rstrip("/"), request, api_key)

    summary = BatchSummary(num_requests=len(batch))
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="run-batch") as pool:
        futures = [pool.submit(send, r) for r in batch]  # all submitted: they run `concurrency` at a time
        for done, future in enumerate(futures, start=1):
            line = future.result()
            out.write(json.dumps(line) + "\n")
            _count(summary, line)
            if on_done is not None:
                on_done(done)
    out.flush()
    summary.wall_s = time.perf_counter() - t0
    return summary


def _count(summary: BatchSummary, line: dict[str, Any]) -> None:
    response = line["response"]
    status = "no answer" if response is None else str(response["status_code"])
    summary.statuses[status] = summary.statuses.get(status, 0) + 1
    if status != "200":
        return
    summary.num_ok += 1
    usage = response["body"].get("usage") or {}
    summary.prompt_tokens += usage.get("prompt_tokens", usage.get("input_tokens", 0))
    summary.completion_tokens += usage.get("completion_tokens", usage.get("output_tokens", 0))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe(summary: BatchSummary, out_path: Path) -> str:
    statuses = ", ".join(f"{n} {status}" for status, n in sorted(summary.statuses.items()))
    return (f"run-batch: {summary.num_ok} of {summary.num_requests} requests answered ({statuses}) in "
            f"{summary.wall_s:.1f} s; {summary.prompt_tokens} prompt and {summary.completion_tokens} completion "
            f"tokens; output: {out_path}")


def progress(total: int, stream: TextIO = sys.stderr) -> Callable[[int], None]:
    """A progress line to `stream` at each tenth of the batch."""
    marks = {max(1, round(total * i / 10)) for i in range(1, 11)}

    def on_done(n: int) -> None:
        if n in marks:
            print(f"run-batch: {n}/{total} answered", file=stream, flush=True)

    return on_done
