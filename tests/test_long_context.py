"""Long sequences: the context limit (the model's positions, bounded by the KV memory), admission
that waits for KV room rather than failing, freed slots giving their memory back, routing that
re-plans in each context bucket a request enters, and 7,000 prompt tokens + 1,000 generated over
HTTP with streaming (a tiny random Llama with the shipped target's 8,192 positions)."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests
import torch
from helpers import serve_tiny_app
from test_routing import policy_dict

from policies.records import PLAIN
from policies.schema import load_policy
from policies.stats import MemoryStats
from workers.batch import BatchEngine
from workers.config import EngineConfig, NgramDrafterConfig, SchedulerConfig, TargetConfig
from workers.engine import RequestError, SpecEngine, StepOrder, context_limit
from workers.models.llama import KVPool
from workers.routing import Router, generate
from workers.sampling import SamplingParams

POSITIONS = 8192
MODEL = "tiny-long"


def long_config(model_dir: Path, **scheduler: float) -> EngineConfig:
    return EngineConfig(target=TargetConfig(model=str(model_dir)), drafters=[NgramDrafterConfig()],
                        scheduler=SchedulerConfig(**scheduler))


def token_ids(engine: SpecEngine, n: int) -> list[int]:
    """n prompt tokens of varied text (prompt lookup finds some repeats, not everywhere)."""
    words = " ".join(f"item {i % 97} of list {i % 13} is {i * 7919 % 1009}." for i in range(n))
    return engine.tokenizer.encode(words)[:n]


# -- the context limit ---------------------------------------------------------------------------

@pytest.mark.parametrize(("configured", "kv_tokens", "expected"), [
    (None, None, 8192),  # the model's positions
    (None, 5000, 5000),  # what the KV memory holds
    (2048, 10**6, 2048),  # the configured limit
    (10_000, None, 8192),  # never past the model's positions
    (8192, 3000, 3000),
])
def test_context_limit(configured: int | None, kv_tokens: int | None, expected: int) -> None:
    assert context_limit(configured, POSITIONS, kv_tokens) == expected


def test_max_model_len_defaults_to_the_models_positions_within_the_kv_memory(long_llama_dir: Path) -> None:
    engine = SpecEngine.from_config(long_config(long_llama_dir))
    info = engine.target.model.info
    assert engine.max_model_len == POSITIONS == info.max_position
    assert info.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads of 16, float32
    small = SpecEngine.from_config(long_config(long_llama_dir, kv_cache_gib=3000 * info.kv_bytes_per_token / 2**30))
    assert small.kv_cache_tokens == small.max_model_len == 3000
    small.check_request([1] * 2900, SamplingParams(max_tokens=100))
    with pytest.raises(RequestError, match="maximum context length is 3000") as e:
        small.check_request([1] * 2901, SamplingParams(max_tokens=100))
    assert e.value.param == "prompt"


# -- KV memory ---------------------------------------------------------------------------------------

def test_admission_waits_for_kv_room_and_never_fails(long_llama_dir: Path) -> None:
    """Two requests of 330 positions each under a 500-position budget: the second waits in the
    queue until the first finishes, then runs to the same output it has alone."""
    probe = SpecEngine.from_config(long_config(long_llama_dir))
    engine = SpecEngine.from_config(long_config(
        long_llama_dir, max_num_seqs=4, kv_cache_gib=500 * probe.target.model.info.kv_bytes_per_token / 2**30))
    assert engine.kv_cache_tokens == 500
    params = SamplingParams(max_tokens=300, ignore_eos=True)
    prompts = [token_ids(engine, 30), token_ids(engine, 30)[::-1]]
    alone = [engine.generate(p, params).token_ids for p in prompts]
    batch = BatchEngine(engine)
    gens = [batch.add(p, params) for p in prompts]
    batch.schedule()
    assert batch.running == [gens[0]] and list(batch.waiting) == [gens[1]]
    while batch.num_unfinished:
        decoding = batch.schedule()
        assert batch.num_reserved_tokens <= 500
        step = batch.step({g: StepOrder() for g in decoding})
        assert not step.failed
    assert [g.result().token_ids for g in gens] == alone
    for g in gens:
        g.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pages are returned with madvise on Linux")
def test_a_released_slot_gives_its_memory_back() -> None:
    pool = KVPool(4, 2, 2, 65536, 64, torch.float32, torch.device("cpu"))  # 256 MiB a slot, k and v
    rss = psutil.Process().memory_info
    slot_bytes = 2 * 4 * 2 * 65536 * 64 * 4
    cache = pool.allocate()
    before = rss().rss
    cache.k.fill_(1.0)
    cache.v.fill_(1.0)
    assert rss().rss - before > 0.9 * slot_bytes
    written = rss().rss
    pool.release(cache)
    assert written - rss().rss > 0.9 * slot_bytes
    assert torch.isfinite(pool.k[:, 0]).all() and torch.isfinite(pool.v[:, 0]).all()
    again = pool.allocate()  # the same slot, usable again
    assert again.slot == cache.slot and again.length == 0


# -- routing per context bucket --------------------------------------------------------------------

def test_a_request_entering_another_context_bucket_is_replanned(tiny_engine: SpecEngine) -> None:
    """500 prompt tokens + 40 generated cross 512: the policy plans again for the 512-1k bucket,
    and the report splits the steps by bucket."""
    router = Router(tiny_engine, load_policy(policy_dict()), MemoryStats(), seed=0)
    decided: list[int] = []
    decide = router.decide
    router.decide = lambda policy, features, candidates: (decided.append(features.context_len),  # type: ignore
                                                         decide(policy, features, candidates))[1]
    prompt = token_ids(tiny_engine, 500)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    result = generate(router, prompt, params, "a long list")
    spans = result.routing.context
    assert [s.bucket for s in spans] == ["0-512", "512-1k"]
    assert decided[0] == 500 and len(decided) == 2 and 512 <= decided[1] < 512 + 16
    assert sum(s.num_steps for s in spans) == result.num_steps
    assert sum(s.num_tokens for s in spans) == len(result.token_ids) == 40
    assert sum(s.num_accepted_tokens for s in spans) == result.num_accepted_tokens
    assert result.token_ids == tiny_engine.generate(prompt, params, PLAIN).token_ids


def test_a_forced_request_is_not_replanned(tiny_engine: SpecEngine) -> None:
    from workers.routing import Speculation

    router = Router(tiny_engine, load_policy(policy_dict()), MemoryStats(), seed=0)
    calls: list[int] = []
    router.decide = lambda *a: calls.append(1)  # type: ignore[method-assign,assignment]
    routed = generate(router, token_ids(tiny_engine, 500), SamplingParams(max_tokens=30, ignore_eos=True),
                      "text", Speculation("ngram", 3))
    assert not calls and [s.bucket for s in routed.routing.context] == ["0-512", "512-1k"]


# -- over HTTP ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base_url(long_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_tiny_app(long_config(long_llama_dir), tmp_path_factory.mktemp("serve-long"), MODEL) as url:
        yield url


def test_7000_prompt_tokens_and_1000_generated_stream_over_http(base_url: str, long_llama_dir: Path) -> None:
    models = requests.get(f"{base_url}/v1/models", timeout=30).json()
    assert models["data"][0]["max_model_len"] == POSITIONS
    engine_tokenizer = SpecEngine.from_config(long_config(long_llama_dir))
    prompt = engine_tokenizer.tokenizer.decode(token_ids(engine_tokenizer, 7000))
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with requests.post(f"{base_url}/v1/completions", json=body, stream=True, timeout=600) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if line and line != b"data: [DONE]":
                events.append(json.loads(line[len(b"data: "):]))
    text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
    usage = next(e["usage"] for e in events if e.get("usage"))
    spec = next(e["speculation"] for e in events if e.get("speculation"))
    assert text and usage["completion_tokens"] == 1000 and usage["prompt_tokens"] >= 6900
    assert [s["bucket"] for s in spec["context"]] == ["4k+"]
    assert sum(s["num_tokens"] for s in spec["context"]) == 1000
    assert sum(s["num_steps"] for s in spec["context"]) == spec["num_steps"]
    # past the limit: a 400 naming the prompt, as before
    too_long = {**body, "stream": False, "max_tokens": 1200}
    r = requests.post(f"{base_url}/v1/completions", json=too_long, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
