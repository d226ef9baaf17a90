"""Observability and policy reload: /metrics, /v1/stats, PUT /v1/policy, the Grafana dashboard and
the Prometheus rules, on the real Serve app (two worker replicas sharing a real Redis, an admin
token), plus unit tests of the renderers on hand-built observations.

One app per module: Ray and Serve start once; every request the module sends is kept in
RESPONSES, so counter checks compare against all of them whatever order the tests run in.
"""

from __future__ import annotations

import json
import re
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import requests
import yaml
from helpers import serve_tiny_app
from prometheus_client.parser import text_string_to_metric_families

from policies.records import PLAIN, RequestRecord, StatsSnapshot, StepRecord
from policies.schema import DEFAULT_POLICY_PATH, load_policy
from policies.stats import MemoryStats, StoreHealth
from router.control import ControlError, check_admin_token, combine, parse_policy_body, policy_outcome
from router.metrics import render
from router.observation import Observation, TrafficMemoryView
from workers.config import EngineConfig, SuffixDrafterConfig
from workers.deployment import PolicyResult

MODEL = "tiny-test-model"
REPO = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/0"
TOKEN = "s3cret-token"
DOMAINS = set(load_policy(DEFAULT_POLICY_PATH).domains)
DRAFTERS = {"ngram", "self", "other", "suffix"}  # tiny_config's and a suffix drafter
RESPONSES: list[dict] = []  # every completed request of this module
METRIC = re.compile(r"\bspecroute_[A-Za-z0-9_]+")


# -- unit: renderers on hand-built observations (no Ray) ----------------------------------------------
def _observation(store: MemoryStats, *, domains=("code", "chat"), drafters=("ngram",), version="v1",
                 replica="r1") -> Observation:
    data = {
        "replica": replica, "policy_version": version, "domains": list(domains), "drafters": list(drafters),
        "max_draft_len": 4, "window_s": 300.0, "all_time": store.snapshot().to_json(),
        "window": store.snapshot(300).to_json(),
        "outlook": [{"domain": d, "drafter": r, "draft_len": 3, "predicted_speedup": 1.25, "acceptance": [0.5]}
                    for d in domains for r in drafters] + [{"domain": "code", "drafter": "x", "draft_len": 1,
                                                           "predicted_speedup": float("inf"), "acceptance": []}],
        "measured_speedup": {"code": 1.5, "chat": None}, "store": asdict(store.health()),
        "series": [{"start_s": p.start_s, "bucket_s": p.bucket_s, "snapshot": p.snapshot.to_json()}
                   for p in store.series(20)],
    }
    return Observation.from_json(json.loads(json.dumps(data)))


def _step(domain: str = "code", drafter: str = "ngram", k: int = 4, accepted: int = 2) -> StepRecord:
    return StepRecord(domain, drafter, k, k, accepted, 0.01 if drafter != PLAIN else 0.0, 0.05, 100)


def _families(text: str) -> dict[str, list]:
    """Metric family name -> its samples."""
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_suffix_memories_add_up_over_replicas_and_render_as_gauges() -> None:
    def with_memory(obs: Observation, tokens: dict[str, int]) -> Observation:
        return replace(obs, traffic_memory={"suffix": TrafficMemoryView(tokens, 100)})

    both = combine([with_memory(_observation(MemoryStats()), {"code": 10, "chat": 5}),
                    with_memory(_observation(MemoryStats(), replica="r2"), {"code": 7})])
    assert both.traffic_memory == {"suffix": TrafficMemoryView({"code": 17, "chat": 5}, 200)}
    fams = _families(render(both).decode())
    assert {(s.labels["domain"], s.value) for s in fams["specroute_suffix_cache_tokens"]} == {("code", 17), ("chat", 5)}
    assert [s.value for s in fams["specroute_suffix_cache_max_tokens"]] == [200]
    assert "specroute_suffix_cache_tokens" not in _families(render(_observation(MemoryStats())).decode())


def test_render_bounds_labels_to_the_configured_lists() -> None:
    store = MemoryStats()
    store.record_many([
        _step(), _step(k=4, accepted=4), _step(domain="stranger"), _step(drafter="eagle", k=3, accepted=1),
        _step(k=9, accepted=9),  # positions past max_draft_len (4) are not exposed
        _step(drafter=PLAIN, k=0, accepted=0),
        RequestRecord("code", "ngram", "best", 0.01, 0.2, fallbacks=("low_speedup",)),
        RequestRecord("code", "eagle", "best", 0.01, 0.2), RequestRecord("stranger", PLAIN, "forced", 0.01, 0.2),
        RequestRecord("chat", PLAIN, "fallback", 0.02, 0.3),
    ])
    fams = _families(render(_observation(store)).decode())
    tokens = {s.labels["domain"] + "/" + s.labels["drafter"]: s.value
              for s in fams["specroute_spec_decode_num_draft_tokens"]}
    assert tokens == {"code/ngram": 17, "chat/ngram": 0}  # zero series for configured pairs; no stranger, no eagle
    per_pos = {s.labels["position"]: s.value for s in fams["specroute_spec_decode_num_accepted_tokens_per_pos"]
               if s.labels["domain"] == "code"}
    assert per_pos == {"0": 3, "1": 3, "2": 2, "3": 2}
    decisions = {tuple(s.labels.values()): s.value for s in fams["specroute_routing_decisions"]}
    assert decisions == {("code", "ngram", "best"): 1, ("chat", PLAIN, "fallback"): 1}
    assert [s.value for s in fams["specroute_fallback"]] == [1]
    expected = {(s.labels["domain"], s.labels["drafter"]): s.value for s in fams["specroute_expected_speedup"]}
    assert expected == {("code", "ngram"): 1.25, ("chat", "ngram"): 1.25}  # unknown drafter, inf: left out
    assert [(s.labels, s.value) for s in fams["specroute_measured_speedup"]] == [({"domain": "code"}, 1.5)]
    verify = {s.labels["draft_len"] for s in fams["specroute_verify_stage_seconds"] if s.name.endswith("_count")}
    assert verify == {"0", "3", "4"}  # k = 9 is past max_draft_len
    e2e = {s.name: s for s in fams["specroute_e2e_request_latency_seconds"]}
    assert e2e["specroute_e2e_request_latency_seconds_count"].value == 4
    buckets = [s.value for s in fams["specroute_e2e_request_latency_seconds"] if s.name.endswith("_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == 4
    assert fams["specroute_stats_store_connected"][0].value == 1
    assert fams["specroute_policy_info"][0].labels == {"version": "v1"}


def test_combine_sums_memory_replicas_and_reads_a_shared_store_once() -> None:
    a, b = MemoryStats(), MemoryStats()
    a.record_many([_step(k=4, accepted=1), RequestRecord("code", "ngram", "best", 0.01, 0.2)])
    b.record_many([_step(k=2, accepted=2), _step(domain="chat", drafter=PLAIN, k=0, accepted=0)])
    both = combine([_observation(a), _observation(b, replica="r2")])
    assert both.all_time.counts("code", "ngram").num_draft_tokens == 6
    assert both.window.counts("code", "ngram").num_accepted_tokens == 3
    assert sum(p.snapshot.counts("code", "ngram").num_drafts for p in both.series) == 2
    assert len(both.series) == len(_observation(a).series)  # aligned bucket by bucket
    assert both.measured_speedup["code"] is not None  # recomputed from the summed window
    shared = [replace(_observation(a), store=StoreHealth("redis", True, 1, 2)),
              replace(_observation(a, replica="r2"), store=StoreHealth("redis", False, 3, 0, last_error="boom"))]
    once = combine(shared)
    assert once.all_time == shared[0].all_time  # not doubled
    assert once.store == StoreHealth("redis", False, 4, 2, 0, "boom")


def test_admin_token_and_policy_body() -> None:
    check_admin_token(None, None)  # no token configured: open
    check_admin_token(TOKEN, f"Bearer {TOKEN}")
    for header in (None, "", TOKEN, f"Bearer {TOKEN}x", f"Basic {TOKEN}"):
        with pytest.raises(ControlError) as info:
            check_admin_token(TOKEN, header)
        assert info.value.status == 401
    assert parse_policy_body(b'{"version": "j"}') == {"version": "j"}  # JSON is YAML
    assert parse_policy_body(b"version: y\n") == {"version": "y"}
    for body in (b"[1, 2]", b"policy.yaml", b"a: [", b"\xff"):
        with pytest.raises(ControlError) as info:
            parse_policy_body(body)
        assert info.value.status == 400


def test_policy_outcome() -> None:
    ok = policy_outcome([PolicyResult("v2", "r1"), PolicyResult("v2", "r2")])
    assert (ok.version, ok.num_replicas) == ("v2", 2)
    with pytest.raises(ControlError) as info:
        policy_outcome([PolicyResult("v1", r, "domains.code.k_max: 3 is below k_min 4") for r in ("r1", "r2")])
    assert (info.value.status, info.value.param) == (400, "domains.code.k_max")
    with pytest.raises(ControlError) as info:
        policy_outcome([PolicyResult("v2", "r1"), RuntimeError("replica died")])
    assert info.value.status == 500 and "1 of 2" in info.value.message
    with pytest.raises(ControlError):
        policy_outcome([])


# -- the real app ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(tiny_config: EngineConfig, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        client.ping()
    except redis.RedisError as e:
        pytest.skip(f"no Redis at {REDIS_URL}: {e}")
    prefix = f"test-metrics-{uuid.uuid4().hex[:10]}"
    try:
        scheduler = tiny_config.scheduler.model_copy(update={"enable_prefix_caching": True})
        config = tiny_config.model_copy(update={"drafters": [*tiny_config.drafters, SuffixDrafterConfig()],
                                                "scheduler": scheduler})
        # Serve's random choice between the two replicas, so both serve some of the traffic
        # (tests/test_replica_affinity.py tests the default, prefix-affine choice)
        with serve_tiny_app(config, tmp_path_factory.mktemp("serve"), MODEL, num_replicas=2,
                            stats_url=REDIS_URL, stats_prefix=prefix, admin_token=TOKEN,
                            replica_routing="power_of_two") as url:
            yield url
    finally:
        keys = list(client.scan_iter(match=f"{{{prefix}}}:*"))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="module")
def traffic(base_url: str) -> list[dict]:
    """Requests over several domains and drafters, two at a time so both replicas serve some."""
    bodies = [
        ("def add(a, b):\n    return a + b\n# now subtract", {"drafter": "ngram"}),
        ("Translate to French: the cat sat on the mat", {"drafter": "self", "draft_len": 3}),
        ("Summarize: the quick brown fox jumps over the lazy dog. " * 3, {}),
        ("Tell me a story about a dragon", {"drafter": "other"}),
        ("Count: one two three four five six", {"drafter": "none"}),
        ("def mul(a, b):\n    return a * b", {}),
        ("Hello there, how are you?", {"drafter": "ngram", "draft_len": 5}),
        ("Translate to German: good morning", {}),
    ]
    threads = [threading.Thread(target=_chat, args=(base_url, text, spec)) for text, spec in bodies]
    # one without max_tokens: the server's default budget
    threads.append(threading.Thread(target=_chat, args=(base_url, "Write about the sea", {}, None)))
    for i in range(0, len(threads), 2):
        for t in threads[i : i + 2]:
            t.start()
        for t in threads[i : i + 2]:
            t.join(120)
    assert len(RESPONSES) >= len(bodies)
    return RESPONSES


def _chat(base_url: str, text: str, speculation: dict | None = None, max_tokens: int | None = 24,
          **extra: object) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "temperature": 0, "ignore_eos": True,
            "speculation": speculation or {}, **({} if max_tokens is None else {"max_tokens": max_tokens}), **extra}
    r = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    RESPONSES.append(r.json())
    return r.json()


def _scrape_text(base_url: str) -> str:
    r = requests.get(f"{base_url}/metrics", timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return r.text


def _scrape(base_url: str) -> dict[str, list]:
    return _families(_scrape_text(base_url))


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exposed_names(text: str) -> set[str]:
    """Every series name a PromQL expression may use, families without samples yet included."""
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in SUFFIXES[f.type]}


def _by_domain(samples: list, name: str | None = None) -> Counter:
    out: Counter = Counter()
    for s in samples:
        if name is None or s.name == name:
            out[s.labels["domain"]] += s.value
    return out


def test_metrics_equal_the_sums_of_the_responses(base_url: str, traffic: list[dict]) -> None:
    fams = _scrape(base_url)
    specs = [r["speculation"] for r in RESPONSES]
    for metric, field in [("specroute_spec_decode_num_draft_tokens", "num_draft_tokens"),
                          ("specroute_spec_decode_num_accepted_tokens", "num_accepted_tokens")]:
        want: Counter = Counter()
        for spec in specs:
            want[spec["domain"]] += spec[field]
        assert +_by_domain(fams[metric]) == +want, metric
    assert sum(s["num_draft_tokens"] for s in specs) > 0
    per_pos: Counter = Counter()
    for spec in specs:
        for i, n in enumerate(spec["acceptance_histogram"]):
            per_pos[str(i)] += n
    got: Counter = Counter()
    for s in fams["specroute_spec_decode_num_accepted_tokens_per_pos"]:
        got[s.labels["position"]] += s.value
    assert +got == +per_pos
    drafts = {tuple(s.labels.values()): s.value for s in fams["specroute_spec_decode_num_drafts"]}
    tokens = {tuple(s.labels.values()): s.value for s in fams["specroute_spec_decode_num_draft_tokens"]}
    assert all(drafts[k] <= tokens[k] <= 16 * drafts[k] for k in drafts)
    decisions = Counter({(s.labels["domain"], s.labels["drafter"], s.labels["reason"]): s.value
                         for s in fams["specroute_routing_decisions"]})
    assert +decisions == +Counter((s["domain"], s["drafter"], s["reason"]) for s in specs)
    assert sum(s.value for s in fams["specroute_fallback"]) == sum(len(s["fallbacks"]) for s in specs)
    # the labels come from the configured lists only
    for name in ("specroute_spec_decode_num_drafts", "specroute_expected_speedup", "specroute_routing_decisions"):
        for s in fams[name]:
            assert s.labels["domain"] in DOMAINS
            assert s.labels["drafter"] in DRAFTERS | ({PLAIN} if name == "specroute_routing_decisions" else set())
    assert {s.labels["domain"] for s in fams["specroute_expected_speedup"]} == DOMAINS
    # histograms count requests and steps
    count = {s.name: s.value for f in ("specroute_time_to_first_token_seconds", "specroute_e2e_request_latency_seconds")
             for s in fams[f] if s.name.endswith("_count")}
    assert set(count.values()) == {len(RESPONSES)}
    verify_steps = sum(s.value for s in fams["specroute_verify_stage_seconds"] if s.name.endswith("_count"))
    assert verify_steps == sum(s["num_steps"] for s in specs)
    assert {s.labels["draft_len"] for s in fams["specroute_verify_stage_seconds"]} <= {str(k) for k in range(17)}
    assert {s.labels["drafter"] for s in fams["specroute_draft_stage_seconds"]} <= DRAFTERS
    assert fams["specroute_stats_store_connected"][0].value == 1
    assert fams["specroute_stats_store_connected"][0].labels == {"backend": "redis"}
    # stored responses: in the ingress's memory here (RESPONSES are chat completions: none stored)
    assert [(s.labels, s.value) for s in fams["specroute_response_store_connected"]] == [({"backend": "memory"}, 1)]
    assert fams["specroute_response_store_local"][0].value == 0
    assert (fams["specroute_background_responses"][0].value, fams["specroute_background_responses_limit"][0].value) \
        == (0, 64)


def test_batching_metrics_count_the_steps(base_url: str, traffic: list[dict]) -> None:
    """The schedulers' gauges and histograms, summed over the replicas: every request's tokens
    came out of counted steps, and nothing is left running once the traffic is answered."""
    fams = _scrape(base_url)
    assert [s.value for s in fams["specroute_num_requests_running"]] == [0]
    assert [s.value for s in fams["specroute_num_requests_waiting"]] == [0]
    sizes = {s.name: s.value for s in fams["specroute_batch_size"]}
    rows = {s.name: s.value for s in fams["specroute_step_tokens"]}
    assert sizes["specroute_batch_size_count"] == rows["specroute_step_tokens_count"] > 0
    completion = sum(r["usage"]["completion_tokens"] for r in RESPONSES)
    assert rows["specroute_step_tokens_sum"] >= completion  # each emitted token had a row in some step
    assert sizes["specroute_batch_size_sum"] >= sizes["specroute_batch_size_count"]
    assert fams["specroute_goodput_tokens_per_second"][0].value > 0
    # the prefix caches: every prompt token queried, the cached ones (the chat template's shared
    # system prompt, at least) as the responses count them
    queries, hits = fams["specroute_prefix_cache_queries"][0].value, fams["specroute_prefix_cache_hits"][0].value
    assert queries == sum(r["usage"]["prompt_tokens"] for r in RESPONSES)
    assert 0 < hits == sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in RESPONSES) < queries
    assert fams["specroute_prefix_cache_tokens"][0].value > 0
    # first come first served: nothing preempted (tests/test_priority.py preempts)
    assert [(s.name, s.value) for s in fams["specroute_num_preemptions"]] == [("specroute_num_preemptions_total", 0)]
    # vLLM's token and request counters: what the responses report, each request once
    prompt = sum(r["usage"]["prompt_tokens"] for r in RESPONSES)
    assert [s.value for s in fams["specroute_prompt_tokens"]] == [prompt]
    assert [s.value for s in fams["specroute_generation_tokens"]] == [completion]
    reasons = Counter(c["finish_reason"] for r in RESPONSES for c in r["choices"])
    success = {s.labels["finished_reason"]: s.value for s in fams["specroute_request_success"]}
    assert success == {"stop": reasons["stop"], "length": reasons["length"], "abort": 0, "error": 0}
    for name, total in (("request_queue_time_seconds", None), ("request_prompt_tokens", prompt),
                        ("request_generation_tokens", completion)):
        hist = {s.name.removeprefix(f"specroute_{name}"): s.value for s in fams[f"specroute_{name}"]}
        assert hist["_count"] == len(RESPONSES), name
        assert total is None or hist["_sum"] == total, name
    assert [s.value for s in fams["specroute_kv_cache_usage_perc"]] == [0]  # nothing running
    batching = requests.get(f"{base_url}/v1/stats", timeout=30).json()["batching"]
    assert batching["num_preemptions"] == 0 and batching["kv_cache_usage"] == 0
    assert (batching["prompt_tokens"], batching["generation_tokens"]) == (prompt, completion)
    assert batching["finished"] == success


def test_a_salted_request_reuses_no_prefix_of_other_requests(base_url: str, traffic: list[dict]) -> None:
    """Every prompt of the traffic starts with the chat template's opening, which the replicas hold
    by now; a request under a salt of its own finds none of it, and answers as unsalted."""
    text = "Translate to German: good morning"
    salted = _chat(base_url, text, cache_salt=f"tenant-{uuid.uuid4().hex}")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    unsalted = _chat(base_url, text)
    assert salted["choices"][0]["message"]["content"] == unsalted["choices"][0]["message"]["content"]
    assert salted["usage"]["prompt_tokens"] == unsalted["usage"]["prompt_tokens"]


def test_reset_prefix_cache_drops_what_the_replicas_hold(base_url: str, traffic: list[dict]) -> None:
    """vLLM's POST /reset_prefix_cache, admin only: both replicas drop their held prefixes (the
    count it answers is what the gauge read), the next prompt finds nothing cached and answers
    as before."""
    text = "Translate to German: good morning"
    before = _chat(base_url, text)
    held = _scrape(base_url)["specroute_prefix_cache_tokens"][0].value
    assert held > 0
    r = requests.post(f"{base_url}/reset_prefix_cache", timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", r.text
    r = requests.post(f"{base_url}/reset_prefix_cache", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200 and r.json() == {"reset": True, "num_replicas": 2, "num_tokens": held}, r.text
    assert _scrape(base_url)["specroute_prefix_cache_tokens"][0].value == 0
    after = _chat(base_url, text)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]


def test_suffix_cache_size_is_reported(base_url: str, traffic: list[dict]) -> None:
    """The replicas' suffix caches hold what they served, within their budgets: a gauge per
    domain (the policy's domains only) and the budget, summed over the two replicas, in /metrics
    and /v1/stats."""
    budget = 2 * SuffixDrafterConfig().cache_tokens
    fams = _scrape(base_url)
    assert [(s.labels, s.value) for s in fams["specroute_suffix_cache_max_tokens"]] == [({"drafter": "suffix"}, budget)]
    held = {s.labels["domain"]: s.value for s in fams["specroute_suffix_cache_tokens"]}
    assert {s.labels["drafter"] for s in fams["specroute_suffix_cache_tokens"]} == {"suffix"}
    assert set(held) <= DOMAINS and 0 < sum(held.values()) <= budget
    stats = requests.get(f"{base_url}/v1/stats", timeout=30).json()
    assert stats["suffix_caches"] == {"suffix": {"tokens": held, "max_tokens": budget}}


def test_replicas_sharing_redis_report_identical_totals(base_url: str, traffic: list[dict]) -> None:
    from ray import serve

    worker = serve.get_deployment_handle("TargetWorker", app_name="specroute")
    answers = worker.broadcast("observe").results(timeout_s=60)
    assert len({a["replica"] for a in answers}) == 2
    # both served some of the traffic, and each sees all of it: the store is shared
    assert all(status["num_finished"] > 0 for status in worker.broadcast("status").results(timeout_s=60))
    snapshots = [StatsSnapshot.from_json(a["all_time"]) for a in answers]
    assert snapshots[0] == snapshots[1]  # the same Redis keys, read by each
    total = sum(r["speculation"]["num_draft_tokens"] for r in RESPONSES)
    for a in answers:
        obs = Observation.from_json(a)
        assert sum(obs.all_time.counts(d, r).num_draft_tokens for d in DOMAINS for r in DRAFTERS) == total
    scrapes = [_scrape(base_url) for _ in range(4)]
    spec_decode = [{k: v for k, v in s.items() if "spec_decode" in k or "routing" in k} for s in scrapes]
    assert all(s == spec_decode[0] for s in spec_decode)


def test_stats_endpoint(base_url: str, traffic: list[dict]) -> None:
    stats = requests.get(f"{base_url}/v1/stats", timeout=60).json()
    assert set(stats["domains"]) == DOMAINS and set(stats["drafters"]) == DRAFTERS
    specs = [r["speculation"] for r in RESPONSES]
    window_tokens = sum(arm["window"]["num_draft_tokens"] for d in stats["domains"].values()
                        for arm in d["drafters"].values())
    assert window_tokens == sum(s["num_draft_tokens"] for s in specs)
    for domain in stats["domains"].values():
        for arm in domain["drafters"].values():
            w = arm["window"]
            if w["num_draft_tokens"]:
                assert w["acceptance_rate"] == w["num_accepted_tokens"] / w["num_draft_tokens"]
                assert all(0 <= a <= 1 for a in w["acceptance_by_position"])
                assert w["mean_acceptance_length"] >= 1
    assert stats["domains"]["code"]["drafters"]["ngram"]["predicted_speedup"] > 0
    series = stats["series"]
    assert len(series["start_s"]) >= 30 and series["bucket_s"] == 10  # the 300 s policy window
    assert sum(sum(v) for v in series["draft_tokens"].values()) == window_tokens
    assert sum(sum(v) for v in series["decisions"].values()) == len(RESPONSES)
    assert all(len(v) == len(series["start_s"]) for v in series["acceptance_rate"].values())


def test_grafana_dashboard_queries_existing_metrics(base_url: str, traffic: list[dict]) -> None:
    dashboard = json.loads((REPO / "deploy/grafana/specroute.json").read_text())
    panels = dashboard["panels"] + [p for row in dashboard["panels"] for p in row.get("panels", [])]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and len(ids) > 10
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    exprs = [t["expr"] for p in panels for t in p.get("targets", [])]
    assert exprs and all(t["datasource"]["uid"] == "${datasource}" for p in panels for t in p.get("targets", []))
    used = {m for e in exprs for m in METRIC.findall(e)}
    used |= {m for v in variables.values() for m in METRIC.findall(v.get("definition", ""))}
    assert used - _exposed_names(_scrape_text(base_url)) == set()
    # every contract metric has a panel
    contract = {"specroute_spec_decode_num_accepted_tokens_per_pos_total", "specroute_routing_decisions_total",
                "specroute_fallback_total", "specroute_expected_speedup", "specroute_measured_speedup",
                "specroute_time_to_first_token_seconds_bucket", "specroute_inter_token_latency_seconds_bucket",
                "specroute_e2e_request_latency_seconds_bucket", "specroute_draft_stage_seconds_bucket",
                "specroute_verify_stage_seconds_bucket", "specroute_stats_store_connected"}
    assert contract <= used
    assert {"specroute_response_store_connected", "specroute_response_store_errors_total",
            "specroute_response_store_local", "specroute_background_responses",
            "specroute_background_responses_limit"} <= used
    assert {"specroute_prefix_cache_hits_total", "specroute_prefix_cache_queries_total",
            "specroute_num_preemptions_total", "specroute_prefix_cache_tokens", "specroute_prompt_tokens_total",
            "specroute_generation_tokens_total", "specroute_kv_cache_usage_perc",
            "specroute_request_queue_time_seconds_bucket", "specroute_request_success_total"} <= used
    for name in ("datasources/prometheus.yaml", "dashboards/specroute.yaml"):
        assert yaml.safe_load((REPO / "deploy/grafana/provisioning" / name).read_text())["apiVersion"] == 1


def test_prometheus_config_and_alert_rules(base_url: str, traffic: list[dict]) -> None:
    config = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    assert config["scrape_configs"][0]["metrics_path"] == "/metrics"
    rules_path = REPO / "deploy" / config["rule_files"][0]
    rules = [r for g in yaml.safe_load(rules_path.read_text())["groups"] for r in g["rules"]]
    alerts = {r["alert"]: r for r in rules}
    assert {"SpecRouteAcceptanceRateDrop", "SpecRouteFallbackSurge", "SpecRouteStatsStoreDisconnected",
            "SpecRouteResponseStoreDisconnected"} <= set(alerts)
    exposed = _exposed_names(_scrape_text(base_url))
    for rule in rules:
        used = set(METRIC.findall(rule["expr"]))
        assert used and used <= exposed, (rule["alert"], used - exposed)
        assert rule["labels"]["severity"] in ("warning", "critical") and rule["annotations"]["summary"]
    assert "[6h]" in alerts["SpecRouteAcceptanceRateDrop"]["expr"]  # against its recent baseline


# -- PUT /v1/policy ----------------------------------------------------------------------------------
def _policy_text(version: str, k_min: int = 1) -> str:
    text = DEFAULT_POLICY_PATH.read_text().replace('version: "default-7"', f'version: "{version}"')
    return text.replace("k_min: 1\n", f"k_min: {k_min}\n", 1)  # the first domain (code)


def _put(base_url: str, body: str | bytes, token: str | None = TOKEN) -> requests.Response:
    headers = {"content-type": "application/yaml"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    return requests.put(f"{base_url}/v1/policy", data=body, headers=headers, timeout=60)


def _versions(base_url: str, n: int = 4) -> set[str]:
    return {_chat(base_url, f"Hi {i}", max_tokens=4)["speculation"]["policy_version"] for i in range(n)}


def test_put_policy_needs_the_admin_token(base_url: str) -> None:
    for token in (None, "wrong"):
        r = _put(base_url, _policy_text("nope"), token)
        assert r.status_code == 401 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert "nope" not in _versions(base_url)


def test_put_bad_policy_is_400_naming_the_field_and_the_old_one_stays(base_url: str) -> None:
    before = requests.get(f"{base_url}/v1/stats", timeout=60).json()["policy_version"]
    r = _put(base_url, _policy_text("bad-1", k_min=12))  # code: k_max 10 < k_min 12
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "domains.code.k_max" and "k_min" in error["message"]
    assert error["type"] == "invalid_request_error"
    r = _put(base_url, json.dumps({"version": "bad-2", "default_domain": "chat",
                                   "domains": {"chat": {"drafters": ["eagle"]}}}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "domains.chat.drafters"
    assert _put(base_url, b"version: [").status_code == 400
    assert _versions(base_url) == {before}


def test_put_policy_reaches_every_replica(base_url: str) -> None:
    from ray import serve

    r = _put(base_url, _policy_text("put-2"))
    assert r.status_code == 200, r.text
    assert r.json()["version"] == "put-2" and r.json()["num_replicas"] == 2
    assert _versions(base_url, 6) == {"put-2"}
    worker = serve.get_deployment_handle("TargetWorker", app_name="specroute")
    assert {a["policy_version"] for a in worker.broadcast("observe").results(timeout_s=60)} == {"put-2"}
    # Serve's user_config path: a bad policy is logged and kept out, a good one swapped in
    worker.broadcast("reconfigure", {"policy": {"version": "uc-bad"}}).results(timeout_s=60)
    assert {a["policy_version"] for a in worker.broadcast("observe").results(timeout_s=60)} == {"put-2"}
    worker.broadcast("reconfigure", {"policy": str(DEFAULT_POLICY_PATH)}).results(timeout_s=60)
    assert {a["policy_version"] for a in worker.broadcast("observe").results(timeout_s=60)} == {"default-7"}
