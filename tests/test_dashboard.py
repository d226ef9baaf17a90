"""The dashboard in a real browser: headless Chromium loads /dashboard from the real Serve app
(tiny target, one worker replica, in-memory statistics) after some traffic, and the page's DOM
markers say each chart plots data. Also writes a screenshot; with SPECROUTE_SCREENSHOT=1 it
replaces docs/img/dashboard.png (the README's picture).

No browser driver: `chromium --headless --dump-dom` with a virtual-time budget runs the page's
script (fetches included) before printing the DOM.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from helpers import serve_tiny_app

from workers.config import EngineConfig

MODEL = "tiny-test-model"
DOCS_IMG = Path(__file__).resolve().parents[1] / "docs" / "img" / "dashboard.png"
CHARTS = ("acceptance", "mal", "speedup", "acceptance_t", "decisions_t", "fallbacks_t")


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    pytest.skip("no Chromium (Debian: apt-get install -y chromium; .ci/run installs it)")


@pytest.fixture(scope="module")
def base_url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _chromium()  # skip before starting Ray
    with serve_tiny_app(tiny_config, tmp_path_factory.mktemp("serve"), MODEL) as url:
        yield url


@pytest.fixture(scope="module")
def traffic(base_url: str) -> None:
    prompts = [
        ("def add(a, b):\n    return a + b\n# now subtract", {"drafter": "ngram"}),
        ("def mul(a, b):\n    return a * b", {}),
        ("Translate to French: the cat sat on the mat", {"drafter": "self", "draft_len": 3}),
        ("Summarize: the fox jumps over the dog. The fox jumps again.", {}),
        ("Tell me a story about a dragon", {"drafter": "other"}),
        ("Hello there!", {}),
    ]
    for text, spec in prompts:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 32,
                "temperature": 0, "ignore_eos": True, "speculation": spec}
        assert requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=120).status_code == 200


def _browser(*args: str, timeout_s: float = 90) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--hide-scrollbars", "--window-size=1400,1000", "--virtual-time-budget=20000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)


def test_static_files_are_bundled(base_url: str) -> None:
    r = requests.get(f"{base_url}/static/chart.umd.min.js", timeout=10)
    assert r.status_code == 200 and "javascript" in r.headers["content-type"]
    assert r.text.startswith("/*!\n * Chart.js v4") and "MIT" in r.text[:300]
    assert requests.get(f"{base_url}/static/dashboard.html", timeout=10).status_code == 404  # only the allow list
    page = requests.get(f"{base_url}/dashboard", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="static/chart.umd.min.js"' in page.text
    assert not re.search(r'(src|href)="(https?:)?//', page.text)  # nothing from another host


def test_dashboard_charts_show_data(base_url: str, traffic: None, tmp_path: Path) -> None:
    out = _browser("--dump-dom", f"{base_url}/dashboard?every=1")
    body = re.search(r"<body([^>]*)>", out.stdout)
    assert body, out.stderr[-2000:]
    attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', body.group(1)))
    assert attrs["state"] == "ready", out.stdout[:2000]
    assert int(attrs["points"]) > 20 and int(attrs["updates"]) >= 1
    has = dict(re.findall(r'id="(\w+)" data-has-data="(true|false)"', out.stdout))
    assert set(has) == set(CHARTS)
    assert all(has[c] == "true" for c in ("acceptance", "mal", "speedup", "acceptance_t", "decisions_t")), has
    assert re.search(r'id="version">default-7<', out.stdout)
    assert re.search(r'id="responses">memory, \d+ stored, 0/64 background<', out.stdout)
    assert re.search(r'id="batch">[^<]*prefix cache [^<]* hits \(\d+ tokens held\), 0 preemptions, '
                     r'KV cache 0% reserved; [1-9]\d* prompt and [1-9]\d* generated tokens, '
                     r'finished \d+ stop / [1-9]\d* length / 0 abort / 0 error<', out.stdout)

    shot = tmp_path / "dashboard.png"
    _browser(f"--screenshot={shot}", f"{base_url}/dashboard?every=1")
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # charts, not a blank page
    if os.environ.get("SPECROUTE_SCREENSHOT") == "1":
        shutil.copyfile(shot, DOCS_IMG)
