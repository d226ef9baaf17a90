"""The replica's periodic stats lines (vLLM's): the interval's figures from the batching stats and
the steps, and when lines are due."""

from __future__ import annotations

from policies.records import PLAIN, BatchingStats
from workers.result import GenerationResult, RoutingReport, StepStats
from workers.stats_log import SpecCounts, StatsLogger, finished_line, received_line, stats_lines


def _step(drafter: str, k: int, accepted: int) -> StepStats:
    return StepStats(drafter, k, k, accepted, accepted + 1, 0.001, 0.01, 100)


def test_lines_give_the_interval_rates_acceptance_and_drafters() -> None:
    before = BatchingStats(num_prompt_tokens=100, prefix_queries=100, prefix_hits=10).step(1, 1, 5, 0.1)
    now = BatchingStats(num_running=3, num_waiting=1, num_prompt_tokens=300, prefix_queries=300, prefix_hits=130,
                        kv_cache_used_tokens=41, kv_cache_tokens=1000).step(1, 1, 45, 0.1)
    spec = SpecCounts()
    for step in (_step("ngram", 4, 2), _step("ngram", 3, 0), _step("suffix", 2, 2), _step(PLAIN, 0, 0)):
        spec.add(step)
    first, second = stats_lines(before, now, spec, 2.0)
    assert first == ("Avg prompt throughput: 100.0 tokens/s, Avg generation throughput: 20.0 tokens/s, "
                     "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 4.1%, Prefix cache hit rate: 60.0%")
    # 3 drafts, 9 tokens, 4 accepted; position 0 drafted 3 times (accepted twice), 3 once (never)
    assert second == ("SpecDecoding metrics: Mean acceptance length: 2.33, Accepted: 4 tokens, Drafted: 9 tokens, "
                      "Per-position acceptance rate: 0.667, 0.667, 0.000, 0.000, Avg Draft acceptance rate: 44.4%, "
                      "Steps by drafter: ngram 50%, suffix 25%, none 25%")
    plain = SpecCounts()
    plain.add(_step(PLAIN, 0, 0))
    assert stats_lines(now, now, plain, 1.0)[1] == "SpecDecoding metrics: no drafts, Steps by drafter: none 100%"
    for _ in range(299):
        plain.add(_step(PLAIN, 0, 0))
    plain.add(_step("ngram", 0, 0))  # asked, proposed nothing
    assert stats_lines(now, now, plain, 1.0)[1].endswith("Steps by drafter: none 100%, ngram <1%")
    assert "KV cache usage: -, Prefix cache hit rate: -" in stats_lines(BatchingStats(), BatchingStats(), SpecCounts(),
                                                                        1.0)[0]


def test_lines_come_once_an_interval_with_steps_is_over() -> None:
    log = StatsLogger(10.0)
    stats = BatchingStats()
    assert log.due_in(0.0) is None and log.lines(lambda: stats, 100.0) == []  # no step: nothing to say
    log.step([_step("ngram", 2, 1)], 100.0, lambda: stats)  # the first step starts an interval
    assert log.due_in(104.0) == 6.0 and log.lines(lambda: stats, 104.0) == []
    done = stats.step(1, 3, 2, 0.01)
    first = log.lines(lambda: done, 110.0)  # over: every step of it, over its 10 s
    assert first[0].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.2 tokens/s")
    assert "Accepted: 1 tokens, Drafted: 2 tokens" in first[1]
    assert log.due_in(111.0) is None and log.lines(lambda: done, 500.0) == []  # idle: no lines
    # the first step after an idle stretch starts a new interval there, not at the last lines
    log.step([_step(PLAIN, 0, 0)], 500.0, lambda: done)
    assert log.due_in(505.0) == 5.0
    later = log.lines(lambda: done.step(1, 1, 30, 0.01), 510.0)
    assert later[0].startswith("Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 3.0 tokens/s")
    assert later[1] == "SpecDecoding metrics: no drafts, Steps by drafter: none 100%"


def test_request_lines_show_the_prompt_the_settings_and_the_outcome() -> None:
    line = received_line("Summarize: " + "x" * 50, {"max_tokens": 32, "stop": ("\n",)}, 20)
    assert line == ("Received request: prompt: 'Summarize: xxxxxxxxx... (61 characters)', "
                    "params: {max_tokens=32, stop=('\\n',)}")
    chat = received_line([{"role": "user", "content": "Hi"}], {}, None)
    assert chat == 'Received request: prompt: \'[{"role": "user", "content": "Hi"}]\', params: {}'
    report = RoutingReport("code", "model", 0.9, "default-7", "ngram", 4, "best", 1.4, (), ())
    result = GenerationResult([1, 2, 3], [4, 5, 6, 7], "text", "length", 2, 4, 2, [1, 1], [1, 1], ["ngram"], 0.01,
                              0.25, 0.05, routing=report, num_cached_tokens=2)
    assert finished_line(result) == (
        "Finished request: length, 3 prompt tokens (2 cached), 4 output tokens in 2 steps (mean acceptance "
        "length 2.00; drafters ngram, domain code, plan ngram (best)), TTFT 0.050 s, total 0.250 s")
