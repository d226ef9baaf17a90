"""The ingress's per-request guard, before any routing or parsing: the API key of inference
endpoints and the request-size limit, plus the Retry-After of refusals; and the cross-origin
(CORS) headers browsers need to call the API from another origin.

Serve runs one ingress per replica process and serves a frozen (pickled) copy of the FastAPI app;
the ingress class itself is pickled by value. Both reach these settings through this module, which
pickles by reference, so `configure` at ingress start is what the middleware reads.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEFAULT_RETRY_AFTER_S = 1
API_KEY_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
                           "/v1/messages/count_tokens", "/v1/models", "/tokenize", "/detokenize"})
API_KEY_PREFIXES = ("/v1/models/",)  # a model's card

Refusal = Callable[[int, str, str, str], ASGIApp]  # (status, message, code, path) -> the response


@dataclass(frozen=True)
class CorsSettings:
    """Which other origins' pages may call the API (Starlette's CORSMiddleware; vLLM's defaults)."""

    allow_origins: tuple[str, ...] = ("*",)  # none: no cross-origin headers at all
    allow_methods: tuple[str, ...] = ("*",)
    allow_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass
class Settings:
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    retry_after_s: int = DEFAULT_RETRY_AFTER_S
    api_key: str | None = None  # None: inference is open
    cors: CorsSettings = CorsSettings()


SETTINGS = Settings()


def configure(max_request_bytes: int, retry_after_s: int, api_key: str | None,
              cors: CorsSettings = CorsSettings()) -> None:
    SETTINGS.max_request_bytes = max_request_bytes
    SETTINGS.retry_after_s = retry_after_s
    SETTINGS.api_key = api_key or None
    SETTINGS.cors = cors


class CrossOrigin:
    """ASGI middleware: Starlette's CORSMiddleware with the origins the ingress was configured with,
    built at the first request (the app exists before the ingress reads its arguments); it answers
    a browser's preflight itself, so the API key is never asked of one. No origins: passes through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._inner: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self._inner is None:
            c = SETTINGS.cors
            self._inner = self.app if not c.allow_origins else CORSMiddleware(
                self.app, allow_origins=list(c.allow_origins), allow_methods=list(c.allow_methods),
                allow_headers=list(c.allow_headers), allow_credentials=c.allow_credentials)
        await self._inner(scope, receive, send)


def bearer_matches(expected: str, authorization: str | None) -> bool:
    """`Authorization: Bearer <expected>`, compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected.encode())


def api_key_matches(expected: str, headers: dict[bytes, bytes]) -> bool:
    """The key as OpenAI's clients send it (`Authorization: Bearer`) or Anthropic's (`x-api-key`)."""
    return bearer_matches(expected, headers.get(b"authorization", b"").decode("latin-1")) or \
        hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), expected.encode())


class RequestGuard:
    """ASGI middleware. Inference paths need the API key (401 before the body is read, so a bad
    body tells an unauthenticated client nothing). A body over `max_request_bytes` is refused (413)
    by its Content-Length before it is read; a body that declares no length (chunked) is read up to
    the limit first and replayed to the app, which reads whole bodies anyway. (Starlette's
    RequestBodyLimitMiddleware fixes its limit at construction and answers in plain text, outside
    the app's exception handlers: clients here get OpenAI's error shape.)"""

    def __init__(self, app: ASGIApp, refuse: Refusal) -> None:
        self.app = app
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        key = SETTINGS.api_key
        path = scope.get("path", "")
        if key and (path in API_KEY_PATHS or path.startswith(API_KEY_PREFIXES)) and not api_key_matches(key, headers):
            refusal = self.refuse(401, "missing or incorrect API key: send Authorization: Bearer <api key> "
                                       "(or x-api-key: <api key>)", "invalid_api_key", path)
            return await refusal(scope, receive, send)
        limit = SETTINGS.max_request_bytes
        too_large = self.refuse(413, f"request body exceeds the limit of {limit} bytes", "request_too_large", path)
        length = headers.get(b"content-length")
        if length is not None:
            if length.isdigit() and int(length) > limit:
                return await too_large(scope, receive, send)
            return await self.app(scope, receive, send)  # the server holds the body to its declared length
        messages: list[Message] = []
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client went away: let the app see it
                break
            size += len(message.get("body", b""))
            if size > limit:
                return await too_large(scope, receive, send)
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)
