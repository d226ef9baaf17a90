"""The Serve application: an OpenAI-compatible FastAPI ingress in front of TargetWorker replicas.

    build_app(args) -> Application     args = a Serve config's applications[0].args (AppArgs)

The ingress validates requests (400 in OpenAI's error shape, naming the field), decides the
speculation plan, and relays the worker's chunks as JSON or as SSE. It never imports torch.
"""

# no `from __future__ import annotations`: Serve's ingress re-declares the endpoints, and FastAPI
# must see their parameter types as classes, not strings
import asyncio
import importlib.metadata
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve import Application
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    ReplicaUnavailableError,
    RequestCancelledError,
    TaskCancelledError,
)
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.exceptions import HTTPException as StarletteHTTPException

from policies.paths import MODEL_DIRS_ENV, allowed_dirs, confine
from router import guard
from router.chat_path import RequestFieldError, answer_of
from router.control import (
    ADMIN_TOKEN_ENV,
    API_KEY_ENV,
    CONTROL_TIMEOUT_S,
    ControlError,
    check_admin_token,
    combine,
    parse_policy_body,
    policy_outcome,
)
from router.messages import (
    CountTokensRequest,
    CountTokensResponse,
    MessageEvents,
    MessageObject,
    MessagesRequest,
    content_blocks,
    messages_param,
)
from router.messages import error_type as messages_error_type
from router.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from router.metrics import render as render_metrics
from router.observation import BackgroundResponses, Observation
from router.replica_affinity import DEFAULT_MAX_IMBALANCE, PrefixAffinityRouter
from router.response_store import ResponseStoreUnavailable, StoredResponse, make_response_store
from router.responses import (
    RUNNING_STATUSES,
    InputItemList,
    ResponseError,
    ResponseEvents,
    ResponseObject,
    ResponsesRequest,
    input_item_list,
    output_items,
    responses_param,
    with_item_ids,
)
from router.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionTokensDetails,
    ContextSpanInfo,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    FunctionCall,
    GenerationRequestBase,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    RequestT,
    SpeculationInfo,
    TokenizeRequest,
    TokenizeResponse,
    ToolCall,
    ToolCallDelta,
    Usage,
    prompt_logprobs_of,
    with_sampling_defaults,
)
from router.stats_view import stats_json
from router.tools import Call
from workers.config import PLAIN, EngineConfig, ModelDrafterConfig, RoutingConfig
from workers.deployment import Chunk, DrafterWorker, GenerateRequest, TargetWorker, Tokens
from workers.result import GenerationResult, RequestError, TokenLogprobs

log = logging.getLogger(__name__)
MESSAGES_PATH = "/v1/messages"  # Anthropic's Messages API (router/messages.py): errors in its shape

DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
INGRESS_MAX_ONGOING_REQUESTS = 1024  # the ingress only relays: its limit is the workers' sum and more
STATS_URL_ENV = "SPECROUTE_REDIS_URL"  # the shared statistics store, when the Serve config names none
STATIC_DIR = Path(__file__).resolve().parent / "static"
STATIC_FILES = {"chart.umd.min.js": "text/javascript; charset=utf-8"}  # served at /static/<name>; nothing else
STORED_RESPONSES_TTL_S = 30 * 24 * 3600.0  # OpenAI keeps a stored response 30 days
BACKGROUND_UNAVAILABLE_RETRIES = 3  # a background response's tries on a replica that went away, after the first
BACKGROUND_LEASE_S = 30.0  # a background response's ingress renews its claim every third of this
_UNAVAILABLE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)  # a replica died or is starting
_CANCELLED = (TaskCancelledError, RequestCancelledError, asyncio.CancelledError)  # Serve cancels a gone client's call


# -- application arguments ---------------------------------------------------------------------
class AutoscalingArgs(BaseModel):
    """The subset of Ray Serve's autoscaling_config that SpecRoute passes through."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    initial_replicas: int | None = Field(None, ge=0)
    target_ongoing_requests: float | None = Field(None, gt=0, description="per replica")
    upscale_delay_s: float | None = Field(None, ge=0)
    downscale_delay_s: float | None = Field(None, ge=0)


class AppArgs(BaseModel):
    """`args:` of the Serve application (deploy/serve.*.yaml)."""

    model_config = ConfigDict(extra="forbid")

    served_model_name: str | list[str] = Field(
        DEFAULT_SERVED_MODEL_NAME, description="the `model` clients send; a list: each of these names (vLLM's), "
                                               "the first the one responses carry")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="target, drafters, engine")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="routing policy and its start")
    stats_url: str | None = Field(
        None, description=f"redis:// URL of statistics shared by every replica (default: ${STATS_URL_ENV}, "
                          "else each replica's own, in memory)",
    )
    stats_prefix: str | None = Field(
        None, description="key prefix in that Redis (default: the store's); replicas with the same URL and prefix "
                          "share statistics",
    )
    admin_token: str | None = Field(
        None, description=f"PUT /v1/policy, POST /v1/stats/reset and POST /reset_prefix_cache require "
                          f"`Authorization: Bearer <admin_token>` (default: ${ADMIN_TOKEN_ENV}; none: open)",
    )
    api_key: str | None = Field(
        None, description=f"the inference endpoints and /v1/models require `Authorization: Bearer <api_key>` "
                          f"(or `x-api-key: <api_key>`) (default: ${API_KEY_ENV}; none: open)",
    )
    allowed_origins: list[str] = Field(
        default_factory=lambda: list(guard.CorsSettings.allow_origins),
        description="origins whose web pages may call the API (CORS, vLLM's --allowed-origins; [] sends no "
                    "cross-origin headers: browsers then allow only the service's own origin)")
    allowed_methods: list[str] = Field(default_factory=lambda: list(guard.CorsSettings.allow_methods),
                                       description="CORS: the methods other origins may use")
    allowed_headers: list[str] = Field(default_factory=lambda: list(guard.CorsSettings.allow_headers),
                                       description="CORS: the request headers other origins may send")
    allow_credentials: bool = Field(guard.CorsSettings.allow_credentials,
                                    description="CORS: whether other origins' requests may carry cookies")
    allowed_dirs: list[str] = Field(
        default_factory=list, description=f"directories, besides the repository's models/ and policies/ and "
                                          f"${MODEL_DIRS_ENV}, that models, checkpoints and policies may be read from",
    )
    max_request_bytes: int = Field(guard.DEFAULT_MAX_REQUEST_BYTES, ge=1024,
                                   description="a larger request body is refused with 413")
    max_ongoing_requests: int = Field(16, ge=1, description="concurrent requests per target replica")
    max_queued_requests: int = Field(
        64, ge=-1, description="requests the ingress queues for the target replicas beyond their max_ongoing_requests; "
                               "more are refused with 429 and Retry-After (-1: unbounded)",
    )
    retry_after_s: int = Field(guard.DEFAULT_RETRY_AFTER_S, ge=1, description="the Retry-After of a 429")
    num_replicas: int | None = Field(None, ge=1, description="fixed target replicas (default 1)")
    autoscaling_config: AutoscalingArgs | None = Field(None, description="instead of num_replicas")
    num_cpus: float = Field(1, ge=0, description="CPUs per target replica (also torch's threads)")
    num_gpus: float = Field(0, ge=0, description="GPUs per target replica")
    replica_routing: Literal["prefix_affinity", "power_of_two"] = Field(
        "prefix_affinity", description="how a request picks its target replica: the one likely to hold its prompt's "
                                       "prefix unless it is busier (router/replica_affinity.py), or Serve's "
                                       "less loaded of two random ones")
    affinity_max_imbalance: int = Field(
        DEFAULT_MAX_IMBALANCE, ge=0, description="prefix_affinity: requests a replica may have queued beyond the "
                                                 "least loaded one and still be preferred")
    max_stored_responses: int = Field(
        1000, ge=0, description="Responses API responses kept for previous_response_id and GET "
                                "/v1/responses/{id}, the least recently used dropped first (0: none)")
    responses_url: str | None = Field(
        None, description="redis:// URL where stored responses live, shared by the ingress replicas and kept across "
                          "restarts, under the stats_prefix (default: the ingress's memory)")
    stored_responses_ttl_s: float | None = Field(
        STORED_RESPONSES_TTL_S, gt=0, description="a stored response neither stored nor read for this long is "
                                                   "dropped (default 30 days, as long as OpenAI keeps them; null: "
                                                   "kept until max_stored_responses drops it)")
    max_background_responses: int = Field(
        64, ge=0, description="background responses (`background: true`) an ingress replica holds, queued or "
                              "generated; more are refused with 429 and Retry-After (0: background refused)")
    background_lease_s: float = Field(
        BACKGROUND_LEASE_S, gt=0, description="an ingress replica generating a background response renews its claim "
                                              "on it every third of this; one left unrenewed this long (its replica "
                                              "gone) is marked failed by the next replica that reads it")

    @property
    def model_names(self) -> list[str]:
        names = self.served_model_name
        return [names] if isinstance(names, str) else list(names)

    @field_validator("served_model_name")
    @classmethod
    def _names(cls, value: str | list[str]) -> str | list[str]:
        names = [value] if isinstance(value, str) else value
        if not names or not all(name.strip() for name in names) or len(set(names)) != len(names):
            raise ValueError("give a name, or a list of distinct non-empty names")
        return value

    @model_validator(mode="after")
    def _replicas(self) -> "AppArgs":
        if self.num_replicas is not None and self.autoscaling_config is not None:
            raise ValueError("give num_replicas or autoscaling_config, not both")
        return self

    @model_validator(mode="after")
    def _confined(self) -> "AppArgs":
        """Every file the service reads lies under the allowed directories (policies/paths.py)."""
        allowed = allowed_dirs(self.allowed_dirs)
        files = self.engine.local_paths()
        if self.routing.policy is not None:
            files.append(("routing.policy", self.routing.policy))
        for name, path in files:
            confine(path, allowed, name)  # PathNotAllowed is a ValueError: pydantic reports it
        return self

    def worker_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "max_constructor_retry_count": 1,  # a model that fails to load fails the deploy now
        }
        if self.replica_routing == "prefix_affinity":
            options["request_router_config"] = RequestRouterConfig(
                request_router_class=PrefixAffinityRouter,
                request_router_kwargs={"max_imbalance": self.affinity_max_imbalance})
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = self.autoscaling_config.model_dump(exclude_none=True)
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


def build_app(args: dict[str, Any]) -> Application:
    """The Serve application from a Serve config's application args."""
    app_args = AppArgs.model_validate(args or {})
    stats_url = app_args.stats_url or os.environ.get(STATS_URL_ENV) or None
    drafters = {  # drafters with their own deployment: one DrafterWorker each
        d.name: DrafterWorker.options(
            name=f"DrafterWorker-{d.name}", num_replicas=d.deployment.num_replicas,
            max_ongoing_requests=d.deployment.max_ongoing_requests,
            ray_actor_options={"num_cpus": d.deployment.num_cpus, "num_gpus": d.deployment.num_gpus},
        ).bind(d.model_dump(mode="json"), app_args.engine.target.model_dump(mode="json"))
        for d in app_args.engine.drafters if isinstance(d, ModelDrafterConfig) and d.deployment is not None
    }
    worker = TargetWorker.options(**app_args.worker_options()).bind(
        app_args.engine.model_dump(mode="json"), app_args.routing.model_dump(mode="json"), stats_url,
        app_args.stats_prefix, app_args.allowed_dirs, drafters,
    )
    return OpenAIIngress.bind(worker, app_args.model_dump(mode="json"))


# -- errors --------------------------------------------------------------------------------------
class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.body = ErrorResponse(error=ErrorBody(message=message, type=type, param=param, code=code))

    def for_param(self, rename: Callable[[str], str]) -> "APIError":
        """This error naming its field as `rename` calls it."""
        error = self.body.error
        if error.param is None:
            return self
        param = rename(error.param)
        message = error.message.replace(f"{error.param}:", f"{param}:", 1)
        return APIError(self.status, message, param, error.code, error.type, self.headers)


def _error_response(e: APIError, path: str = "") -> JSONResponse:
    """OpenAI's error shape; Anthropic's on its Messages API, whose clients read that."""
    if path.startswith(MESSAGES_PATH):
        body = {"type": "error", "error": {"type": messages_error_type(e.status), "message": e.body.error.message}}
        return JSONResponse(body, status_code=e.status, headers=e.headers)
    return JSONResponse(e.body.model_dump(), status_code=e.status, headers=e.headers)


def _param(loc: tuple[Any, ...]) -> str | None:
    """A validation error's location as a request field path, e.g. messages[0].content."""
    parts = [p for p in loc[1:] if isinstance(p, int) or not any(c in p for c in "[-(") and
             p not in ("str", "int", "float", "bool", "list", "dict", "none")]
    text = ""
    for p in parts:
        text += f"[{p}]" if isinstance(p, int) else (f".{p}" if text else p)
    return text or None


_MAX_INTERNAL_MESSAGE = 500  # characters of an internal error's message a 500 carries


def _as_api_error(e: BaseException) -> APIError:
    """An error from a worker call, unwrapped from Ray's wrappers."""
    while isinstance(e, RayTaskError) and e.cause is not None:
        e = e.cause
    if isinstance(e, RequestError):
        return APIError(400, e.message, e.param, e.code)
    if isinstance(e, APIError):
        return e
    if isinstance(e, _CANCELLED):  # Serve cancelled the call of a client that went away: no one to answer
        return APIError(499, "client closed the request", code="client_closed_request")
    if isinstance(e, BackPressureError):  # the queue in front of the workers is full
        return _at_capacity("the service is at capacity")
    if isinstance(e, _UNAVAILABLE):  # Serve restarts the replica; the request may be retried
        log.warning("a worker replica is unavailable: %s", type(e).__name__)
        return APIError(503, f"the worker replica serving this request is unavailable ({type(e).__name__}); "
                             "retry", code="service_unavailable", type="internal_error",
                        headers={"retry-after": str(guard.SETTINGS.retry_after_s)})
    log.error("request failed: %r", e, exc_info=e)
    # the exception's own words, as vLLM's 500s carry them: what a client can report
    return APIError(500, f"internal error: {type(e).__name__}: {e}"[:_MAX_INTERNAL_MESSAGE], type="internal_error")


def _at_capacity(message: str, param: str | None = None) -> APIError:
    """A 429 whose `message` asks the client to retry after Retry-After."""
    return APIError(429, f"{message}; retry after {guard.SETTINGS.retry_after_s} s", param,
                    code="rate_limit_exceeded", type="rate_limit_error",
                    headers={"retry-after": str(guard.SETTINGS.retry_after_s)})


def _background_retry_s(e: APIError, num_unavailable: int) -> float | None:
    """How long a background response waits before trying again after `e`: the Retry-After a
    client would be told (a full queue; a restarting replica, BACKGROUND_UNAVAILABLE_RETRIES
    times), None where it fails."""
    if e.headers is None or "retry-after" not in e.headers:
        return None
    if e.status == 503 and num_unavailable > BACKGROUND_UNAVAILABLE_RETRIES:
        return None
    return float(e.headers["retry-after"])


def _lapsed(stored: StoredResponse, now: float) -> bool:
    """Whether `stored` is a background response whose generator stopped renewing its lease."""
    return stored.status in RUNNING_STATUSES and stored.lease_until is not None and stored.lease_until < now


def _finished_response(response: ResponseObject, out: Chunk, chat: ChatCompletionRequest) -> ResponseObject:
    """`response` with the output of its generation, `out`."""
    finish = out.finish_reason or "length"
    items = output_items(answer_of(out.text, finish, chat.tool_calls), f"msg_{uuid.uuid4().hex}", out.reasoning,
                         logprobs=out.logprobs)
    return response.finished(items, out.result, finish, _speculation_info(out.result))


def _store_unavailable(e: ResponseStoreUnavailable, param: str | None = None) -> APIError:
    """The shared response store did not answer: the response may be there, so retry (not a 404)."""
    return APIError(503, f"stored responses cannot be read now ({e}); retry", param, "service_unavailable",
                    "internal_error", headers={"retry-after": str(guard.SETTINGS.retry_after_s)})


def _refusal(status: int, message: str, code: str, path: str) -> JSONResponse:
    return _error_response(APIError(status, message, code=code), path)


app = FastAPI(title="SpecRoute", description="OpenAI-compatible speculative decoding with drafter routing")
app.add_middleware(guard.RequestGuard, refuse=_refusal)
app.add_middleware(guard.CrossOrigin)  # outermost: a preflight never meets the API key check


@app.exception_handler(RequestValidationError)
async def _on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    err = errors[0] if errors else {"loc": ("body",), "msg": "invalid request"}
    param = _param(tuple(err.get("loc", ())))
    if err.get("type") == "json_invalid":
        reason = err.get("ctx", {}).get("error", err["msg"])
        param, message = None, f"request body is not valid JSON: {reason}"
    elif err.get("type") == "extra_forbidden":
        message = f"{param}: unknown field"
    else:
        message = f"{param or 'body'}: {err['msg']}"
    return _error_response(APIError(400, message, param), request.url.path)


@app.exception_handler(APIError)
async def _on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return _error_response(exc, request.url.path)


@app.exception_handler(Exception)
async def _on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    return _error_response(_as_api_error(exc), request.url.path)


@app.exception_handler(ControlError)
async def _on_control_error(request: Request, exc: ControlError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status < 500 else "internal_error"
    return _error_response(APIError(exc.status, exc.message, exc.param, exc.code, type=kind), request.url.path)


@app.exception_handler(StarletteHTTPException)
async def _on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
    return _error_response(APIError(exc.status_code, str(exc.detail), type=kind), request.url.path)


# -- the ingress ---------------------------------------------------------------------------------
def _speculation_info(result: GenerationResult) -> SpeculationInfo:
    r = result.routing
    routed = {} if r is None else {
        "domain": r.domain, "policy_version": r.policy_version, "reason": r.reason,
        "drafter": r.drafter, "draft_len": r.draft_len, "fallback_reason": r.fallback_reason,
        "schedule": [[s.drafter, s.draft_len, s.num_steps] for s in r.schedule], "fallbacks": list(r.fallbacks),
        "context": [ContextSpanInfo(**asdict(span)) for span in r.context],
    }
    return SpeculationInfo(
        **({"drafter": PLAIN, "draft_len": 0} | routed), drafters=result.drafters,
        num_steps=result.num_steps, num_draft_tokens=result.num_draft_tokens,
        num_accepted_tokens=result.num_accepted_tokens,
        mean_acceptance_length=round(result.mean_acceptance_length, 4),
        acceptance_histogram=result.accepted_per_position,
    )


# one prompt of a request: a completion's text or token ids, or a chat's messages
Prompt = str | list[int] | list[dict[str, str]]


def _prompt_fields(prompt: Prompt) -> dict[str, Any]:
    """The GenerateRequest fields that carry `prompt`."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        return {"prompt_token_ids": tuple(prompt)}
    return {"prompt": prompt}


def _token_ids(body: GenerationRequestBase, out: Chunk, prompt: bool = False) -> dict[str, list[int] | None]:
    """A choice's token ids where the request asked (vLLM's return_token_ids): the output's and,
    with `prompt`, the prompt's."""
    if not body.return_token_ids:
        return {}
    return {"token_ids": out.token_ids, **({"prompt_token_ids": out.result.prompt_token_ids} if prompt else {})}


def _usage(results: list[GenerationResult], n: int) -> Usage:
    """A request's usage from its choices' results in index order (`n` per prompt): each prompt once,
    every choice's completion."""
    prompt = sum(r.num_prompt_tokens for r in results[::n])
    completion = sum(r.num_completion_tokens for r in results)
    predicted = [r.prediction for r in results if r.prediction is not None]
    reasoning = sum(r.num_reasoning_tokens for r in results)
    details = CompletionTokensDetails(
        accepted_prediction_tokens=sum(p.accepted for p in predicted),
        rejected_prediction_tokens=sum(p.rejected for p in predicted), reasoning_tokens=reasoning,
    ) if predicted or reasoning else None
    cached = PromptTokensDetails(cached_tokens=sum(r.num_cached_tokens for r in results[::n]))
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=cached, completion_tokens_details=details)


def _tool_call(call: Call) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=call.name, arguments=call.arguments))


def _cancel(gens: Sequence[DeploymentResponseGenerator]) -> None:
    """Cancel every choice's stream; one the worker refused (back pressure) raises its error again
    when cancelled, which must not replace the error being answered."""
    for gen in gens:
        try:
            gen.cancel()
        except Exception:
            pass


async def _interleaved(
    gens: list[DeploymentResponseGenerator], heads: list[Chunk],
) -> AsyncIterator[tuple[int, Chunk]]:
    """Each choice's chunks with its index, in the order they arrive, until every choice has finished."""
    queue: asyncio.Queue[tuple[int, Chunk | Exception]] = asyncio.Queue()

    async def pump(index: int, gen: DeploymentResponseGenerator, chunk: Chunk) -> None:
        try:
            while True:
                queue.put_nowait((index, chunk))
                if chunk.finish_reason is not None:
                    return
                chunk = await gen.__anext__()
        except Exception as e:  # StopAsyncIteration too: a stream that ended without finishing
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, gen, head)) for i, (gen, head) in enumerate(zip(gens, heads))]
    try:
        unfinished = len(tasks)
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            yield index, item
            unfinished -= item.finish_reason is not None
    finally:
        for task in tasks:
            task.cancel()


def _sse(data: BaseModel | dict[str, Any], drop: tuple[str, ...] = ()) -> str:
    """One SSE event; the keys `drop` leaves out where null, as are a choice's token ids (vLLM's
    return_token_ids) where not asked for."""
    payload = data.model_dump(mode="json") if isinstance(data, BaseModel) else data
    for key in drop:
        if payload.get(key) is None:
            payload.pop(key, None)
    for choice in payload.get("choices") or ():
        for key in ("token_ids", "prompt_token_ids"):
            if key in choice and choice[key] is None:
                del choice[key]
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


@serve.deployment(max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, worker: DeploymentHandle, args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        self.worker = worker
        self.model_names = self.args.model_names
        self.model_name = self.model_names[0]  # what responses carry, whichever name was asked for
        self.created = int(time.time())
        self._context_limit: int | None = None
        self._sampling_defaults: dict[str, float | int] | None = None
        self.stored_responses = make_response_store(self.args.responses_url, self.args.max_stored_responses,
                                                    self.args.stored_responses_ttl_s, prefix=self.args.stats_prefix)
        self._background: dict[str, asyncio.Task[None]] = {}  # background responses this ingress generates
        self.admin_token = self.args.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None
        guard.configure(self.args.max_request_bytes, self.args.retry_after_s,
                        self.args.api_key or os.environ.get(API_KEY_ENV),
                        guard.CorsSettings(tuple(self.args.allowed_origins), tuple(self.args.allowed_methods),
                                           tuple(self.args.allowed_headers), self.args.allow_credentials))
        self.dashboard_html = (STATIC_DIR / "dashboard.html").read_text()
        self.static = {name: (STATIC_DIR / name).read_bytes() for name in STATIC_FILES}

    @app.get("/healthz")
    @app.get("/health")  # vLLM's name, which its users' probes ask
    async def healthz(self) -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/version")
    async def version(self) -> dict[str, str]:
        """The server's version (vLLM's /version)."""
        return {"version": importlib.metadata.version("specroute")}

    @app.get("/v1/models")
    async def models(self) -> ModelList:
        return ModelList(data=[await self._card(name) for name in self.model_names])

    @app.get("/v1/models/{model}")
    async def model(self, model: str) -> ModelCard:
        self._check_model(model)
        return await self._card(model)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        """A prompt's tokens as /v1/completions or /v1/chat/completions would feed them (vLLM's)."""
        self._check_model(body.model)
        prompt = body.prompt if body.messages is None else [m.as_template_message() for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        request = GenerateRequest(prompt=prompt, tools=tools, generation_prompt=body.add_generation_prompt,
                                  continue_final_message=body.continue_final_message,
                                  chat_template_kwargs=body.chat_template_kwargs)
        tokens = await self._on_worker(self.worker.tokenize.remote(request, body.add_special_tokens is not False,
                                                                   body.return_token_strs))
        return TokenizeResponse(count=len(tokens.token_ids), max_model_len=await self._max_model_len(),
                                tokens=tokens.token_ids, token_strs=tokens.token_strs)

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self._check_model(body.model)
        tokens = await self._on_worker(self.worker.detokenize.remote(body.tokens))
        return DetokenizeResponse(prompt=tokens.text or "")

    @app.post("/v1/completions", response_model=None)
    async def completions(self, body: CompletionRequest) -> CompletionResponse | StreamingResponse:
        body = await self._with_defaults(body)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompts = body.prompts
        offsets = [0] * (len(prompts) * body.n)  # where each choice's next token text starts (a stream's chunks go on)

        def logprobs_of(index: int, entries: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
            if entries is None:
                return None
            shaped = CompletionLogprobs.of(entries, offsets[index], body.return_tokens_as_token_ids)
            offsets[index] += sum(len(e.chosen.token) for e in entries)
            return shaped

        def chunk(index: int, text: str, finish: str | None = None, spec: SpeculationInfo | None = None,
                  logprobs: list[TokenLogprobs] | None = None, reasoning: str | None = None,
                  token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> CompletionChunk:
            choice = CompletionChoice(index=index, text=text, finish_reason=finish,
                                      logprobs=logprobs_of(index, logprobs), token_ids=token_ids,
                                      prompt_token_ids=prompt_token_ids)
            return CompletionChunk(id=request_id, created=created, model=self.model_name,
                                   choices=[choice], speculation=spec)

        if body.stream:
            return await self._stream(body, prompts, chunk, None)
        outs = await self._generate(body, prompts)
        return CompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[CompletionChoice(index=i, text=out.text, finish_reason=out.finish_reason,
                                      stop_reason=out.result.stop_reason, logprobs=logprobs_of(i, out.logprobs),
                                      prompt_logprobs=prompt_logprobs_of(out.result.prompt_logprobs,
                                                                         body.return_tokens_as_token_ids),
                                      **_token_ids(body, out, prompt=True))
                     for i, out in enumerate(outs)],
            usage=_usage([out.result for out in outs], body.n), speculation=_speculation_info(outs[0].result),
        )

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        self, body: ChatCompletionRequest,
    ) -> ChatCompletionResponse | StreamingResponse:
        body = await self._with_defaults(body)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        messages = [m.as_template_message() for m in body.messages]
        tool_calls = body.use_tool_call_parser(self.args.engine.target.tool_call_parser).tool_calls
        held = [""] * body.n  # a choice's output: its calls go out whole, in its last chunk
        sent = [""] * body.n  # of an answer to tools ("auto"), the content streamed

        def chunk(index: int, text: str, finish: str | None = None, spec: SpeculationInfo | None = None,
                  role: str | None = None, logprobs: list[TokenLogprobs] | None = None,
                  reasoning: str | None = None, token_ids: list[int] | None = None,
                  prompt_token_ids: list[int] | None = None) -> ChatCompletionChunk | None:
            if reasoning and not body.include_reasoning:
                if not (text or finish or role or logprobs):
                    return None
                reasoning = None
            reasoning = reasoning or None
            delta = ChatDelta(role=role, content=text if text or reasoning is None else None, reasoning=reasoning)
            if tool_calls is not None and role is None:
                held[index] += text
                if finish is None and text:
                    content = tool_calls.streamed_content(held[index])
                    if not (new := (content or "")[len(sent[index]):]) and reasoning is None:
                        return None
                    sent[index] += new
                    delta = ChatDelta(content=new or None, reasoning=reasoning)
                if finish is not None:
                    answer = tool_calls.answer(held[index], finish)
                    finish = answer.finish_reason
                    rest = None if answer.content is None else answer.content[len(sent[index]):]
                    delta = ChatDelta(content=rest, reasoning=reasoning, tool_calls=None if answer.calls is None else [
                        ToolCallDelta(index=i, **_tool_call(c).model_dump()) for i, c in enumerate(answer.calls)])
            choice = ChatChunkChoice(index=index, delta=delta, finish_reason=finish, token_ids=token_ids,
                                     logprobs=None if logprobs is None
                                     else ChatLogprobs.of(logprobs, body.return_tokens_as_token_ids))
            return ChatCompletionChunk(id=request_id, created=created, model=self.model_name,
                                       choices=[choice], speculation=spec, prompt_token_ids=prompt_token_ids)

        def message(out: Chunk) -> tuple[AssistantMessage, str]:
            finish = out.finish_reason or "length"
            # under a reasoning parser: the thinking apart, and no content where there was only thinking
            reasoning = (out.reasoning or None) if body.include_reasoning else None
            if tool_calls is None:
                content = body.echoed + out.text
                return AssistantMessage(content=(content or None) if out.reasoning is not None else content,
                                        reasoning=reasoning), finish
            answer = tool_calls.answer(out.text, finish)
            calls = None if answer.calls is None else [_tool_call(c) for c in answer.calls]
            return AssistantMessage(content=answer.content, reasoning=reasoning, tool_calls=calls), answer.finish_reason

        if body.stream:
            return await self._stream(body, [messages], chunk,
                                      lambda index, **ids: chunk(index, body.echoed, role="assistant", **ids))
        outs = await self._generate(body, [messages])
        answers = [message(out) for out in outs]
        return ChatCompletionResponse(
            id=request_id, created=created, model=self.model_name,
            choices=[ChatChoice(index=i, message=msg, finish_reason=finish, stop_reason=out.result.stop_reason,
                                logprobs=None if out.logprobs is None
                                else ChatLogprobs.of(out.logprobs, body.return_tokens_as_token_ids),
                                **_token_ids(body, out))
                     for i, (out, (msg, finish)) in enumerate(zip(outs, answers))],
            usage=_usage([out.result for out in outs], body.n), speculation=_speculation_info(outs[0].result),
            prompt_logprobs=prompt_logprobs_of(outs[0].result.prompt_logprobs, body.return_tokens_as_token_ids),
            prompt_token_ids=outs[0].result.prompt_token_ids if body.return_token_ids else None,
        )

    @app.post("/v1/responses", response_model=None)
    async def responses(self, body: ResponsesRequest) -> ResponseObject | StreamingResponse:
        """OpenAI's Responses API on the chat path (router/responses.py); a response is stored
        unless asked not to, and `previous_response_id` continues a stored one's conversation."""
        body = await self._with_defaults(body)
        stores = body.stores and self.stored_responses.max_responses > 0
        if body.background and not stores:
            raise APIError(400, "background: a background response is read with GET /v1/responses/{id}, so it "
                                "must be stored (store: true, and a server that keeps responses)", "background")
        if body.background and body.stream:
            raise APIError(400, "stream: a background response is not streamed; read it with GET "
                                "/v1/responses/{id}", "stream")
        if body.background and len(self._background) >= self.args.max_background_responses:
            raise self._no_background_room()
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = await self._stored(body.previous_response_id, "previous_response_id")
            if (status := previous.status) in RUNNING_STATUSES:
                raise APIError(400, f"previous_response_id: response {body.previous_response_id!r} is still "
                                    f"{status}", "previous_response_id")
            history = previous.conversation
        try:
            chat = body.after(history).as_chat().use_tool_call_parser(self.args.engine.target.tool_call_parser)
            chat = await self._with_defaults(chat)  # the fields this API lacks (min_p, repetition_penalty)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from None
        response = ResponseObject.started(body, f"resp_{uuid.uuid4().hex}", self.model_name, stores)
        conversation = [*history, *with_item_ids(body.input_items())]

        def stored_of(done: ResponseObject, lease_until: float | None = None) -> StoredResponse:
            return StoredResponse(done.model_dump(mode="json", by_alias=True), [
                *conversation, *(item.model_dump(mode="json") for item in done.output)], lease_until)

        async def store(done: ResponseObject) -> None:
            if stores:
                await self.stored_responses.put(done.id, stored_of(done))

        messages = [m.as_template_message() for m in chat.messages]
        if body.background:
            queued = response.model_copy(update={"status": "queued"})
            await self.stored_responses.put(queued.id, stored_of(queued, time.time() + self.args.background_lease_s))
            task = asyncio.create_task(self._respond_in_background(queued, chat, messages, stored_of))
            self._background[response.id] = task
            task.add_done_callback(lambda _: self._background.pop(response.id, None))
            return queued
        try:
            if body.stream:
                gens, heads = await self._open_streams(chat, [messages])
                events = ResponseEvents(response, chat.tool_calls)

                async def store_streamed() -> None:
                    assert events.done is not None
                    await store(events.done)

                return StreamingResponse(self._typed_events(gens, heads, events, store_streamed),
                                         media_type="text/event-stream")
            out = (await self._generate(chat, [messages]))[0]
        except APIError as e:  # the worker names the chat request's fields
            raise e.for_param(responses_param) from None
        done = _finished_response(response, out, chat)
        await store(done)
        return done

    async def _respond_in_background(
        self, queued: ResponseObject, chat: ChatCompletionRequest, messages: list[dict[str, Any]],
        stored_of: Callable[[ResponseObject, float | None], StoredResponse],
    ) -> None:
        """Generate a background response (stored `queued`) and store what became of it: its
        output, `cancelled` (by POST /v1/responses/{id}/cancel) or `failed` with the error. What
        the API would tell a client to retry (429: the workers' queue is full; 503: a replica
        restarts, up to BACKGROUND_UNAVAILABLE_RETRIES times) the ingress retries after
        Retry-After, the response `queued` meanwhile: a background response waits for room, as
        OpenAI's do.

        While it runs, its stored copy carries a lease this ingress renews every third of
        `background_lease_s`, so another replica can tell it from one whose ingress is gone. Every
        write is conditional on the stored response still running: one that another replica
        cancelled (or marked failed) stays so, and this one stops generating at its next renewal."""
        latest = queued  # what the lease renewals store again
        lease_s = self.args.background_lease_s

        async def write(update: ResponseObject) -> bool:
            nonlocal latest
            lease_until = None
            if update.status in RUNNING_STATUSES:
                latest, lease_until = update, time.time() + lease_s
            return await self.stored_responses.put(update.id, stored_of(update, lease_until),
                                                   if_status=RUNNING_STATUSES)

        generating = asyncio.current_task()
        assert generating is not None

        async def keep_lease() -> None:
            while True:
                await asyncio.sleep(lease_s / 3)
                if not await write(latest):  # ended elsewhere
                    generating.cancel()
                    return

        keeper = asyncio.create_task(keep_lease())
        in_progress = queued.model_copy(update={"status": "in_progress"})
        unavailable = 0
        try:
            while True:
                if not await write(in_progress):
                    return  # ended elsewhere before it started
                try:
                    out = (await self._generate(chat, [messages]))[0]
                    break
                except APIError as e:
                    unavailable += e.status == 503
                    if (wait_s := _background_retry_s(e, unavailable)) is None:
                        raise
                    await write(queued)
                    await asyncio.sleep(wait_s)
            await write(_finished_response(in_progress, out, chat))
        except asyncio.CancelledError:
            await write(queued.model_copy(update={"status": "cancelled"}))
            raise
        except Exception as e:
            error = _as_api_error(e).for_param(responses_param).body.error
            await write(queued.model_copy(update={
                "status": "failed", "error": ResponseError(code=error.code or error.type, message=error.message)}))
        finally:
            keeper.cancel()

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, response_id: str) -> dict[str, Any]:
        return (await self._stored(response_id)).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(
        self, response_id: str, after: str | None = None, limit: Annotated[int, Query(ge=1, le=100)] = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> InputItemList:
        """The items a stored response was generated from, OpenAI's pages of them (the newest
        first by default)."""
        stored = await self._stored(response_id)
        try:
            return input_item_list(stored.conversation, len(stored.response.get("output") or []), after, limit, order)
        except ValueError as e:
            raise APIError(400, str(e), "after") from None

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(self, response_id: str) -> dict[str, Any]:
        """Cancel a background response still generated: it is stored `cancelled`, and its request
        leaves the worker. One another ingress replica generates is marked cancelled here, and
        that replica stops it when it next renews its lease (`_respond_in_background`)."""
        stored = await self._stored(response_id)
        ended = stored.status not in RUNNING_STATUSES
        if not ended:
            task = self._background.get(response_id)
            if task is not None:
                task.cancel()
                await asyncio.wait({task})
            else:
                cancelled = StoredResponse({**stored.response, "status": "cancelled"}, stored.conversation)
                if not await self.stored_responses.put(response_id, cancelled, if_status=RUNNING_STATUSES):
                    stored, ended = await self._stored(response_id), True  # it ended meanwhile
        if ended:
            raise APIError(400, f"response {response_id!r} is {stored.status}: only a background response still "
                                "generated can be cancelled")
        return (await self._stored(response_id)).response

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(self, response_id: str) -> dict[str, Any]:
        """Forget a stored response. One still generated stops: here at once, on another ingress
        replica at its next lease renewal (its record gone, its writes are refused)."""
        try:
            deleted = await self.stored_responses.delete(response_id)
        except ResponseStoreUnavailable as e:
            raise _store_unavailable(e) from None
        if not deleted:
            raise self._no_response(response_id)
        if (task := self._background.get(response_id)) is not None:
            task.cancel()
        return {"id": response_id, "object": "response", "deleted": True}

    async def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a background response whose ingress stopped renewing its lease
        (a restart, a crash) is stored `failed` first, as no replica generates it any more."""
        try:
            stored = await self.stored_responses.get(response_id)
            if stored is not None and response_id not in self._background and _lapsed(stored, time.time()):
                error = ResponseError(code="server_error", message="the server generating this background response "
                                                                   "stopped before it finished; send it again")
                failed = StoredResponse({**stored.response, "status": "failed", "error": error.model_dump()},
                                        stored.conversation)
                ended_here = await self.stored_responses.put(response_id, failed, if_status=RUNNING_STATUSES)
                stored = failed if ended_here else await self.stored_responses.get(response_id)  # ended meanwhile
        except ResponseStoreUnavailable as e:
            raise _store_unavailable(e, param) from None
        if stored is None:
            raise self._no_response(response_id, param)
        return stored

    def _no_background_room(self) -> APIError:
        held = self.args.max_background_responses
        if held == 0:
            return APIError(400, "background: this server runs no background responses "
                                 "(max_background_responses: 0)", "background")
        return _at_capacity(f"background: this server holds {held} background responses, queued or generated",
                            "background")

    def _no_response(self, response_id: str, param: str | None = None) -> APIError:
        return APIError(404, f"no stored response {response_id!r}: this server keeps the last "
                             f"{self.stored_responses.max_responses} responses, unless sent with store: false",
                        param, "not_found")

    @app.post(MESSAGES_PATH, response_model=None)
    async def messages(self, body: MessagesRequest) -> MessageObject | StreamingResponse:
        """Anthropic's Messages API on the chat path (router/messages.py)."""
        body = await self._with_defaults(body)
        try:
            chat = body.as_chat().use_tool_call_parser(self.args.engine.target.tool_call_parser)
            chat = await self._with_defaults(chat)  # the fields this API lacks (min_p, repetition_penalty)
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from None
        message_id = f"msg_{uuid.uuid4().hex}"
        messages = [m.as_template_message() for m in chat.messages]
        try:
            if body.stream:
                gens, heads = await self._open_streams(chat, [messages])
                events = MessageEvents(message_id, self.model_name, heads[0].num_prompt_tokens, chat.tool_calls)
                return StreamingResponse(self._typed_events(gens, heads, events), media_type="text/event-stream")
            out = (await self._generate(chat, [messages]))[0]
        except APIError as e:  # the worker names the chat request's fields
            raise e.for_param(messages_param) from None
        answer = answer_of(out.text, out.finish_reason or "length", chat.tool_calls)
        return MessageObject.of(message_id, self.model_name, content_blocks(answer, out.reasoning), answer, out.result,
                                _speculation_info(out.result))

    @app.post(f"{MESSAGES_PATH}/count_tokens")
    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        """The prompt a Messages request would feed, counted (Anthropic's messages.count_tokens)."""
        self._check_model(body.model)
        try:
            chat = body.as_chat()
        except RequestFieldError as e:
            raise APIError(400, str(e), e.param) from None
        request = GenerateRequest(prompt=[m.as_template_message() for m in chat.messages], tools=chat.template_tools,
                                  chat_template_kwargs=chat.template_kwargs)
        tokens = await self._on_worker(self.worker.tokenize.remote(request))
        return CountTokensResponse(input_tokens=len(tokens.token_ids))

    # -- observability and control (docs/deploy.md, "Observability") ---------------------------
    @app.get("/metrics")
    async def metrics(self) -> Response:
        return Response(render_metrics(await self._observe()), media_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/stats")
    async def stats(self) -> JSONResponse:
        return JSONResponse(stats_json(await self._observe(include_series=True)))

    @app.get("/dashboard")
    async def dashboard(self) -> HTMLResponse:
        return HTMLResponse(self.dashboard_html)

    @app.get("/static/{name}")
    async def static_file(self, name: str) -> Response:
        if name not in self.static:
            raise APIError(404, f"no static file {name!r}", code="not_found")
        return Response(self.static[name], media_type=STATIC_FILES[name], headers={"cache-control": "max-age=3600"})

    @app.put("/v1/policy")
    async def put_policy(self, request: Request) -> dict[str, Any]:
        """Hot reload: every worker replica validates and swaps in the policy (router/control.py)."""
        check_admin_token(self.admin_token, request.headers.get("authorization"))
        policy = parse_policy_body(await request.body())
        update = policy_outcome(await self._on_every_worker("set_policy", policy))
        return {"version": update.version, "num_replicas": update.num_replicas, "replicas": update.replicas}

    @app.post("/v1/stats/reset")
    async def reset_stats(self, request: Request) -> dict[str, Any]:
        """Forget every statistic (a shared store: for all replicas). The routing policy starts
        again from its priors."""
        check_admin_token(self.admin_token, request.headers.get("authorization"))
        answers = await self._on_all_workers("reset_stats", "statistics reset")
        return {"reset": True, "num_replicas": len(answers)}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self, request: Request) -> dict[str, Any]:
        """vLLM's: every replica drops the prefixes finished requests left in its KV pool, so the
        next prompts prefill from the start (a cold-cache benchmark without a restart). Running
        requests are not touched."""
        check_admin_token(self.admin_token, request.headers.get("authorization"))
        answers = await self._on_all_workers("reset_prefix_cache", "prefix cache reset")
        return {"reset": True, "num_replicas": len(answers), "num_tokens": sum(answers)}

    async def _on_all_workers(self, method: str, what: str) -> list[Any]:
        """`method`'s answers from every worker replica; a 500 naming `what` where any replica failed."""
        answers = await self._on_every_worker(method)
        failed = [repr(a) for a in answers if isinstance(a, BaseException)]
        if failed:
            raise APIError(500, f"{what} failed on {len(failed)} of {len(answers)} replicas: {'; '.join(failed)}",
                           type="internal_error")
        return answers

    async def _on_every_worker(self, method: str, *args: Any) -> list[Any]:
        """`method` on every worker replica: its answers, or the exceptions replicas raised."""
        try:
            return await self.worker.broadcast(method, *args).results_async(
                timeout_s=CONTROL_TIMEOUT_S, return_exceptions=True)
        except Exception as e:  # timeout, or no replica running
            raise APIError(503, f"worker replicas did not answer {method}: {e!r}", type="internal_error") from None

    async def _observe(self, include_series: bool = False) -> Observation:
        answers = await self._on_every_worker("observe", include_series)
        observations = [Observation.from_json(a) for a in answers if isinstance(a, dict)]
        if not observations:
            raise APIError(503, f"no worker replica answered observe: {answers!r}", type="internal_error")
        return replace(combine(observations), response_store=self.stored_responses.health(),
                       background=BackgroundResponses(len(self._background), self.args.max_background_responses))

    # -- helpers ------------------------------------------------------------------------------
    async def _max_model_len(self) -> int:
        """The engine's context limit (the model's positions, bounded by config and KV memory):
        asked of a worker replica once; every replica runs the same config."""
        if self._context_limit is None:
            try:
                self._context_limit = int(await self.worker.max_model_len.remote())
            except Exception as e:
                raise APIError(503, f"no worker replica answered max_model_len: {e!r}", type="internal_error") from None
        return self._context_limit

    async def _with_defaults(self, body: RequestT) -> RequestT:
        """`body` with the sampling fields it left out set as the model's generation config says
        (`target.generation_config`), asked of a worker replica once."""
        if self._sampling_defaults is None:
            try:
                self._sampling_defaults = dict(await self.worker.sampling_defaults.remote())
            except Exception as e:
                raise APIError(503, f"no worker replica answered sampling_defaults: {e!r}",
                               type="internal_error") from None
        return with_sampling_defaults(body, self._sampling_defaults)

    async def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, created=self.created, max_model_len=await self._max_model_len())

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            served = ", ".join(f"'{name}'" for name in self.model_names)
            raise APIError(404, f"The model '{model}' does not exist; this server serves {served}", "model",
                           "model_not_found")

    async def _requests(self, body: GenerationRequestBase, prompts: Sequence[Prompt]) -> list[GenerateRequest]:
        """One request per choice, `n` per prompt, prompt by prompt; a seed gives each prompt's choice i
        seed + i, so choices differ yet repeat."""
        self._check_model(body.model)
        max_len = await self._max_model_len()
        if body.num_max_tokens == 0 and not body.echoes and body.prompt_logprobs is None:
            raise APIError(400, "max_tokens: 0 generates nothing; it scores the prompt with echo: true or "
                                "prompt_logprobs", "max_tokens")
        if body.num_max_tokens is not None and body.num_max_tokens >= max_len:
            field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) else "max_tokens"
            raise APIError(400, f"{field}: {body.num_max_tokens} leaves no room for the prompt in this model's "
                                f"context length of {max_len} tokens", field, "context_length_exceeded")
        spec = body.speculation
        request = GenerateRequest(
            prompt="", max_tokens=body.num_max_tokens, temperature=body.temperature,
            top_p=body.top_p, top_k=max(body.top_k, 0), min_p=body.min_p, seed=body.seed, stop=tuple(body.stop),
            include_stop_str_in_output=body.include_stop_str_in_output,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, min_tokens=body.min_tokens,
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            bad_words=tuple(body.bad_words or ()), skip_special_tokens=body.skip_special_tokens,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            drafter=spec.drafter, draft_len=spec.draft_len, domain=spec.domain,
            logprobs=body.num_logprobs, prompt_logprobs=body.prompt_logprobs, logit_bias=body.token_bias,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
            prediction=body.prediction.text if body.prediction is not None else None, echo=body.echoes,
            output_format=body.output_format,
            tools=body.template_tools, generation_prompt=body.generation_prompt,
            continue_final_message=body.continues_last_message, chat_template_kwargs=body.template_kwargs,
            priority=body.priority, cache_salt=body.cache_salt, return_token_ids=body.return_token_ids,
            arrival_time=time.time(),
        )
        seed = body.seed
        return [replace(request, **_prompt_fields(prompt), **({} if seed is None else {"seed": seed + i}))
                for prompt in prompts for i in range(body.n)]

    async def _generate(self, body: GenerationRequestBase, prompts: Sequence[Prompt]) -> list[Chunk]:
        """Every choice's whole output, generated side by side."""
        tasks = [asyncio.ensure_future(self._generate_one(r)) for r in await self._requests(body, prompts)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # one choice failed: the others are not waited for
                task.cancel()
            raise

    @staticmethod
    async def _on_worker(call: Any) -> Tokens:
        try:
            tokens: Tokens = await call
        except Exception as e:
            raise _as_api_error(e) from None
        if tokens.error is not None:
            raise _as_api_error(tokens.error)
        return tokens

    async def _generate_one(self, request: GenerateRequest) -> Chunk:
        call = self.worker.generate.remote(request)
        try:
            chunk: Chunk = await call
        except asyncio.CancelledError:
            call.cancel()  # the worker drops the request (Serve does so itself for a client that went away)
            raise
        except Exception as e:
            raise _as_api_error(e) from None
        if chunk.error is not None:
            raise _as_api_error(chunk.error)
        return chunk

    async def _stream(
        self, body: GenerationRequestBase, prompts: Sequence[Prompt],
        make_chunk: Callable[..., BaseModel], first: Callable[[int], BaseModel] | None,
    ) -> StreamingResponse:
        """`make_chunk(index, text, ...)`: a choice's SSE chunk; `first(index)`: what each choice opens with."""
        gens, heads = await self._open_streams(body, prompts)
        return StreamingResponse(self._events(gens, heads, make_chunk, first, body.include_usage, body.n,
                                              body.continuous_usage, body.return_token_ids),
                                 media_type="text/event-stream")

    async def _open_streams(
        self, body: GenerationRequestBase, prompts: Sequence[Prompt],
    ) -> tuple[list[DeploymentResponseGenerator], list[Chunk]]:
        """Every choice's stream and its first chunk, before the response starts: a bad request
        is still a 400."""
        gens: list[DeploymentResponseGenerator] = [
            self.worker.options(stream=True).stream.remote(r) for r in await self._requests(body, prompts)]
        try:
            heads: list[Chunk] = [await gen.__anext__() for gen in gens]
            if (error := next((h.error for h in heads if h.error is not None), None)) is not None:
                raise error
        except Exception as e:
            _cancel(gens)
            raise _as_api_error(e) from None
        return gens, heads

    async def _typed_events(
        self, gens: list[DeploymentResponseGenerator], heads: list[Chunk], events: ResponseEvents | MessageEvents,
        on_finish: Callable[[], Awaitable[None]] | None = None,
    ) -> AsyncIterator[str]:
        """A streamed /v1/responses or /v1/messages: that API's typed events over the chat's chunks;
        `on_finish` runs once the answer is whole, before the events that end the stream go out."""
        done = False
        try:
            for event in events.start():
                yield event
            async for _, chunk in _interleaved(gens, heads):
                for event in [*events.reasoning(chunk.reasoning), *events.text(chunk.text, chunk.logprobs)]:
                    yield event
                if chunk.finish_reason is not None:
                    ending = events.finish(chunk.finish_reason, chunk.result, _speculation_info(chunk.result))
                    if on_finish is not None:
                        await on_finish()
                    for event in ending:
                        yield event
            done = True
        except _CANCELLED:  # the client went away: nobody to report to
            raise
        except Exception as e:  # the response has started: report in-band, then end the stream
            yield events.error(_as_api_error(e).body.error)
        finally:
            if not done:
                _cancel(gens)

    async def _events(
        self, gens: list[DeploymentResponseGenerator], heads: list[Chunk], make_chunk: Callable[..., BaseModel],
        first: Callable[..., BaseModel] | None, include_usage: bool, n: int, continuous_usage: bool,
        token_ids: bool = False,
    ) -> AsyncIterator[str]:
        """`continuous_usage`: every chunk carries its choice's usage so far (vLLM's `continuous_usage_stats`);
        `token_ids`: each choice's first chunk carries the prompt's token ids and every chunk the output's
        since the choice's previous one (vLLM's `return_token_ids`)."""
        drop = ("speculation", "prompt_token_ids") if include_usage else ("speculation", "prompt_token_ids", "usage")
        generated = [0] * len(gens)  # each choice's tokens so far
        unsent: list[list[int]] = [[] for _ in gens]  # each choice's token ids no chunk carried yet
        opened = [False] * len(gens)

        def ids(index: int) -> dict[str, list[int] | None]:
            """The token ids the choice's next chunk carries, where the request asked."""
            if not token_ids:
                return {}
            prompt = None if opened[index] else heads[index].prompt_token_ids
            return {"token_ids": unsent[index], "prompt_token_ids": prompt}

        def sent(index: int) -> None:
            unsent[index], opened[index] = [], True

        def sse(event: BaseModel, index: int) -> str:
            if continuous_usage:
                prompt = heads[index].num_prompt_tokens
                event = event.model_copy(update={"usage": Usage(
                    prompt_tokens=prompt, completion_tokens=generated[index], total_tokens=prompt + generated[index])})
            return _sse(event, drop)

        done = False
        try:
            if first is not None:
                for index in range(len(gens)):
                    event = first(index, **ids(index))
                    sent(index)
                    yield sse(event, index)
            finished: dict[int, GenerationResult] = {}
            async for index, chunk in _interleaved(gens, heads):
                generated[index] += len(chunk.token_ids)
                unsent[index] += chunk.token_ids
                if chunk.finish_reason is not None:
                    finished[index] = chunk.result
                    event = make_chunk(index, chunk.text, chunk.finish_reason, _speculation_info(chunk.result),
                                       logprobs=chunk.logprobs, reasoning=chunk.reasoning, **ids(index))
                    event.choices[0].stop_reason = chunk.result.stop_reason
                    sent(index)
                    yield sse(event, index)
                elif (chunk.text or chunk.reasoning or chunk.logprobs) and (  # logprobs go out before text may
                        event := make_chunk(index, chunk.text, logprobs=chunk.logprobs,
                                            reasoning=chunk.reasoning, **ids(index))) is not None:
                    sent(index)
                    yield sse(event, index)  # (None: held back, as a tool call is until it is whole)
            if include_usage:
                usage = _usage([finished[i] for i in sorted(finished)], n)
                last = make_chunk(0, "").model_copy(update={"choices": [], "usage": usage})
                yield _sse(last, drop)
            done = True
        except _CANCELLED:  # the client went away: nobody to report to
            raise
        except Exception as e:  # the response has started: report in-band, then end the stream
            yield _sse(_as_api_error(e).body)
        finally:
            if not done:
                _cancel(gens)  # a client that went away frees its slots on the worker
        yield "data: [DONE]\n\n"
