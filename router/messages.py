"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) on the chat
path, as vLLM serves it to Anthropic clients (the anthropic SDK, Claude Code).

A request becomes a chat completion request (`as_chat`): `system` the system message, `messages`
the chat (text blocks joined; an assistant's `tool_use` blocks its tool calls, a user's
`tool_result` blocks tool messages ahead of its text; a last assistant message is a prefill the
answer continues), `tools` OpenAI's function tools with
`input_schema` their parameters, `tool_choice` auto / any / tool / none as "auto" / "required" /
the named function / "none", `stop_sequences` the stop strings; it is then generated, routed and
speculated exactly as a chat completion is; `output_config.format` holds the text to a JSON schema
as `response_format` does. The answer becomes content blocks (`MessageObject.of`):
a reasoning model's `thinking` (under `target.reasoning_parser`), the `text`, then `tool_use`
blocks with their parsed `input`; `stop_reason` is "tool_use" where tools were called, then
"max_tokens", "stop_sequence" (naming it) or "end_turn". A stream is Anthropic's events
(`MessageEvents`): `message_start`, each block's `content_block_start` / `_delta` / `_stop`,
`message_delta` with the stop reason and usage, `message_stop`. `temperature`, `top_p` and
`top_k` (older clients send them) sample as on chat; `thinking`, `output_config.effort`,
`cache_control`, `metadata` and the like are accepted and ignored (whether a model thinks is its
chat template's, which `chat_template_kwargs` reach); images, documents, server tools and
containers are refused by name. Errors take Anthropic's shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, model_validator

from router.chat_path import RequestFieldError, answer_of, chat_request
from router.schemas import ChatCompletionRequest, ErrorBody, NamedToolChoice, SpeculationInfo, SpeculationRequest
from router.tools import Answer, ToolChoice
from workers.result import GenerationResult, TokenLogprobs

# what a field of the chat request came from, for error messages
_FIELD_OF_CHAT = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "output_config"}

# Anthropic's error types by HTTP status (its clients raise by status and show the message)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


# -- requests --------------------------------------------------------------------------------
class _Block(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cache_control: dict[str, Any] | None = None  # prompt caching hints: the prefix cache needs none


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    citations: list[Any] | None = None


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ThinkingBlock(_Block):
    """An earlier answer's thinking, sent back: accepted, not shown to the model again."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Discriminator("type")]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["custom"] | None = None  # server tools (web search, code execution, ...) are not run here
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class ToolChoiceParam(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceParam:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('a name goes with type "tool", and only with it')
        return self


class JsonOutputFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; the model's own
    format: JsonOutputFormat | None = None  # the text held to a JSON schema, as `response_format`


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int = Field(ge=1, description="tokens to generate at most")
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    output_config: OutputConfig | None = None
    # accepted, and ignored: they do not change what is generated here
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # a model thinks as its chat template has it
    cache_control: dict[str, Any] | None = None  # the prefix cache finds a prompt's cached start by itself
    diagnostics: dict[str, Any] | None = None
    service_tier: str | None = None
    speed: str | None = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # what this server does not run
    container: None = Field(None, description="refused: no code execution containers here")
    # vLLM's and SpecRoute's extensions, as on chat
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    priority: int = 0
    speculation: SpeculationRequest | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request that generates this message. A ValueError names the field
        of this request that the chat request refused."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stream": self.stream,
            "seed": self.seed, "ignore_eos": self.ignore_eos, "priority": self.priority,
            "stop": self.stop_sequences or [],
            "chat_template_kwargs": self.chat_template_kwargs,
        }
        if self.messages[-1].role == "assistant":  # a prefill: the answer continues the text it starts
            body.update(add_generation_prompt=False, continue_final_message=True)
        if self.speculation is not None:
            body["speculation"] = self.speculation.model_dump()
        if self.tools:
            if any(t.type is not None and t.type != "custom" for t in self.tools):
                raise RequestFieldError("tools", "tools: only custom tools run here")
            body["tools"] = [{"type": "function", "function": {
                "name": t.name, "parameters": t.input_schema,
                **({} if t.description is None else {"description": t.description})}} for t in self.tools]
        if self.output_config is not None and (fmt := self.output_config.format) is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
        if (choice := self.tool_choice) is not None:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or \
                NamedToolChoice(type="function", function={"name": choice.name}).model_dump()
            if choice.disable_parallel_tool_use:
                body["parallel_tool_calls"] = False
        return chat_request(body, messages_param, "messages")

    def _messages(self) -> list[dict[str, Any]]:
        """The chat's messages: the system prompt first, a user's tool results as tool messages
        ahead of its text, an assistant's tool_use blocks as its tool_calls."""
        messages: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) \
                else message.content
            text = "".join(b.text for b in blocks if isinstance(b, TextBlock))
            if message.role == "assistant":
                calls = [{"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                         for b in blocks if isinstance(b, ToolUseBlock)]
                messages.append({"role": "assistant", "content": text or None,
                                 **({"tool_calls": calls} if calls else {})})
                continue
            messages += [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text}
                         for b in blocks if isinstance(b, ToolResultBlock)]
            if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
                messages.append({"role": "user", "content": text})
        return messages


class CountTokensRequest(BaseModel):
    """messages.count_tokens: the prompt a Messages request would feed, counted."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        return MessagesRequest(max_tokens=1, **self.model_dump(exclude_none=True)).as_chat()


class CountTokensResponse(BaseModel):
    input_tokens: int


def messages_param(chat_param: str) -> str:
    """The field of a Messages request that a chat request's field came from."""
    return _FIELD_OF_CHAT.get(chat_param, chat_param)


# -- responses -------------------------------------------------------------------------------
class OutText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class OutThinking(BaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # nothing here signs a thought


class OutToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = OutThinking | OutText | OutToolUse
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessageUsage(BaseModel):
    input_tokens: int  # prompt tokens prefilled (Anthropic's: not those read from the cache)
    output_tokens: int
    cache_read_input_tokens: int = 0  # prompt tokens whose keys and values the prefix cache held
    cache_creation_input_tokens: int = 0


class MessageObject(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage
    speculation: SpeculationInfo | None = None  # SpecRoute's: what ran and how well it was accepted

    @classmethod
    def of(cls, message_id: str, model: str, blocks: list[ContentBlock], answer: Answer, result: GenerationResult,
           speculation: SpeculationInfo) -> MessageObject:
        reason, sequence = stop_reason(answer, result)
        return cls(id=message_id, model=model, content=blocks, stop_reason=reason, stop_sequence=sequence,
                   usage=usage(result), speculation=speculation)


def usage(result: GenerationResult) -> MessageUsage:
    return MessageUsage(input_tokens=result.num_prompt_tokens - result.num_cached_tokens,
                        output_tokens=result.num_completion_tokens, cache_read_input_tokens=result.num_cached_tokens)


def stop_reason(answer: Answer, result: GenerationResult) -> tuple[StopReason, str | None]:
    if answer.calls:
        return "tool_use", None
    if answer.finish_reason == "length":
        return "max_tokens", None
    if isinstance(result.stop_reason, str):
        return "stop_sequence", result.stop_reason
    return "end_turn", None


def content_blocks(answer: Answer, reasoning: str | None = None) -> list[ContentBlock]:
    """The thinking (where there was some), the answer's text (where it has some, or there is
    nothing else), then its tool calls."""
    blocks: list[ContentBlock] = [OutThinking(thinking=reasoning)] if reasoning else []
    if answer.content or not answer.calls and not blocks:
        blocks.append(OutText(text=answer.content or ""))
    return blocks + tool_uses(answer)


def tool_uses(answer: Answer) -> list[OutToolUse]:
    return [OutToolUse(id=f"toolu_{uuid.uuid4().hex[:24]}", name=c.name, input=json.loads(c.arguments))
            for c in answer.calls or []]


class MessageEvents:
    """A streamed message's events, as SSE text: the caller feeds the chat's reasoning and text
    as they come (`reasoning`, `text`), then the end (`finish`). Each block opens when its first
    text comes and closes when the next one opens; with tools under "auto" an answer's text
    streams as it is written and calls go out whole at the end, as on chat."""

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int, tool_calls: ToolChoice | None) -> None:
        self.message_id, self.model = message_id, model
        self.num_prompt_tokens = num_prompt_tokens  # the cache's share is known at the end (message_delta)
        self.tool_calls = tool_calls
        self._held = ""  # the chat's text so far
        self._sent = ""  # of it, the answer's text streamed
        self._block: Literal["thinking", "text"] | None = None  # the open block
        self._index = -1  # the open (or last) block's index

    def start(self) -> list[str]:
        started = MessageObject(id=self.message_id, model=self.model, content=[],
                                usage=MessageUsage(input_tokens=self.num_prompt_tokens, output_tokens=0))
        return [self._event("message_start", message=started.model_dump(exclude={"speculation"}))]

    def reasoning(self, delta: str | None) -> list[str]:
        if not delta:
            return []
        return [*self._open("thinking"), self._event("content_block_delta", index=self._index,
                                                     delta={"type": "thinking_delta", "thinking": delta})]

    def text(self, delta: str, logprobs: list[TokenLogprobs] | None = None) -> list[str]:
        """`logprobs`: never asked here (Anthropic's API has none); the stream driver's signature."""
        self._held += delta
        content = self._held if self.tool_calls is None else self.tool_calls.streamed_content(self._held)
        new = (content or "")[len(self._sent):]
        if not new:
            return []
        self._sent += new
        return [*self._open("text"), self._event("content_block_delta", index=self._index,
                                                 delta={"type": "text_delta", "text": new})]

    def finish(self, finish_reason: str, result: GenerationResult, speculation: SpeculationInfo) -> list[str]:
        answer = answer_of(self._held, finish_reason, self.tool_calls)
        if self._block == "text" and answer.content is None:  # streamed as an answer, cut short: what was sent
            answer = Answer(answer.calls, self._sent, answer.finish_reason)
        events = []
        if rest := (answer.content or "")[len(self._sent):]:
            events += [*self._open("text"), self._event("content_block_delta", index=self._index,
                                                        delta={"type": "text_delta", "text": rest})]
        elif self._index < 0 and not answer.calls:  # nothing at all: one empty text block, as a message has
            events += self._open("text")
        events += self._close()
        for block in tool_uses(answer):
            self._index += 1
            events += [
                self._event("content_block_start", index=self._index,
                            content_block={**block.model_dump(), "input": {}}),
                self._event("content_block_delta", index=self._index,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(block.input)}),
                self._event("content_block_stop", index=self._index)]
        reason, sequence = stop_reason(answer, result)
        return [*events,
                self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage=usage(result), speculation=speculation),
                self._event("message_stop")]

    def error(self, error: ErrorBody) -> str:
        kind = {"rate_limit_error": "rate_limit_error", "invalid_request_error": "invalid_request_error"}
        return self._event("error", error={"type": kind.get(error.type, "api_error"), "message": error.message})

    def _open(self, block: Literal["thinking", "text"]) -> list[str]:
        """The block's opening events (closing the one open before), the first time it streams."""
        if self._block == block:
            return []
        events = self._close()
        self._block, self._index = block, self._index + 1
        empty = OutThinking(thinking="") if block == "thinking" else OutText(text="")
        return [*events, self._event("content_block_start", index=self._index, content_block=empty)]

    def _close(self) -> list[str]:
        if self._block is None:
            return []
        events = []
        if self._block == "thinking":  # Anthropic's clients expect a thought's signature before its end
            events.append(self._event("content_block_delta", index=self._index,
                                      delta={"type": "signature_delta", "signature": ""}))
        self._block = None
        return [*events, self._event("content_block_stop", index=self._index)]

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        payload = {"type": kind, **{k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v
                                    for k, v in fields.items()}}
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
