"""Prometheus exposition (`GET /metrics`), rendered at scrape time from one worker's `observe()`.

There are no process-local counters: every value comes from the stats store, so with the shared
(Redis) store each replica, and each scrape, reports the same totals; with the in-memory store a
scrape shows the replica that answered. Names mirror vLLM's spec-decode metrics, prefixed
`specroute_`. Label values come from the configured lists only (the policy's domains, the
engine's drafters, k in [0, max_draft_len]): names the store holds beyond those are dropped, so
label cardinality is bounded by configuration, not by traffic.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from policies.records import FINISH_REASONS, LATENCY_BUCKETS_S, PLAIN, Histogram
from router.observation import Observation

PREFIX = "specroute_"
# the classic text format, which generate_latest writes and every Prometheus accepts
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (store histogram name, metric name, label name or None, help)
HISTOGRAMS: tuple[tuple[str, str, str | None, str], ...] = (
    ("ttft", "time_to_first_token_seconds", None, "Time from admission to the first emitted token"),
    ("itl", "inter_token_latency_seconds", None, "Seconds per emitted token, per step"),
    ("e2e", "e2e_request_latency_seconds", None, "Request latency, admission to last token"),
    ("draft", "draft_stage_seconds", "drafter", "Seconds a drafter spent proposing, per step"),
    ("verify", "verify_stage_seconds", "draft_len", "Seconds of the target forward verifying draft_len tokens"),
)


class SpecRouteCollector:
    """A prometheus_client collector over one Observation."""

    def __init__(self, obs: Observation) -> None:
        self.obs = obs

    def collect(self) -> Iterator[Metric]:
        yield from self._spec_decode()
        yield from self._routing()
        yield from self._speedup()
        yield from self._histograms()
        yield from self._batching()
        yield from self._traffic_memory()
        yield from self._store()
        yield from self._background()

    def _spec_decode(self) -> Iterator[Metric]:
        labels = ["domain", "drafter"]
        drafts = CounterMetricFamily(f"{PREFIX}spec_decode_num_drafts", "Steps that proposed >= 1 draft token",
                                     labels=labels)
        tokens = CounterMetricFamily(f"{PREFIX}spec_decode_num_draft_tokens", "Draft tokens proposed",
                                     labels=labels)
        accepted = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                       labels=labels)
        per_pos = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position (0-based)",
                                      labels=[*labels, "position"])
        for domain in self.obs.domains:
            for drafter in self.obs.drafters:
                c = self.obs.all_time.counts(domain, drafter)
                drafts.add_metric([domain, drafter], c.num_drafts)
                tokens.add_metric([domain, drafter], c.num_draft_tokens)
                accepted.add_metric([domain, drafter], c.num_accepted_tokens)
                for i in range(min(len(c.drafted_per_position), self.obs.max_draft_len)):
                    n = c.accepted_per_position[i] if i < len(c.accepted_per_position) else 0
                    per_pos.add_metric([domain, drafter, str(i)], n)
        yield from (drafts, tokens, accepted, per_pos)

    def _routing(self) -> Iterator[Metric]:
        domains, drafters = set(self.obs.domains), {*self.obs.drafters, PLAIN}
        decisions = CounterMetricFamily(f"{PREFIX}routing_decisions", "Requests routed, by the plan's drafter "
                                        "and why (best, explore, fallback, policy, forced)",
                                        labels=["domain", "drafter", "reason"])
        for (domain, drafter, reason), n in sorted(self.obs.all_time.decisions.items()):
            if domain in domains and drafter in drafters:
                decisions.add_metric([domain, drafter, reason], n)
        fallbacks = CounterMetricFamily(f"{PREFIX}fallback", "Switches to plain decoding within requests",
                                        labels=["domain", "reason"])
        for (domain, reason), n in sorted(self.obs.all_time.fallbacks.items()):
            if domain in domains:
                fallbacks.add_metric([domain, reason], n)
        info = GaugeMetricFamily(f"{PREFIX}policy_info", "The routing policy in force (value 1)",
                                 labels=["version"])
        info.add_metric([self.obs.policy_version], 1)
        yield from (decisions, fallbacks, info)

    def _speedup(self) -> Iterator[Metric]:
        domains, drafters = set(self.obs.domains), set(self.obs.drafters)
        expected = GaugeMetricFamily(f"{PREFIX}expected_speedup", "The policy's predicted speedup over plain "
                                     "decoding at its best k (statistics window plus priors)",
                                     labels=["domain", "drafter"])
        for arm in self.obs.outlook:
            if arm.domain in domains and arm.drafter in drafters and arm.predicted_speedup is not None:
                expected.add_metric([arm.domain, arm.drafter], arm.predicted_speedup)
        measured = GaugeMetricFamily(f"{PREFIX}measured_speedup", "Tokens per second over plain decoding's, "
                                     "measured over the statistics window", labels=["domain"])
        for domain in self.obs.domains:
            value = self.obs.measured_speedup.get(domain)
            if value is not None:
                measured.add_metric([domain], value)
        yield from (expected, measured)

    def _histograms(self) -> Iterator[Metric]:
        allowed = {
            "drafter": set(self.obs.drafters),
            "draft_len": {str(k) for k in range(self.obs.max_draft_len + 1)},
        }
        for name, metric, label, help_ in HISTOGRAMS:
            family = HistogramMetricFamily(f"{PREFIX}{metric}", help_, labels=[label] if label else [])
            if label is None:
                hist = self.obs.all_time.histogram(name)
                family.add_metric([], _buckets(hist), hist.sum_s)
            else:
                values = sorted({lab for n, lab in self.obs.all_time.histograms if n == name} & allowed[label],
                                key=lambda v: (len(v), v))
                for value in values:
                    hist = self.obs.all_time.histogram(name, value)
                    family.add_metric([value], _buckets(hist), hist.sum_s)
            yield family

    def _batching(self) -> Iterator[Metric]:
        b = self.obs.batching
        yield GaugeMetricFamily(f"{PREFIX}num_requests_running", "Requests in the running batch", value=b.num_running)
        yield GaugeMetricFamily(f"{PREFIX}num_requests_waiting", "Requests waiting to be admitted to the batch",
                                value=b.num_waiting)
        for name, hist, help_ in (
            ("batch_size", b.batch_size, "Requests in one target forward (decoding or prefilling), per step"),
            ("step_tokens", b.step_tokens, "Target rows (tokens) in one forward, per step"),
            ("request_queue_time_seconds", b.queue_s,
             "Seconds a finished request waited, from the ingress to its first admission"),
            ("request_prompt_tokens", b.request_prompt_tokens, "Prompt tokens of each finished request"),
            ("request_generation_tokens", b.request_generation_tokens, "Tokens generated for each finished request"),
        ):
            family = HistogramMetricFamily(f"{PREFIX}{name}", help_)
            family.add_metric([], _cumulative(hist.edges, hist.counts), hist.total)
            yield family
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_queries", "Prompt tokens of the requests admitted",
                                  value=b.prefix_queries)
        yield CounterMetricFamily(f"{PREFIX}prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache, not prefilled", value=b.prefix_hits)
        yield GaugeMetricFamily(f"{PREFIX}prefix_cache_tokens", "Positions finished requests keep in free KV slots",
                                value=b.prefix_held_tokens)
        yield CounterMetricFamily(f"{PREFIX}num_preemptions", "Running requests preempted for requests of higher "
                                  "priority", value=b.num_preemptions)
        yield CounterMetricFamily(f"{PREFIX}prompt_tokens", "Prompt tokens of the requests admitted",
                                  value=b.num_prompt_tokens)
        yield CounterMetricFamily(f"{PREFIX}generation_tokens", "Tokens emitted", value=b.num_emitted)
        success = CounterMetricFamily(f"{PREFIX}request_success", "Requests that left the batch, by why: stop, "
                                      "length, abort (cancelled by the client) or error", labels=["finished_reason"])
        for reason, n in zip(FINISH_REASONS, b.finished):
            success.add_metric([reason], n)
        yield success
        if (usage := b.kv_cache_usage) is not None:
            yield GaugeMetricFamily(f"{PREFIX}kv_cache_usage_perc", "The share of the KV cache the running requests "
                                    "reserve (1 = full), over the replicas", value=usage)
        if (goodput := b.goodput) is not None:
            yield GaugeMetricFamily(f"{PREFIX}goodput_tokens_per_second",
                                    "Tokens emitted per second of target steps, since the replicas started",
                                    value=goodput)

    def _traffic_memory(self) -> Iterator[Metric]:
        if not self.obs.traffic_memory:
            return
        held = GaugeMetricFamily(f"{PREFIX}suffix_cache_tokens", "Past output tokens a suffix drafter keeps, per "
                                 "domain (summed over replicas: each keeps its own)", labels=["drafter", "domain"])
        budget = GaugeMetricFamily(f"{PREFIX}suffix_cache_max_tokens", "A suffix drafter's token budget over all "
                                   "domains, summed over replicas (oldest requests evicted past it)",
                                   labels=["drafter"])
        for drafter, memory in self.obs.traffic_memory.items():
            for domain, tokens in memory.tokens.items():
                if domain in self.obs.domains:  # a domain an earlier policy had keeps its memory, unexported
                    held.add_metric([drafter, domain], tokens)
            budget.add_metric([drafter], memory.max_tokens)
        yield from (held, budget)

    def _store(self) -> Iterator[Metric]:
        health = self.obs.store
        yield _by_backend(GaugeMetricFamily, "stats_store_connected", "1 while the statistics store answers "
                          "(per replica)", health.backend, int(health.connected))
        yield _by_backend(CounterMetricFamily, "stats_store_errors", "Failed statistics store operations since the "
                          "replica started", health.backend, health.num_errors)
        yield _by_backend(GaugeMetricFamily, "stats_store_pending_local", "Steps buffered in the replica, not yet in "
                          "the shared store", health.backend, health.num_pending_local)
        yield _by_backend(CounterMetricFamily, "stats_store_dropped", "Steps lost because the local buffer was full",
                          health.backend, health.num_dropped)
        if (responses := self.obs.response_store) is None:
            return
        yield _by_backend(GaugeMetricFamily, "response_store_connected", "1 while the stored responses' store answers",
                          responses.backend, int(responses.connected))
        yield _by_backend(CounterMetricFamily, "response_store_errors", "Failed operations of the stored responses' "
                          "Redis since the ingress started", responses.backend, responses.num_errors)
        yield _by_backend(GaugeMetricFamily, "response_store_local", "Stored responses in the ingress's memory "
                          "(redis: those stored while it was unreachable, until it answers again)", responses.backend,
                          responses.num_local)

    def _background(self) -> Iterator[Metric]:
        if (background := self.obs.background) is None:
            return
        yield GaugeMetricFamily(f"{PREFIX}background_responses", "Background responses the ingress holds, queued or "
                                "generated", value=background.num_held)
        yield GaugeMetricFamily(f"{PREFIX}background_responses_limit", "Background responses the ingress may hold "
                                "(max_background_responses)", value=background.max_held)


def _by_backend(
    family: type[GaugeMetricFamily | CounterMetricFamily], name: str, documentation: str, backend: str, value: float,
) -> Metric:
    """A store's metric: one sample, labelled by the store's backend."""
    metric = family(f"{PREFIX}{name}", documentation, labels=["backend"])
    metric.add_metric([backend], value)
    return metric


def _buckets(hist: Histogram) -> list[tuple[str, float]]:
    return _cumulative(LATENCY_BUCKETS_S, hist.counts)


def _cumulative(edges: Sequence[float], counts: Sequence[int]) -> list[tuple[str, float]]:
    """Cumulative (le, count) pairs ending with +Inf, as Prometheus histograms expose them."""
    out, total = [], 0
    for edge, n in zip((*edges, float("inf")), counts):
        total += n
        out.append((floatToGoString(edge), total))
    return out


def render(obs: Observation) -> bytes:
    """The Prometheus text exposition of one observation (a fresh registry per scrape)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SpecRouteCollector(obs))
    return generate_latest(registry)
