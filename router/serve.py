"""Run the Serve application from a Serve config file on a local Ray instance.

    serve(config_path, host, port, blocking, overrides)   `specroute serve`; tests call it with blocking=False
    shutdown()                                             stops Serve and the Ray instance started here

The config file is Ray Serve's own format (deploy/serve.cpu.yaml), so `serve run` / `serve deploy`
accept the same file; this entry point overrides its HTTP host and port from the command line, and
fields of its application's args (`overrides`, vLLM's serve flags: `--max-model-len`, ...).
"""

from __future__ import annotations

import copy
import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from workers.config import ConfigError, describe_validation_error, read_yaml

QUIET_LOGGING = {"log_level": "WARNING"}  # Serve's per-request access logs are INFO
SERVE_SHUTDOWN_TIMEOUT_S = 10.0
DEPLOY_TIMEOUT_S = 900.0  # the first start converts the GGUF target once


class ServeError(RuntimeError):
    """Serve could not run the application; the message is Serve's reason."""


def load_serve_config(path: Path) -> dict[str, Any]:
    """A Serve config file, checked against Ray's schema; returns the parsed YAML."""
    from ray.serve.schema import ServeDeploySchema

    data = read_yaml(path)
    try:
        ServeDeploySchema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"config {path} is not a valid Serve config: {e}") from None
    if not data.get("applications"):
        raise ConfigError(f"config {path}: no applications")
    return data


def with_overrides(config: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The Serve config with fields of its first application's args set: `overrides` maps a dotted
    path in the args (`engine.target.max_model_len`) to its value. `config` itself is unchanged."""
    config = copy.deepcopy(config)
    app = config["applications"][0]
    args = app["args"] = app.get("args") or {}
    for path, value in overrides.items():
        *parents, last = path.split(".")
        node = args
        for key in parents:
            if not isinstance(node.get(key), dict):
                node[key] = {}
            node = node[key]
        node[last] = value
    return config


def _build(app_config: dict[str, Any]) -> Any:
    """The Application named by import_path: a builder called with args, or an Application."""
    from ray.serve import Application

    import_path = app_config["import_path"]
    module_name, _, attr = import_path.replace(":", ".").rpartition(".")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"application import_path {import_path!r}: {e} (SpecRoute's is "
                          "router.app:build_app)") from None
    if isinstance(target, Application):
        return target
    try:
        return target(app_config.get("args") or {})
    except ValidationError as e:
        raise ConfigError(f"application args: {describe_validation_error(e)}") from None


def start_ray() -> None:
    """A fresh local Ray instance on 127.0.0.1, quiet, without the dashboard."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(
        address="local", num_cpus=os.cpu_count() or 1, include_dashboard=False,
        _node_ip_address="127.0.0.1", logging_level=logging.WARNING, configure_logging=True,
    )


def serve(config_path: Path, host: str = "127.0.0.1", port: int = 8000, blocking: bool = True,
          overrides: Mapping[str, Any] | None = None) -> None:
    """Deploy the config on a new local Ray instance the way `serve run CONFIG` and `serve deploy`
    do (Serve's controller builds the application, so `deployments:` overrides and `user_config`
    apply), with host and port from the command line and the application's args set by
    `overrides` (`with_overrides`); when blocking, wait for Ctrl-C (or SIGTERM) and shut
    everything down."""
    import ray
    from ray.serve._private import api as serve_api  # what `serve run CONFIG` calls (ray.serve.scripts)
    from ray.serve.schema import ServeDeploySchema

    config = with_overrides(load_serve_config(config_path), overrides or {})
    app_config = config["applications"][0]
    _build(app_config)  # bad args are reported before Ray starts
    schema = ServeDeploySchema.model_validate({
        **config, "http_options": {**(config.get("http_options") or {}), "host": host, "port": port},
        "logging_config": config.get("logging_config") or QUIET_LOGGING,
    })
    start_ray()
    try:
        client = serve_api.serve_start(http_options=schema.http_options.model_dump(),
                                       proxy_location=schema.proxy_location,
                                       global_logging_config=schema.logging_config)
        client.deploy_apps(schema)
        _wait_until_running([app.name for app in schema.applications])
    except BaseException as e:
        shutdown()
        if isinstance(e, (ConfigError, ServeError)):
            raise
        if isinstance(e, Exception):
            raise ServeError(f"deploying the application failed: {e}") from None
        raise
    if not blocking:
        return
    url = f"http://{host}:{port}{app_config.get('route_prefix', '/').rstrip('/')}"
    print(f"SpecRoute is serving {url}/v1 (OpenAI API; health: {url}/healthz). Ctrl-C stops it.",
          flush=True)
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        print("shutting down", flush=True)
        shutdown()
    assert not ray.is_initialized()


def _wait_until_running(names: list[str], timeout_s: float = DEPLOY_TIMEOUT_S) -> None:
    """Until every application is RUNNING; a failed deploy raises ServeError with Serve's message."""
    from ray import serve as ray_serve

    deadline = time.monotonic() + timeout_s
    while True:
        apps = ray_serve.status().applications
        statuses = {name: apps[name] if name in apps else None for name in names}
        failed = {n: a for n, a in statuses.items() if a is not None and a.status == "DEPLOY_FAILED"}
        if failed:
            raise ServeError("; ".join(f"application {n!r} failed to deploy: {a.message}" for n, a in failed.items()))
        if all(a is not None and a.status == "RUNNING" for a in statuses.values()):
            return
        if time.monotonic() > deadline:
            raise ServeError(f"the applications were not running after {timeout_s:.0f} s: "
                           + ", ".join(f"{n}: {a.status if a else 'not deployed'}" for n, a in statuses.items()))
        time.sleep(0.5)


def shutdown() -> None:
    """Stop Serve and the Ray instance this process started (idempotent)."""
    import ray
    from ray import serve as ray_serve

    if not ray.is_initialized():
        return
    # Serve's graceful shutdown waits up to 30 s for its controller, which never answers when a
    # signal to the whole process group has stopped Ray's daemons too: give it a shorter while
    graceful = threading.Thread(target=_quietly, args=(ray_serve.shutdown,), daemon=True)
    graceful.start()
    graceful.join(SERVE_SHUTDOWN_TIMEOUT_S)
    ray.shutdown()


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # Ray goes down next in any case
        logging.getLogger(__name__).warning("Serve shutdown: %s", e)
