"""Ray Serve deployment of the target: one SpecEngine per replica, its requests batched continuously.

The one Ray module in workers/. Concurrent requests on a replica share one background task, the
step loop: it admits new requests (encode, classify, plan; the prompt is prefilled in chunks by
the batch's steps), then runs one batched step of every running request (workers/routing.py
`RoutedBatch`: one target forward, each request with its own drafter and k) and pushes each
request's new tokens and text to its queue. All torch work runs on one engine thread, so the
event loop stays free. A request whose consumer goes away is dropped and its Generation closed,
by the loop, between steps.

The wire types (`GenerateRequest`, `Chunk`, and workers/result.py's `GenerationResult` and
`RequestError`) are plain dataclasses without torch: the ingress imports this module without
loading the engine, which is imported when a replica starts.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

import psutil
from ray import serve
from ray.serve.handle import DeploymentHandle

from policies.records import BatchingStats
from workers.config import EngineConfig, RoutingConfig
from workers.reasoning import ReasoningSplit, prompt_reasoning_start, reasoning_tokens
from workers.result import GenerationResult, RequestError, StepStats, TokenLogprobs
from workers.stats_log import StatsLogger, finished_line, received_line
from workers.structured import OutputFormat
from workers.text_stream import stream_delta

if TYPE_CHECKING:
    from workers.drafters.remote import DraftCall, DraftReply
    from workers.engine import Generation, SpecEngine
    from workers.routing import RoutedBatch, RoutedGeneration, Router

log = logging.getLogger(__name__)
# the replica's lines for operators (workers/stats_log.py): through Serve's handlers (its log file,
# the driver's console, its format) at INFO whatever Serve's own level (quiet by default: Serve logs
# a line per call at INFO)
replica_log = logging.getLogger("ray.serve.specroute")
T = TypeVar("T")


# -- wire types ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerateRequest:
    """One request as the ingress hands it over: prompt, sampling, and the speculation plan."""

    prompt: str | list[dict[str, Any]]  # raw text (no chat template) or chat messages (as templates read them)
    prompt_token_ids: tuple[int, ...] | None = None  # a prompt given as token ids (then `prompt` is unused)
    max_tokens: int | None = None  # None: SamplingParams' default; 0: the prompt scored, no output
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()  # words: tokenized here, banned by their last token (workers/bans.py)
    skip_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None  # keep the prompt's last so many tokens (-1: max_model_len)
    drafter: str = "auto"  # "auto" (the routing policy decides), PLAIN, or a configured drafter name
    draft_len: int | None = None  # None: the policy chooses k
    domain: str | None = None  # None: the policy's classifier decides
    logprobs: int | None = None  # None: none; n: each token's logprob and its n likeliest alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (vLLM's), in the last chunk's stats
    # None: SamplingParams' default (no penalty)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    prediction: str | None = None  # the output the client expects (OpenAI's Predicted Outputs): drafted from
    # the first chunk starts with the prompt (a raw text) and, with logprobs, its tokens' logprobs
    echo: bool = False
    output_format: OutputFormat | None = None  # what the output must match (workers/structured.py)
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool definitions, for a chat template that renders them
    generation_prompt: bool = True  # the chat template opens the assistant's message after the chat
    continue_final_message: bool = False  # the output continues the chat's last message, left open
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the chat template (vLLM's)
    priority: int = 0  # lower first, under the scheduler's priority policy
    cache_salt: str | None = None  # vLLM's: cached state is shared only with requests of the same salt
    return_token_ids: bool = False  # vLLM's: the first chunk carries the prompt's token ids
    arrival_time: float | None = None  # when the ingress received it (time.time(); None: at the worker)

    @property
    def prompt_param(self) -> str:
        """The request field that carried the prompt, for error messages."""
        return "messages" if isinstance(self.prompt, list) else "prompt"

    @property
    def text(self) -> str:
        """What the domain classifier reads: the prompt, or the chat's last user message."""
        if isinstance(self.prompt, str):
            return self.prompt
        users = [m.get("content") or "" for m in self.prompt if m.get("role") == "user"]
        return users[-1] if users else ""


@dataclass(frozen=True)
class Tokens:
    """A prompt's tokens (/tokenize) or the text of tokens (/detokenize); a refused request
    carries its RequestError instead."""

    token_ids: list[int]
    token_strs: list[str] | None = None  # each token as the vocabulary spells it, when asked
    text: str | None = None  # the tokens decoded (/detokenize)
    error: RequestError | None = None


@dataclass(frozen=True)
class Chunk:
    """New output since the previous chunk; the last one carries finish_reason and stats.
    `generate` returns the whole output as one such chunk."""

    token_ids: list[int]
    text: str  # text delta; held back while it may be an incomplete character or stop string
    finish_reason: str | None = None  # "stop" or "length" on the last chunk
    stats: GenerationResult | None = None  # the finished request, without its per-step detail
    # a request refused before its first token comes back as the only chunk, not as a raised
    # exception: a client's mistake is not a replica error for Ray to log with a traceback
    error: RequestError | None = None
    # token_ids' logprobs, when the request asked (an echoed request's first chunk: the prompt's first)
    logprobs: list[TokenLogprobs] | None = None
    # a reasoning model's thinking, apart from `text` (the answer) where the target has a reasoning
    # parser and the prompt is a chat (workers/reasoning.py); None: the output is not split
    reasoning: str | None = None
    num_prompt_tokens: int = 0  # the request's prompt (continuous usage before the last chunk's stats)
    prompt_token_ids: list[int] | None = None  # the prompt as run, on the first chunk where the request asked

    @property
    def result(self) -> GenerationResult:
        """The finished request: the last chunk's `stats`."""
        if self.stats is None:
            raise ValueError("only a request's last chunk carries its result")
        return self.stats


@dataclass(frozen=True)
class PolicyResult:
    """A replica's answer to a policy update: the version in force, and why a policy was refused."""

    version: str  # the policy in force after the call (the old one when refused)
    replica: str  # this replica's Serve id: a broadcast's answers count the replicas reached
    error: str | None = None  # PolicyError's message, naming the field; None: the new policy is in force


# -- the deployment ------------------------------------------------------------------------------
@dataclass(eq=False)
class _Slot:
    request: GenerateRequest
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk | BaseException
    gen: RoutedGeneration | None = None
    num_sent_ids: int = 0
    sent_text: str = ""
    echoed: bool = False  # the prompt went out (GenerateRequest.echo)
    prompt_text: str = ""  # a raw prompt's text (decoded where it came as token ids): what echo repeats
    split: ReasoningSplit | None = None  # a chat's output as reasoning and answer, under a reasoning parser
    abandoned: bool = False  # set by the consumer when it stops reading (finished or cancelled)
    waited_s: float = 0.0  # from the ingress to the batch: Serve's queue for a replica, the pending list


@serve.deployment(max_ongoing_requests=16, ray_actor_options={"num_cpus": 1})
class TargetWorker:
    """Hosts a SpecEngine; `stream` and `generate` serve GenerateRequests concurrently."""

    def __init__(
        self, engine_config: dict[str, Any] | EngineConfig,
        routing_config: dict[str, Any] | RoutingConfig | None = None,
        stats_url: str | None = None,
        stats_prefix: str | None = None,
        allowed_dirs: list[str] | None = None,
        drafter_handles: dict[str, DeploymentHandle] | None = None,
    ) -> None:
        """`stats_url`: redis:// URL of the statistics shared with other replicas; None: this
        replica's own, in memory. `stats_prefix`: the key prefix of that Redis store (None: the
        store's default); replicas share statistics exactly when URL and prefix are the same.
        `allowed_dirs`: besides the shipped ones, where policies may point (policies.paths).
        `drafter_handles`: the DrafterWorker deployments of drafters that run on their own, by name."""
        from policies.paths import allowed_dirs as resolve_allowed_dirs
        from policies.stats import make_stats_store
        from workers import engine, routing, sampling  # torch: only where a replica runs

        replica_log.setLevel(logging.INFO)  # operator lines at INFO, Serve's own at WARNING
        t0 = time.perf_counter()
        self._routing_mod, self._sampling_mod = routing, sampling
        self.config = EngineConfig.model_validate(engine_config)
        services = {name: HandleDraftService(handle, self._remote_timeout(name))
                    for name, handle in (drafter_handles or {}).items()}
        self.engine: SpecEngine = engine.SpecEngine.from_config(self.config, services)
        if defaults := self.engine.target.sampling_defaults:  # the ingress applies them (router/schemas.py)
            replica_log.warning("a request's omitted sampling fields default to %s (the model's generation_config.json "
                                "under target.override_generation_config; target.generation_config: vllm for "
                                "OpenAI's defaults)", defaults)
        routing_config = RoutingConfig.model_validate(routing_config or {})
        store = make_stats_store(stats_url, **({} if stats_prefix is None else {"prefix": stats_prefix}))
        self.allowed_dirs = resolve_allowed_dirs(allowed_dirs or ())
        t1 = time.perf_counter()
        self.router: Router = routing.Router.from_config(self.engine, routing_config, store, self.allowed_dirs)
        replica_log.info("Replica ready in %.1f s: engine %.1f s, routing calibration %s",
                         time.perf_counter() - t0, t1 - t0, self.router.calibration_origin)
        self.batch: RoutedBatch = routing.RoutedBatch(self.router)
        self.batching = BatchingStats()  # this replica's steps, for /metrics and the dashboard
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specroute-engine")
        self._pending: deque[_Slot] = deque()
        self._active: dict[RoutedGeneration, _Slot] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._num_finished = 0
        self._num_cancelled = 0
        interval_s = self.config.log_stats_interval_s
        self._stats_log = StatsLogger(interval_s) if interval_s else None

    def _remote_timeout(self, name: str) -> float:
        (drafter,) = (d for d in self.config.drafters if d.name == name)
        deployment = getattr(drafter, "deployment", None)
        assert deployment is not None, f"drafter {name!r} has no deployment config"
        return deployment.timeout_s

    # -- public methods (called through DeploymentHandles) ------------------------------------
    async def stream(self, request: GenerateRequest) -> AsyncIterator[Chunk]:
        """Chunks of one request as its steps complete. A request that cannot be served gets
        one chunk carrying the RequestError as `error`."""
        slot = _Slot(request)
        logged = self.config.log_requests  # in the request's context: Serve's log lines name it
        if logged:
            replica_log.info(received_line(request.prompt if request.prompt_token_ids is None
                                         else list(request.prompt_token_ids), _set_fields(request),
                                         self.config.max_log_len))
        self._pending.append(slot)
        self._ensure_loop()
        self._wake.set()
        finished = False
        try:
            while True:
                item = await slot.queue.get()
                if isinstance(item, RequestError):
                    if logged:
                        replica_log.info("Refused request: %s", item.message)
                    finished = True
                    yield Chunk([], "", error=item)
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finish_reason is not None:
                    finished = True
                    if logged and item.stats is not None:
                        replica_log.info(finished_line(item.stats))
                yield item
                if finished:
                    return
        finally:
            if logged and not finished:
                replica_log.info("Cancelled request: the client went away")
            slot.abandoned = True  # when still active, the step loop closes it
            self._wake.set()

    async def generate(self, request: GenerateRequest) -> Chunk:
        """The whole output as one chunk."""
        token_ids: list[int] = []
        texts: list[str] = []
        thoughts: list[str] = []
        logprobs: list[TokenLogprobs] | None = None if request.logprobs is None else []
        last: Chunk | None = None
        async for last in self.stream(request):
            if last.error is not None:
                return last
            token_ids += last.token_ids
            texts.append(last.text)
            thoughts.append(last.reasoning or "")
            if logprobs is not None and last.logprobs is not None:
                logprobs += last.logprobs
        assert last is not None and last.finish_reason is not None
        return Chunk(token_ids, "".join(texts), last.finish_reason, last.stats, logprobs=logprobs,
                     reasoning=None if last.reasoning is None else "".join(thoughts))

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def sampling_defaults(self) -> dict[str, float | int]:
        """What a request's omitted sampling fields take (workers/target.py `sampling_defaults`)."""
        return self.engine.target.sampling_defaults

    async def tokenize(self, request: GenerateRequest, add_special_tokens: bool = True,
                       with_strings: bool = False) -> Tokens:
        """The request's prompt as the engine tokenizes it (vLLM's /tokenize). On the engine
        thread, like every other use of the tokenizer here (a fast tokenizer is not safe to share)."""
        return await self._on_engine(self._tokenize, request, add_special_tokens, with_strings)

    async def detokenize(self, token_ids: list[int]) -> Tokens:
        """The text of token ids (vLLM's /detokenize)."""
        return await self._on_engine(self._detokenize, token_ids)

    def status(self) -> dict[str, int]:
        return {
            "num_pending": len(self._pending) + self.batch.num_waiting, "num_active": self.batch.num_running,
            "num_finished": self._num_finished, "num_cancelled": self._num_cancelled,
            "rss_bytes": psutil.Process().memory_info().rss,  # the soak tests watch it
        }

    # -- observability and policy (control plane; never on the engine thread) -----------------
    async def observe(self, include_series: bool = False) -> dict[str, Any]:
        """What /metrics, /v1/stats and the dashboard show, JSON-able (see `_observe`). Off the
        event loop: a Redis snapshot is a network round trip."""
        return await asyncio.to_thread(self._observe, include_series)

    def _observe(self, include_series: bool) -> dict[str, Any]:
        """All-time and windowed (the policy's window) snapshots, the policy's predicted speedup
        per domain and drafter, measured speedup per domain, the store's health, and the
        configured names that bound metric labels. With a shared (Redis) store every replica
        reports the same totals; in memory, its own. `series`: one snapshot per store time
        bucket over the window, without histograms and costs (the dashboard's time axis)."""
        from policies.outlook import measured_speedup, outlook

        policy, store = self.router.policy, self.router.store
        window = store.snapshot(window_s=policy.window.seconds)
        out: dict[str, Any] = {
            "replica": _replica_id(),
            "policy_version": policy.version,
            "domains": list(policy.domains),
            "drafters": list(self.engine.drafters),
            "max_draft_len": self.config.max_draft_len,
            "window_s": policy.window.seconds,
            "all_time": store.snapshot().to_json(),
            "window": window.to_json(),
            "outlook": [asdict(arm) for arm in outlook(window, policy, self.router.costs, self.engine.drafters,
                                                              self.router.own_length)],
            "measured_speedup": {domain: measured_speedup(window, domain) for domain in policy.domains},
            "store": asdict(store.health()),
            "batching": self._batching_now().to_json(),
            "traffic_memory": {d.name: asdict(d.memory()) for d in self.engine.learners},
        }
        if include_series:
            out["series"] = [
                {"start_s": p.start_s, "bucket_s": p.bucket_s,
                 "snapshot": replace(p.snapshot, histograms={}, draft_cost={}, verify_cost={}, shadow={}).to_json()}
                for p in store.series(policy.window.seconds)
            ]
        return out

    def _batching_now(self) -> BatchingStats:
        """The replica's batching stats with its queues, KV cache and prefix cache as they are now."""
        return replace(self.batching, num_running=self.batch.num_running,
                       num_waiting=self.batch.num_waiting + len(self._pending),
                       num_preemptions=self.batch.batch.num_preemptions, **self._prefix_cache(), **self._kv_cache())

    def _prefix_cache(self) -> dict[str, int]:
        """The prefix cache's counters for BatchingStats (zeros without one)."""
        prefix = self.batch.batch.prefix
        if prefix is None:
            return {}
        return {"prefix_queries": prefix.num_queried_tokens, "prefix_hits": prefix.num_hit_tokens,
                "prefix_held_tokens": prefix.num_held_tokens}

    def _kv_cache(self) -> dict[str, int]:
        """The KV positions the running requests reserve and the memory's (vLLM's KV cache usage)."""
        batch = self.batch.batch
        return {"kv_cache_used_tokens": batch.num_reserved_tokens, "kv_cache_tokens": batch.kv_cache_tokens or 0}

    def set_policy(self, policy: dict[str, Any]) -> PolicyResult:
        """Validate and swap in a policy (a parsed YAML/JSON mapping); a bad one is refused with
        the field named and the running policy stays. PUT /v1/policy broadcasts this."""
        from policies.schema import PolicyError, load_policy

        try:
            version = self.router.set_policy(load_policy(policy)).version
        except PolicyError as e:
            return PolicyResult(self.router.policy.version, _replica_id(), str(e))
        return PolicyResult(version, _replica_id())

    def reset_stats(self) -> None:
        """Forget every statistic in this replica's store (shared: every replica's). POST /v1/stats/reset."""
        self.router.store.reset()
        log.warning("statistics reset")

    async def reset_prefix_cache(self) -> int:
        """Drop the prefixes finished requests left in the KV pool, between steps: the positions
        dropped. POST /reset_prefix_cache broadcasts this."""
        prefix = self.batch.batch.prefix
        if prefix is None:
            return 0
        num_tokens = await self._on_engine(prefix.clear)
        log.warning("prefix cache reset: %d positions dropped", num_tokens)
        return num_tokens

    def reconfigure(self, user_config: dict[str, Any] | None) -> None:
        """Serve `user_config: {policy: <mapping, or a path to a policy YAML>}`: applied to every
        replica, present and future, on `serve deploy`. A bad policy is logged and the running
        one stays (raising here would fail the whole deploy)."""
        from policies.paths import PathNotAllowed, confine
        from policies.schema import PolicyError, load_policy

        policy = (user_config or {}).get("policy")
        if policy is None:
            return
        try:
            is_path = isinstance(policy, str) and "\n" not in policy  # else YAML text or a mapping
            source = confine(policy, self.allowed_dirs, "user_config.policy") if is_path else policy
            self.router.set_policy(load_policy(source))
        except (PolicyError, PathNotAllowed) as e:
            log.error("user_config policy refused, policy %r stays in force: %s", self.router.policy.version, e)

    # -- the step loop --------------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            # a context of its own: not the request's that started it (Serve's logs name that request)
            self._loop_task = asyncio.get_running_loop().create_task(self._step_loop(), context=contextvars.Context())

    async def _idle(self) -> None:
        """Wait for a request; the stats lines of the last steps' interval when it is over meanwhile."""
        while self._stats_log is not None and (due := self._stats_log.due_in(time.monotonic())) is not None:
            try:
                await asyncio.wait_for(self._wake.wait(), due)
                return
            except TimeoutError:  # (a timer may fire a little early: then it waits again)
                self._log_stats()
        await self._wake.wait()

    def _log_stats(self) -> None:
        """The stats lines of an interval that is over (workers/stats_log.py)."""
        if self._stats_log is None:
            return
        for line in self._stats_log.lines(self._batching_now, time.monotonic()):
            replica_log.info(line)

    async def _on_engine(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _step_loop(self) -> None:
        while True:
            if not self._pending and not self._active:
                self._wake.clear()
                await self._idle()
            self.router.reload_if_changed()  # a stat() every few seconds at most
            while self._pending:  # admit: encode, classify, plan; the batch's steps prefill
                slot = self._pending.popleft()
                if slot.abandoned:
                    self.batching = self.batching.finish("abort")
                    continue
                try:
                    await self._on_engine(self._admit, slot)
                except Exception as e:  # RequestError, or a bug: the consumer raises it
                    if not isinstance(e, RequestError):  # a refused request never entered the batch
                        self.batching = self.batching.finish("error")
                    slot.queue.put_nowait(e)
                    continue
                assert slot.gen is not None
                self._active[slot.gen] = slot
            for slot in [s for s in self._active.values() if s.abandoned]:
                self._num_cancelled += 1
                self.batching = self.batching.finish("abort")
                await self._on_engine(self._drop, slot)
            if not self._active:
                continue
            try:
                replies = await self._on_engine(self._step)
            except Exception as e:  # a bug outside the per-request guards: the running requests fail
                log.exception("batch step failed")
                replies = [(slot, RuntimeError(f"generation failed: {e!r}")) for slot in list(self._active.values())]
                for slot, _ in replies:
                    self.batching = self.batching.finish("error")
                    await self._on_engine(self._drop, slot)
            for slot, item in replies:
                slot.queue.put_nowait(item)

    # -- on the engine thread -----------------------------------------------------------------
    def _encode(self, r: GenerateRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids: a raw text's (with the tokenizer's special tokens unless told
        otherwise) or the chat's through the chat template."""
        try:
            if isinstance(r.prompt, str) and not add_special_tokens:
                return self.engine.encode_text(r.prompt)
            return self.engine.encode(r.prompt, chat=isinstance(r.prompt, list), tools=r.tools,
                                      generation_prompt=r.generation_prompt,
                                      continue_final_message=r.continue_final_message,
                                      template_kwargs=r.chat_template_kwargs)
        except Exception as e:  # e.g. a chat template that refuses the roles given
            raise RequestError(f"cannot tokenize the prompt: {e}", r.prompt_param) from None

    def _tokenize(self, r: GenerateRequest, add_special_tokens: bool, with_strings: bool) -> Tokens:
        try:
            ids = self._encode(r, add_special_tokens)
        except RequestError as e:
            return Tokens([], error=e)
        strings = self.engine.tokenizer.convert_ids_to_tokens(ids) if with_strings else None
        return Tokens(ids, token_strs=strings)

    def _detokenize(self, token_ids: list[int]) -> Tokens:
        try:
            self.engine.check_token_ids(token_ids, "tokens")
        except RequestError as e:
            return Tokens([], error=e)
        return Tokens(token_ids, text=self.engine.tokenizer.decode(token_ids))

    def _admit(self, slot: _Slot) -> None:
        r, engine = slot.request, self.engine
        if r.arrival_time is not None:
            slot.waited_s = max(0.0, time.time() - r.arrival_time)
        text = r.text
        if r.prompt_token_ids is not None:
            prompt_ids = list(r.prompt_token_ids)
            engine.check_token_ids(prompt_ids, "prompt")
            text = slot.prompt_text = engine.tokenizer.decode(prompt_ids)
        else:
            prompt_ids = self._encode(r)
            slot.prompt_text = r.prompt if isinstance(r.prompt, str) else ""
        if r.truncate_prompt_tokens is not None:
            keep = engine.max_model_len if r.truncate_prompt_tokens == -1 else r.truncate_prompt_tokens
            if len(prompt_ids) > keep:
                prompt_ids = prompt_ids[-keep:]
                slot.prompt_text = engine.tokenizer.decode(prompt_ids)  # what a completion's echo repeats
                if not isinstance(r.prompt, list):  # a chat is still classified by its last user message
                    text = slot.prompt_text
        try:
            prediction = tuple(engine.encode_text(r.prediction)) if r.prediction else ()
        except Exception as e:
            raise RequestError(f"cannot tokenize the prediction: {e}", "prediction") from None
        output_format = r.output_format
        if isinstance(r.prompt, list) and engine.config.target.reasoning_parser is not None:
            start = prompt_reasoning_start(prompt_ids, engine.tokenizer.decode)
            slot.split = ReasoningSplit(start)
            output_format = None if output_format is None else replace(output_format, reasoning=start)
        bad_words = engine.bad_word_ids(r.bad_words)
        try:
            # max_tokens 0 scores the prompt: one token is run for it, and dropped (`_prompt_chunk`)
            defaulted = {"max_tokens": 1 if r.max_tokens == 0 else r.max_tokens, "presence_penalty": r.presence_penalty,
                         "frequency_penalty": r.frequency_penalty, "repetition_penalty": r.repetition_penalty}
            params = self._sampling_mod.SamplingParams(
                temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, min_p=r.min_p, seed=r.seed, stop=r.stop,
                include_stop_str_in_output=r.include_stop_str_in_output,
                extra_stop_token_ids=frozenset(r.stop_token_ids), ignore_eos=r.ignore_eos, min_tokens=r.min_tokens,
                allowed_token_ids=None if r.allowed_token_ids is None else frozenset(r.allowed_token_ids),
                bad_words=bad_words, skip_special_tokens=r.skip_special_tokens,
                logprobs=r.logprobs, logit_bias=r.logit_bias, prediction=prediction,
                prompt_logprobs=_most(r.prompt_logprobs, r.logprobs if r.echo else None), output_format=output_format,
                **{name: value for name, value in defaulted.items() if value is not None},
            )
        except ValueError as e:  # the ingress checks the same ranges; its message starts with the field
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from None
        speculation = self._routing_mod.Speculation(r.drafter, r.draft_len, r.domain)
        try:
            slot.gen = self.batch.add(prompt_ids, params, text, speculation, r.priority, r.cache_salt)
        except RequestError as e:  # the engine names its own arguments; the client sent these fields
            param = {"prompt": r.prompt_param, "drafter": "speculation.drafter"}.get(e.param, e.param)
            raise RequestError(e.message, param, e.code) from None
        self.batching = replace(self.batching, num_prompt_tokens=self.batching.num_prompt_tokens + len(prompt_ids))

    def _step(self) -> list[tuple[_Slot, Chunk | BaseException]]:
        """One batched step; each decoding request's chunk (or its failure)."""
        started_s = time.monotonic()
        step = self.batch.step()
        b = step.batch
        if self._stats_log is not None:
            self._stats_log.step((st for _, st in step.stats), started_s, self._batching_now)
        self.batching = self.batching.step(b.batch_size, b.num_rows, sum(st.num_emitted for _, st in step.stats),
                                           b.forward_s)
        replies: list[tuple[_Slot, Chunk | BaseException]] = []
        for routed, stats in step.stats:
            slot = self._active[routed]
            num_prompt = routed.gen.ctx.num_prompt
            first = slot.num_sent_ids == 0  # every step sends a token: none sent yet, this is the first chunk
            prompt_ids = routed.gen.ctx.token_ids[:num_prompt] if slot.request.return_token_ids and first else None
            chunk = self._chunk(slot, stats)
            replies.append((slot, replace(chunk, num_prompt_tokens=num_prompt, prompt_token_ids=prompt_ids)))
            if routed.finished:
                del self._active[routed]
                self._num_finished += 1
                assert chunk.finish_reason is not None
                num_generated = 0 if slot.request.max_tokens == 0 else len(routed.gen.output_ids)  # 0: scored
                # queued: before the batch (Serve's queue included), then in the batch's waiting queue
                queued = None if routed.gen.queue_s is None else slot.waited_s + routed.gen.queue_s
                self.batching = self.batching.finish(chunk.finish_reason, queued, num_prompt, num_generated)
        for routed, e in step.failed:
            slot = self._active.pop(routed)
            self.batching = self.batching.finish("error")
            self._close(slot)
            replies.append((slot, RuntimeError(f"generation failed: {e!r}")))
        self._log_stats()
        return replies

    def _chunk(self, slot: _Slot, step: StepStats) -> Chunk:
        routed = slot.gen
        assert routed is not None
        if slot.request.max_tokens == 0:
            return self._prompt_chunk(slot)
        gen = routed.gen
        output_ids = gen.output_ids
        new_ids = output_ids[slot.num_sent_ids :]
        logprobs = gen.logprobs[slot.num_sent_ids :] if gen.logprobs is not None else None
        slot.num_sent_ids = len(output_ids)
        head = ""  # the echoed prompt, ahead of the first chunk's text (and its logprobs ahead of the output's)
        if slot.request.echo and not slot.echoed:
            slot.echoed = True
            head = slot.prompt_text
            if logprobs is not None:
                logprobs = [*_echoed_logprobs(gen), *logprobs]
        if not gen.finished:
            text = self.engine.tokenizer.decode(output_ids, skip_special_tokens=gen.params.skip_special_tokens)
            delta = stream_delta(text, slot.sent_text, gen.params.stop)
            slot.sent_text += delta
            if slot.split is None:
                return Chunk(new_ids, head + delta, logprobs=logprobs)
            parts = slot.split.feed(delta)
            return Chunk(new_ids, parts.content, logprobs=logprobs, reasoning=parts.reasoning)
        result = routed.result()
        routed.close()
        if not result.text.startswith(slot.sent_text):  # cannot happen with prefix-stable decoding
            log.warning("streamed text is not a prefix of the final text")
        delta = result.text[len(slot.sent_text) :]
        # the chunks carry the logprobs; the stats need not carry them again, but do carry the
        # prompt's where the request asked for them apart (vLLM's prompt_logprobs)
        stats = replace(result, steps=[], logprobs=None, prompt_logprobs=self._prompt_logprobs(slot, result))
        if slot.split is None:
            return Chunk(new_ids, head + delta, result.finish_reason, stats, logprobs=logprobs)
        fed, held = slot.split.feed(delta), slot.split.finish()
        decode = functools.partial(self.engine.tokenizer.decode, skip_special_tokens=gen.params.skip_special_tokens)
        stats = replace(stats, num_reasoning_tokens=reasoning_tokens(result.token_ids, decode, slot.split.start))
        return Chunk(new_ids, fed.content + held.content, result.finish_reason, stats, logprobs=logprobs,
                     reasoning=fed.reasoning + held.reasoning)

    def _prompt_chunk(self, slot: _Slot) -> Chunk:
        """A request of max_tokens 0 (an echo scoring its prompt, as lm-evaluation-harness asks, or
        vLLM's prompt_logprobs): the prompt (echoed) and its logprobs; the one token run to get
        them (max_tokens 1) is dropped."""
        routed = slot.gen
        assert routed is not None
        gen = routed.gen
        if not gen.finished:
            raise RuntimeError("a request of max_tokens 0 runs one step")
        result = routed.result()
        routed.close()
        stats = replace(result, token_ids=[], text="", finish_reason="length", steps=[], logprobs=None,
                        prompt_logprobs=self._prompt_logprobs(slot, result))
        echo = slot.request.echo
        logprobs = _echoed_logprobs(gen) if echo and gen.logprobs is not None else None
        return Chunk([], slot.prompt_text if echo else "", "length", stats, logprobs=logprobs)

    @staticmethod
    def _prompt_logprobs(slot: _Slot, result: GenerationResult) -> list[TokenLogprobs] | None:
        """The prompt's logprobs a request asked for apart from its echo (`prompt_logprobs`)."""
        asked = slot.request.prompt_logprobs
        return None if asked is None or result.prompt_logprobs is None else _tops(result.prompt_logprobs, asked)

    def _drop(self, slot: _Slot) -> None:
        """Take a request out of the batch (cancelled, or failed) and close it."""
        if slot.gen is not None:
            self.batch.remove(slot.gen)
            self._active.pop(slot.gen, None)
        self._close(slot)

    @staticmethod
    def _close(slot: _Slot) -> None:
        try:
            if slot.gen is not None:
                slot.gen.close()
        except Exception:
            log.exception("closing a generation failed")


# -- drafters on their own deployment --------------------------------------------------------------
class HandleDraftService:
    """A DrafterWorker deployment as the DraftService a RemoteDrafter calls, from the engine
    thread (blocking there is what a colocated drafter does too)."""

    def __init__(self, handle: DeploymentHandle, timeout_s: float) -> None:
        self.handle = handle
        self.timeout_s = timeout_s

    def draft(self, call: DraftCall) -> DraftReply:
        return self.handle.draft.remote(call).result(timeout_s=self.timeout_s)

    def end(self, session: str) -> None:
        self.handle.end.remote(session)  # best effort: a lost end is evicted on the replica


@serve.deployment(max_ongoing_requests=64, ray_actor_options={"num_cpus": 1})
class DrafterWorker:
    """A model drafter served on its own (ModelDrafterConfig.deployment): sessions of a local
    ModelDrafter, one draft call per target step (workers/drafters/remote.py)."""

    def __init__(self, drafter_config: dict[str, Any], target_config: dict[str, Any]) -> None:
        import torch

        from workers.config import ModelDrafterConfig, TargetConfig
        from workers.drafters.registry import build_model_drafter
        from workers.drafters.remote import DraftSessions
        from workers.target import read_embeddings, resolve_source, shares_embeddings

        config = ModelDrafterConfig.model_validate(drafter_config)
        if config.deployment is not None and config.deployment.num_cpus >= 1:
            torch.set_num_threads(int(config.deployment.num_cpus))
        # a drafter that shares its target's embeddings gets them read from the target's files,
        # not the whole target; the vocabulary is checked per call (`draft`)
        embeddings = None
        if shares_embeddings(resolve_source(config.model)):
            embeddings = read_embeddings(TargetConfig.model_validate(target_config))
        self.sessions = DraftSessions(build_model_drafter(config, None, embeddings))
        self.vocab_size = self.sessions.drafter.model.info.vocab_size

    def draft(self, call: DraftCall) -> DraftReply:
        # sync: Serve runs the calls of one replica one at a time, which a single model wants anyway
        if call.vocab_size != self.vocab_size:
            raise ValueError(f"drafter vocabulary size {self.vocab_size} does not match the target's {call.vocab_size}")
        return self.sessions.draft(call)

    def end(self, session: str) -> None:
        self.sessions.end(session)

    def status(self) -> dict[str, int]:
        return {"num_sessions": len(self.sessions.sessions), "num_restarts": self.sessions.num_restarts}


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (tests that build the class directly)
        return ""


def _set_fields(request: GenerateRequest) -> dict[str, Any]:
    """The request's fields that differ from their defaults, the prompt aside (what a log line shows)."""
    out = {}
    for f in fields(request):
        if f.name in ("prompt", "prompt_token_ids", "arrival_time"):
            continue
        value = getattr(request, f.name)
        if value != (f.default if f.default_factory is MISSING else f.default_factory()):
            out[f.name] = value
    return out


def _most(*counts: int | None) -> int | None:
    """The most alternatives any use asks for (None: no use)."""
    asked = [n for n in counts if n is not None]
    return max(asked) if asked else None


def _echoed_logprobs(gen: Generation) -> list[TokenLogprobs]:
    """The prompt's logprobs an echo repeats, with its own `logprobs` count of alternatives."""
    return _tops(gen.prompt_logprobs or [], gen.params.logprobs or 0)


def _tops(entries: list[TokenLogprobs], num_top: int) -> list[TokenLogprobs]:
    """`entries` with each position's `num_top` likeliest: the prompt's logprobs are scored once,
    for the use that asks the most (an echo's `logprobs`, `prompt_logprobs`)."""
    return [e if len(e.top) <= num_top else replace(e, top=e.top[:num_top]) for e in entries]
