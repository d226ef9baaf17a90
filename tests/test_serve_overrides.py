"""`specroute serve` deploys a Serve config as `serve run` / `serve deploy` do. Its own module: one
Ray instance per process, and tests/test_serve.py keeps one up for its module."""

from __future__ import annotations

from pathlib import Path

import requests
import yaml
from helpers import serve_tiny_app

from workers.config import EngineConfig

MODEL = "tiny-test-model"


def test_serve_config_overrides_and_user_config_apply(tiny_config: EngineConfig, tmp_path: Path) -> None:
    """`specroute serve` deploys like `serve deploy`: a `deployments:` entry (here the policy as
    user_config, next to an option override) reaches the replicas."""
    from ray import serve

    policy = yaml.safe_load((Path(__file__).resolve().parents[1] / "policies" / "default_policy.yaml").read_text())
    policy["version"] = "from-user-config"
    overrides = [{"name": "TargetWorker", "user_config": {"policy": policy}, "max_ongoing_requests": 3}]
    with serve_tiny_app(tiny_config, tmp_path, MODEL, deployments=overrides) as url:
        r = requests.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["speculation"]["policy_version"] == "from-user-config"
        worker = serve.status().applications["specroute"].deployments["TargetWorker"]
        assert worker.status == "HEALTHY"
