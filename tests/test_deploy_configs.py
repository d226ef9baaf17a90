"""The cluster configs users deploy with: they parse, their Serve application validates with the
same schemas `specroute serve` uses, and the KubeRay one stays in step with serve.gpu.yaml."""

from __future__ import annotations

from pathlib import Path

import yaml
from ray.serve.schema import ServeDeploySchema

from router.app import AppArgs

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_rayservice_serves_the_gpu_application() -> None:
    docs = list(yaml.safe_load_all((DEPLOY / "rayservice.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert set(kinds) == {"Deployment", "Service", "RayService"}
    service = kinds["RayService"]
    serve_config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(serve_config)
    args = AppArgs.model_validate(serve_config["applications"][0]["args"])
    gpu = AppArgs.model_validate(yaml.safe_load((DEPLOY / "serve.gpu.yaml").read_text())["applications"][0]["args"])
    assert args.engine == gpu.engine and args.num_gpus == gpu.num_gpus == 1
    assert args.autoscaling_config == gpu.autoscaling_config
    # the statistics and stored responses every replica shares are in the Redis this file deploys
    redis_service = kinds["Service"]["metadata"]["name"]
    assert args.stats_url == args.responses_url == f"redis://{redis_service}:6379/0"
    cluster = service["spec"]["rayClusterConfig"]
    (group,) = cluster["workerGroupSpecs"]
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == "1"
    assert group["minReplicas"] <= group["maxReplicas"] and group["maxReplicas"] >= args.autoscaling_config.max_replicas


def test_cluster_launcher_config() -> None:
    config = yaml.safe_load((DEPLOY / "cluster.yaml").read_text())
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    gpu_types = [t for t in types.values() if t["resources"].get("GPU")]
    assert gpu_types and all(t["min_workers"] <= t["max_workers"] <= config["max_workers"] for t in gpu_types)
    assert types[config["head_node_type"]]["resources"] == {}  # no replica on the head
    # Ray's GCS must not take the statistics Redis's port
    assert any("--port=6380" in c for c in config["head_start_ray_commands"])
    assert all("6380" in c for c in config["worker_start_ray_commands"] if "ray start" in c)
