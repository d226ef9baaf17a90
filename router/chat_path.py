"""Other APIs served on the chat path (/v1/responses, /v1/messages): their request as a chat
completion request, its refusals named by the other API's fields, and the chat's answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from router.schemas import ChatCompletionRequest
from router.tools import Answer, ToolChoice


class RequestFieldError(ValueError):
    """A request the chat path refused, naming the field of the API it came in."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def chat_request(body: dict[str, Any], rename: Callable[[str], str], default: str) -> ChatCompletionRequest:
    """`body` validated as a chat completion request; a refusal names the field it came from
    (`rename` of the chat's field; `default` where the error has no field)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        error = e.errors()[0]
        loc = [str(p) for p in error["loc"] if not isinstance(p, int)]
        field = rename(loc[0]) if loc else default
        raise RequestFieldError(field, f"{field}: {error['msg']}") from None


def answer_of(text: str, finish_reason: str, tool_calls: ToolChoice | None) -> Answer:
    """The chat's answer: the text, or the calls it holds."""
    return Answer(None, text, finish_reason) if tool_calls is None else tool_calls.answer(text, finish_reason)
