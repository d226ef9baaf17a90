"""The long soak (marker `slow`: `pytest -m slow tests/test_soak.py -s`): concurrent clients
send a bounded number of mixed requests (plain, routed, each drafter, streamed, cancelled
mid-stream, a share of bad ones) to the real Serve app; the worker's memory must level off and
every request must end as asked. Figures go to stdout; docs/reliability.md records a run.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from pathlib import Path

import pytest
import requests
from helpers import serve_tiny_app

from workers.config import EngineConfig

pytestmark = pytest.mark.slow

MODEL = "tiny-test-model"
NUM_REQUESTS = 2000
CLIENTS = 4
SAMPLE_EVERY = 200


def _one(base_url: str, i: int) -> str:
    """One request of kind i % 10; returns how it ended."""
    kind = i % 10
    drafter = ("auto", "none", "ngram", "self", "other")[i % 5]
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Request {i}: count to ten"}],
            "max_tokens": 24, "temperature": 0 if kind % 2 else 0.8, "seed": i,
            "speculation": {"drafter": drafter}}
    url = f"{base_url}/v1/chat/completions"
    if kind == 9:  # bad input
        r = requests.post(url, json={**body, "top_p": 7}, timeout=120)
        return "400" if r.status_code == 400 else f"unexpected {r.status_code}"
    if kind in (3, 7):  # streamed; one in two cancelled after the first event
        with requests.post(url, json={**body, "stream": True, "max_tokens": 64}, stream=True, timeout=120) as r:
            if r.status_code != 200:
                return f"unexpected {r.status_code}"
            lines = [line for line in r.iter_lines() if line] if kind == 3 else [next(r.iter_lines())]
            return "streamed" if kind == 7 or lines[-1] == b"data: [DONE]" else "stream cut"
    r = requests.post(url, json=body, timeout=120)
    return "200" if r.status_code == 200 and r.json()["choices"][0]["finish_reason"] else f"unexpected {r.status_code}"


def test_soak_memory_levels_off(tiny_config: EngineConfig, tmp_path: Path) -> None:
    from ray import serve

    with serve_tiny_app(tiny_config, tmp_path, MODEL, max_ongoing_requests=8) as base_url:
        worker = serve.get_deployment_handle("TargetWorker", app_name="specroute")

        def status() -> dict:
            return worker.broadcast("status").results(timeout_s=30)[0]

        outcomes: dict[str, int] = {}
        samples: list[tuple[int, float, int]] = []
        t0 = time.monotonic()
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            for start in range(0, NUM_REQUESTS, SAMPLE_EVERY):
                for outcome in pool.map(lambda i: _one(base_url, i), range(start, start + SAMPLE_EVERY)):
                    outcomes[outcome] = outcomes.get(outcome, 0) + 1
                samples.append((start + SAMPLE_EVERY, time.monotonic() - t0, status()["rss_bytes"]))
        deadline = time.monotonic() + 30
        while status()["num_active"] and time.monotonic() < deadline:
            time.sleep(0.2)
        final = status()

    print(f"\nsoak: {NUM_REQUESTS} requests, {CLIENTS} clients, {samples[-1][1]:.0f} s; outcomes {outcomes}")
    for n, t, rss in samples:
        print(f"  after {n:5d} requests ({t:6.0f} s): worker RSS {rss / 2**20:7.1f} MiB")
    assert not any(k.startswith("unexpected") or k == "stream cut" for k in outcomes), outcomes
    assert final["num_active"] == 0 and final["num_pending"] == 0, final
    warm = samples[1][2]  # after the first 400 requests: caches, allocator pools and JIT are warm
    assert max(rss for _, _, rss in samples[2:]) - warm < 64 * 2**20, samples
