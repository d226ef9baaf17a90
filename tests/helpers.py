"""Test helpers more than one module needs (importable: pytest puts tests/ on sys.path).

- `serve_tiny_app`: the real Serve application over HTTP on a free port, the tiny target.
- `throwaway_redis_server`: a redis-server of the test's own, to stop and restart.
- `first_two_tokens_joint` / `assert_follows_joint`: the seeded statistical check that sampled
  speculative decoding keeps the target's exact joint distribution of its first two tokens;
  `TwoTokenCase` sets it up the way every drafter's test uses it.
- `write_eagle` / `write_medusa_heads`: random EAGLE and Medusa checkpoints for the tiny target.
- `chain_accepts`: what a greedy k = 1 chain accepts, given bench/agreement.py's per-position hits.
- `assert_same_or_tie`: a greedy output equals the expected one, or first differs where the
  target's top two logits tie within float rounding.
- `compact_target_engine` / `compact_prompts` / `logits_three_ways` / `decode_three_ways` /
  `tree_rows_and_chains`: the shipped target in a compact weight format (int4, bfloat16) and
  the checks that its rows score and decode the same alone, in a verify chain, in a batch and as
  a draft tree's nodes.
- `slow_device_waits`: a module's `synchronize` replaced by a recorded stand-in wait, for the
  checks that timed GPU work is clocked after the device finishes.
- `HERMES_TEMPLATE`: a chat template that renders tools and writes calls as Hermes' blocks.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import requests
import torch
import yaml
from scipy.stats import chisquare

from router.run_batch import free_port
from workers.batch import BatchEngine
from workers.config import PLAIN, EngineConfig, LookaheadDrafterConfig, NgramDrafterConfig, TargetConfig
from workers.drafters.eagle import EagleConfig, EagleNet
from workers.drafters.medusa import MedusaConfig, MedusaHeads
from workers.engine import GenerationResult, SpecEngine, StepOrder
from workers.models.base import CausalLM, SeqInput
from workers.sampling import SamplingParams, probs_from_logits
from workers.tree import DraftTree


def slow_device_waits(monkeypatch: pytest.MonkeyPatch, module: str, wait_s: float) -> list[torch.device]:
    """`module`'s synchronize waits `wait_s` (a GPU finishing queued work); the devices it was
    called for, in order."""
    waits: list[torch.device] = []

    def slow_sync(device: torch.device) -> None:
        waits.append(device)
        time.sleep(wait_s)

    monkeypatch.setattr(f"{module}.synchronize", slow_sync)
    return waits


# A replica shutting down waits Serve's graceful_shutdown_wait_loop_s (2 s) for routers to stop
# sending it requests; a test's app going down has no traffic left, so its replicas need not wait.
SHUTDOWN_QUICKLY = {name: {"name": name, "graceful_shutdown_wait_loop_s": 0.1} for name in ("OpenAIIngress",
                                                                                          "TargetWorker")}


def tiny_serve_config(engine: EngineConfig, workdir: Path, model_name: str, deployments: list[dict] | None = None,
                      **args: Any) -> tuple[Path, int]:
    """A Serve config of the app on 127.0.0.1 and a free port, one CPU replica unless `args` say
    otherwise; `deployments`: the Serve config's per-deployment overrides. Its path, and the port."""
    port = free_port()
    by_name = dict(SHUTDOWN_QUICKLY)
    for d in deployments or []:
        by_name[d["name"]] = {**by_name.get(d["name"], {}), **d}
    app_args = {"served_model_name": model_name, "engine": engine.model_dump(mode="json"), "max_ongoing_requests": 8,
                "num_replicas": 1, "num_cpus": 1, "num_gpus": 0,
                "allowed_dirs": sorted({str(path.parent) for _, path in engine.local_paths()}), **args}
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "specroute", "route_prefix": "/", "import_path": "router.app:build_app",
                          "args": app_args, "deployments": list(by_name.values())}],
    }
    path = workdir / "serve.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, port


@contextmanager
def serve_tiny_app(engine: EngineConfig, workdir: Path, model_name: str, deployments: list[dict] | None = None,
                   overrides: dict[str, Any] | None = None, **args: Any) -> Iterator[str]:
    """Ray (local) and the Serve app of `tiny_serve_config`, its args set by `overrides` as
    `specroute serve`'s flags set them. Yields the base URL and shuts Serve down after."""
    from router.serve import serve, shutdown

    path, port = tiny_serve_config(engine, workdir, model_name, deployments, **args)
    serve(path, host="127.0.0.1", port=port, blocking=False, overrides=overrides)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        shutdown()


def _answers(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.RedisError:
        return False


def num_finished(base_url: str, reason: str) -> float:
    """The app's requests finished for `reason` (vLLM's request_success_total{finished_reason}), from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{base_url}/metrics", timeout=30).text
    (family,) = (f for f in text_string_to_metric_families(text) if f.name == "specroute_request_success")
    return next((s.value for s in family.samples if s.labels["finished_reason"] == reason), 0.0)


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0, every_s: float = 0.025) -> None:
    """Poll `predicate` until it holds; AssertionError naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(every_s)


class ThrowawayRedis:
    """A redis-server of a test's own on a free port, that the test stops and restarts. Its RDB
    file lives in `directory`: `stop("save")` then `start()` is a restart that keeps the data."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.pidfile = directory / "redis.pid"
        self.argv = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(directory),
                     "--pidfile", str(self.pidfile), "--save", "", "--appendonly", "no", "--daemonize", "yes"]
        self.probe = redis.Redis.from_url(self.url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def start(self) -> None:
        subprocess.run(self.argv, check=True, capture_output=True)
        wait_for(lambda: _answers(self.probe), "redis-server to start")

    def stop(self, how: str = "nosave") -> None:
        subprocess.run(["redis-cli", "-p", str(self.port), "shutdown", how], capture_output=True)
        wait_for(lambda: not _answers(self.probe), "redis-server to stop")

    def signal(self, sig: signal.Signals) -> None:
        os.kill(int(self.pidfile.read_text()), sig)


@contextmanager
def throwaway_redis_server(directory: Path) -> Iterator[ThrowawayRedis]:
    """A started ThrowawayRedis, shut down after (skips the test without redis-server)."""
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    server = ThrowawayRedis(directory)
    server.start()
    try:
        yield server
    finally:
        if server.pidfile.exists():
            server.signal(signal.SIGCONT)  # a test may have paused it
            subprocess.run(["redis-cli", "-p", str(server.port), "shutdown", "nosave"], capture_output=True)
        server.probe.close()


def first_two_tokens_joint(model: CausalLM, prompt: list[int], params: SamplingParams) -> dict[tuple[int, int], float]:
    """The target's exact probability of each (first, second) sampled token pair."""
    cache = model.new_cache(len(prompt) + 2)
    p1 = probs_from_logits(model.forward(torch.tensor(prompt), cache, last_only=True).logits, params)[0]
    joint = {}
    for a in torch.nonzero(p1).flatten().tolist():
        cache.truncate(len(prompt))
        p2 = probs_from_logits(model.forward(torch.tensor([a]), cache).logits, params)[0]
        for b in torch.nonzero(p2).flatten().tolist():
            joint[(a, b)] = p1[a].item() * p2[b].item()
    return joint


def assert_follows_joint(
    joint: dict[tuple[int, int], float], num_trials: int, generate: Callable[[int], GenerationResult],
) -> list[GenerationResult]:
    """Run `generate(seed)` for seeds 0..num_trials-1 (two tokens each) and check the pairs
    against `joint` with a chi-square test; the results, for the caller's own checks."""
    cells = sorted(joint)
    index = {c: i for i, c in enumerate(cells)}
    counts = np.zeros(len(cells))
    results = [generate(seed) for seed in range(num_trials)]
    for result in results:
        counts[index[tuple(result.token_ids)]] += 1
    expected = np.array([joint[c] for c in cells]) * num_trials
    _, p_value = chisquare(counts, expected * counts.sum() / expected.sum())
    assert p_value > 1e-4, (counts, expected)
    return results


# two tokens at temperature 1.5 among the top 3: at most 9 pairs, each likely enough to count
TWO_TOKEN_PARAMS: dict[str, Any] = {"max_tokens": 2, "temperature": 1.5, "top_k": 3, "ignore_eos": True}


@dataclass(frozen=True)
class TwoTokenCase:
    """The sampled-losslessness case of the drafters' tests: a short prompt and the target's
    exact joint distribution of its first two sampled tokens (TWO_TOKEN_PARAMS)."""

    prompt: list[int]
    joint: dict[tuple[int, int], float]

    @classmethod
    def of(cls, engine: SpecEngine) -> TwoTokenCase:
        prompt = engine.encode("The weather today", chat=False)
        return cls(prompt, first_two_tokens_joint(engine.target.model, prompt, SamplingParams(**TWO_TOKEN_PARAMS)))

    def draft_vocab(self, vocab_size: int) -> list[int]:
        """Two of the target's possible first tokens and one it never samples: a draft vocabulary
        that takes both the accept and the reject path, and puts mass outside the target's support."""
        firsts = sorted({a for a, _ in self.joint})
        return [firsts[0], firsts[1], next(t for t in range(vocab_size) if t not in firsts)]

    def check(self, engine: SpecEngine, drafter: str, k: int, num_trials: int,
              draws: str = "stream") -> list[GenerationResult]:
        """`assert_follows_joint` over `engine` drafting k tokens with `drafter`, its seeded draws
        taken as `draws` says (stream: rejection sampling's); the results."""
        engine = with_draws(engine, draws)
        return assert_follows_joint(self.joint, num_trials, lambda seed: engine.generate(
            self.prompt, SamplingParams(seed=seed, **TWO_TOKEN_PARAMS), drafter, k))


def with_draws(engine: SpecEngine, draws: str) -> SpecEngine:
    """The engine over the same target and drafters, seeded requests drawing as `draws` says
    (EngineConfig.seeded_draws): the statistical tests check rejection sampling with "stream"."""
    return SpecEngine(engine.target, engine.drafters, engine.config.model_copy(update={"seeded_draws": draws}))


def tiny_eagle_config(engine: SpecEngine, draft_vocab: list[int] | None = None) -> EagleConfig:
    m = engine.target.model
    return EagleConfig(
        hidden_size=m.info.hidden_size, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        intermediate_size=2 * m.info.hidden_size, vocab_size=m.info.vocab_size,
        draft_vocab_size=None if draft_vocab is None else len(draft_vocab),
    )


def write_eagle(out: Path, engine: SpecEngine, draft_vocab: list[int] | None = None, seed: int = 0) -> Path:
    """A random EAGLE head whose draft head starts as the target's lm_head rows, so it proposes
    tokens the target likes now and then (acceptance between none and all)."""
    torch.manual_seed(seed)
    net = EagleNet(tiny_eagle_config(engine, draft_vocab))
    if draft_vocab is not None:
        ids = torch.tensor(draft_vocab)
        net.draft_vocab.copy_(ids)
        net.lm_head.weight.data.copy_(engine.target.model.lm_head.w_t.t()[ids])
    net.save(out)
    return out


def write_medusa_heads(out: Path, engine: SpecEngine, draft_vocab: list[int] | None = None, num_heads: int = 3,
                       seed: int = 0) -> Path:
    """Random residual blocks (Medusa's zero init would make every head repeat the target's
    next token); a shared reduced head starts as the target's lm_head rows."""
    m = engine.target.model
    cfg = MedusaConfig(num_heads, 1, m.info.hidden_size, m.info.vocab_size,
                       draft_vocab_size=None if draft_vocab is None else len(draft_vocab))
    torch.manual_seed(seed)
    heads = MedusaHeads(cfg)
    for p in heads.heads.parameters():
        p.data.normal_(0.0, 0.05)
    if draft_vocab is not None:
        ids = torch.tensor(draft_vocab)
        heads.draft_vocab.copy_(ids)
        heads.lm_head.weight.data.copy_(m.lm_head.w_t.t()[ids])
    heads.save(out)
    return out


def chain_accepts(hits: Sequence[bool], cut_by_max_tokens: bool) -> int:
    """Drafts a greedy k = 1 chain accepts along an answer whose per-position top-1 hits are
    `hits` (bench/agreement.py): a hit moves two tokens on (the draft and the bonus), a miss one.
    An answer cut by max_tokens has its last token from a plain step (no room for a bonus)."""
    accepted, t, end = 0, 0, len(hits) - cut_by_max_tokens
    while t < end:
        accepted, t = (accepted + 1, t + 2) if hits[t] else (accepted, t + 1)
    return accepted


def assert_same_or_tie(engine: Any, prompt: list[int], got: list[int], expected: list[int]) -> None:
    """Rows computed another way (a batch, a verify chain) may round differently: a difference
    must be a tie of the target's top two logits at the first differing position, never a real
    disagreement."""
    if got == expected:
        return
    i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    model = engine.target.model
    logits = model.forward(torch.tensor(prompt + expected[:i]), model.new_cache(len(prompt) + i + 1),
                           last_only=True).logits[0]
    top2 = logits.topk(2).values
    assert (top2[0] - top2[1]).item() < 1e-4, f"position {i}: {got[i:i + 3]} vs {expected[i:i + 3]}, top-2 {top2}"


def compact_target_engine(weights: str) -> SpecEngine:
    """The shipped target in `weights`, prompt lookup and lookahead decoding with two guesses (draft
    trees that branch), a batch of 3 with small prefill chunks."""
    return SpecEngine.from_config(EngineConfig(
        target=TargetConfig(weights=weights, max_model_len=1024),
        drafters=[NgramDrafterConfig(), LookaheadDrafterConfig(guesses=2)],
        scheduler={"max_num_seqs": 3, "max_num_batched_tokens": 64},
    ))


def compact_prompts(engine: SpecEngine, spec_bench: Callable[[str, int], list[dict]]) -> list[list[int]]:
    """Two summaries (long copies for prompt lookup), a writing and a math prompt."""
    questions = spec_bench("summarization", 2) + spec_bench("writing", 1) + spec_bench("math_reasoning", 1)
    return [engine.encode(q["turns"][0]) for q in questions]


# tokens scored at the end of each prompt: 33 grouped query rows on SmolLM2 (3 query heads a
# key/value head), one past SDPA's 32-row query block, as long as a lookahead step's verify
THREE_WAYS_TOKENS = 11


@dataclass
class ThreeWays:
    steps: torch.Tensor  # [THREE_WAYS_TOKENS, vocab]: the last tokens one forward each, alone
    chain: torch.Tensor  # the same tokens in one forward, alone
    batched: torch.Tensor  # the same tokens in one batched forward beside the other prompts'


def logits_three_ways(engine: SpecEngine, prompts: list[list[int]]) -> list[ThreeWays]:
    """Each prompt's last THREE_WAYS_TOKENS tokens scored alone step by step, as a verify chain,
    and in a batch (the heads prefilled side by side in a pool)."""
    n = THREE_WAYS_TOKENS
    model = engine.target.model
    pool = model.new_pool(len(prompts), 1024)
    caches = [pool.allocate() for _ in prompts]
    heads, tails = [torch.tensor(p[:-n]) for p in prompts], [torch.tensor(p[-n:]) for p in prompts]
    model.forward_batch([SeqInput(h, c, "none") for h, c in zip(heads, caches)])
    batched = model.forward_batch([SeqInput(t, c, "all") for t, c in zip(tails, caches)])
    out = []
    for head, tail, b in zip(heads, tails, batched):
        alone = model.new_cache(1024)
        model.forward(head, alone, last_only=True)
        chain = model.forward(tail, alone).logits
        alone.truncate(head.numel())
        steps = torch.cat([model.forward(tail[i : i + 1], alone).logits for i in range(n)])
        out.append(ThreeWays(steps, chain, b.logits))
    return out


@dataclass
class TreeRows:
    tree: DraftTree
    alone: torch.Tensor  # [len(tree) + 1, vocab]: the tree's rows, the tree alone in its forward
    batched: torch.Tensor  # the same in a batched forward beside a decode step
    among_trees: torch.Tensor  # the same in a batched forward of draft trees only
    chains: torch.Tensor  # each input's row scored in a chain of its root path (DraftTree.root_paths)


def tree_rows_and_chains(engine: SpecEngine, prompt: list[int], trees: int = 4, seed: int = 0) -> list[TreeRows]:
    """Random draft trees (3-14 nodes, the prompt's tokens) after prefixes of random length, each
    scored as a tree alone, in a batch beside a decode step and in one beside another tree, and
    each node again as the last input of a chain of its root path: what plain decoding computes
    for it after its ancestors."""
    model, rng = engine.target.model, random.Random(seed)
    out = []
    for _ in range(trees):
        nodes = rng.randint(3, 14)
        tree = DraftTree((-1, *(rng.randint(-1, i - 1) for i in range(1, nodes))))
        cut = rng.randint(8, len(prompt) - nodes - 1)
        head, inputs = torch.tensor(prompt[:cut]), torch.tensor(prompt[cut : cut + nodes + 1])
        cache = model.new_cache(1024)
        model.forward(head, cache, last_only=True)
        alone = model.forward(inputs, cache, tree=tree).logits
        pool = model.new_pool(3, 1024)
        slots = [pool.allocate() for _ in range(3)]
        model.forward_batch([SeqInput(head, slots[0], "none"), SeqInput(head[:-1], slots[1], "none"),
                             SeqInput(head[1:], slots[2], "none")])
        batched = model.forward_batch([SeqInput(inputs, slots[0], "all", tree), SeqInput(head[-1:], slots[1])])[0]
        slots[0].truncate(cut)
        other = DraftTree((-1,) * 2)  # beside a tree of other paths and another context
        among_trees = model.forward_batch([SeqInput(inputs, slots[0], "all", tree),
                                           SeqInput(inputs[:3], slots[2], "all", other)])[0]
        chains = torch.empty_like(alone)
        for path in tree.root_paths():
            cache.truncate(cut)
            chain = model.forward(inputs[list(path.inputs)], cache).logits
            chains[list(path.inputs[path.first :])] = chain[path.first :]
        out.append(TreeRows(tree, alone, batched.logits, among_trees.logits, chains))
    return out


@dataclass
class Decoded:
    plain: list[list[int]]
    drafted: list[GenerationResult]  # prompt lookup, k = 6, one request at a time
    batched: list[list[int]]  # plain, prompt-lookup and lookahead requests in turn in one batch
    lookahead: list[GenerationResult]  # lookahead decoding's draft trees, one request at a time


def decode_three_ways(engine: SpecEngine, prompts: list[list[int]], max_tokens: int = 48,
                      params: SamplingParams | None = None) -> Decoded:
    """Plain, prompt lookup and lookahead alone, and a batch mixing plain, prompt-lookup and
    lookahead requests (draft trees beside chains; more requests than slots, prompts prefilled in
    chunks beside decode rows); greedy unless `params` says otherwise."""
    params = params or SamplingParams(max_tokens=max_tokens)
    plain = [engine.generate(p, params).token_ids for p in prompts]
    drafted = [engine.generate(p, params, drafter="ngram", draft_len=6) for p in prompts]
    lookahead = [engine.generate(p, params, drafter="lookahead", draft_len=2) for p in prompts]
    batch = BatchEngine(engine)
    gens = [batch.add(p, params) for p in prompts]
    kinds = (StepOrder(PLAIN, 0), StepOrder("ngram", 6), StepOrder("lookahead", 2))
    orders = {g: kinds[i % len(kinds)] for i, g in enumerate(gens)}
    while batch.num_unfinished:
        step = batch.step({g: orders[g] for g in batch.schedule()})
        assert not step.failed
    return Decoded(plain, drafted, [gen.output_ids for gen in gens], lookahead)


def chains_where_steps_verify_chains(engine: SpecEngine, drafter: str, k: int, text: str) -> None:
    """A tree drafter's greedy request as a guided request runs it (DraftContext.exact_tree False:
    its step verifies a chain): every step must draft a chain, and the output must still be plain
    decoding's."""
    ids = engine.encode(text)
    params = SamplingParams(max_tokens=24)
    gen = engine.start(ids, params)
    gen.ctx.exact_tree = False
    while not gen.finished:
        gen.step(drafter, k)
    result = gen.result()
    gen.close()
    assert result.token_ids == engine.generate(ids, params).token_ids
    assert result.num_draft_tokens > 0 and all(s.num_tree_nodes == 0 for s in result.steps)


# A chat template in the manner of Qwen 2.5's: tools in the system turn, calls as <tool_call> blocks
# (a target whose tool_call_parser is hermes)
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content or '' }}{% for c in m.tool_calls or [] %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


# Qwen3's way, with DeepSeek-R1's default: the prompt opens the thinking, or with enable_thinking
# false holds an empty one
THINKING_TEMPLATE = """\
{%- if reasoning_effort is defined %}<|im_start|>system
Reasoning: {{ reasoning_effort }}<|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or '' }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""
