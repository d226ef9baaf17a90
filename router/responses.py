"""OpenAI's Responses API (`POST /v1/responses`) on the chat path.

A request becomes a chat completion request (`as_chat`): `instructions` the system message,
`input` (a text, or messages, function calls and their outputs) the chat, `text.format` the
`response_format`, flat function tools OpenAI's chat tools; it is then generated, routed and
speculated exactly as a chat completion is. The answer becomes output items (`ResponseObject.of`):
a `message` with the text, or `function_call` items where tools were called. A stream is
Responses' typed events (`ResponseEvents`): `response.created`, the items' `added` / `delta` /
`done` events, `response.completed`. `include: ["message.output_text.logprobs"]` asks for the
output's tokens' logprobs (`top_logprobs` alternatives each), as chat reports them; a reasoning
model's thinking tokens count among them. A response is stored unless `store: false`
(router/response_store.py): `previous_response_id` continues its conversation (`after`), and
`GET` / `DELETE /v1/responses/{id}` read and forget it. A `background` response is answered
at once, `queued`, and generated while the client polls `GET /v1/responses/{id}` (its status
`in_progress`, then `completed`, `incomplete`, `failed` or, by `POST /v1/responses/{id}/cancel`,
`cancelled`). `conversation` is refused by name.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, TypeAdapter, field_validator

from router.chat_path import answer_of, chat_request
from router.schemas import (
    MAX_LOGPROBS,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    ErrorBody,
    NamedToolChoice,
    SpeculationInfo,
    SpeculationRequest,
)
from router.tools import Answer, ToolChoice
from workers.result import GenerationResult, TokenLogprobs

# what a field of the chat request came from, for error messages
_FIELD_OF_CHAT = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format",
                  "reasoning_effort": "reasoning.effort"}


# -- requests --------------------------------------------------------------------------------
class ContentPart(BaseModel):
    """A message's text part (what an earlier response's output_text is sent back as, too)."""

    model_config = ConfigDict(extra="ignore")  # output_text carries annotations and logprobs

    type: Literal["input_text", "output_text"]
    text: str


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # JSON text
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


class ReasoningItem(BaseModel):
    """An earlier response's reasoning, sent back: accepted, and not shown to the model again
    (reasoning models' templates leave past thinking out)."""

    model_config = ConfigDict(extra="ignore")  # summary, content, encrypted_content, status

    type: Literal["reasoning"]
    id: str | None = None


def _item_type(value: Any) -> str:
    """A message may leave out its type (OpenAI's easy input message)."""
    return (value.get("type") if isinstance(value, dict) else getattr(value, "type", None)) or "message"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]
_INPUT_ITEMS = TypeAdapter(list[InputItem])


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # OpenAI's; one verbosity here


class ResponsesRequest(BaseModel):
    """OpenAI's fields that change the output are served, and SpecRoute's extensions as on chat;
    those that ask for state or features this server does not keep are refused by name."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    input: Annotated[Annotated[str, Tag("str")] | Annotated[list[InputItem], Tag("list")],
                     Discriminator(lambda v: "str" if isinstance(v, str) else "list")] = Field(
        description="a text (the user's message) or the conversation's items")
    instructions: str | None = Field(None, description="the system message")
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = Field(None, description="its `effort` reaches the chat template as chat's "
                                                               "reasoning_effort does")
    # accepted, and ignored: they do not change what is generated
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = Field(None, description="keep the response for previous_response_id and GET "
                                                 "/v1/responses/{id} (default: true, as OpenAI)")
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = Field(None, ge=0, description="accepted; it bounds built-in tools, none here")
    previous_response_id: str | None = Field(None, description="a stored response this one continues")
    # state and features this server does not keep
    conversation: None = Field(None, description="refused: no conversations are kept; use previous_response_id")
    prompt: None = Field(None, description="refused: no prompt templates are stored")
    background_options: None = None
    context_management: None = None
    access_programs: None = None
    image: None = None
    moderation: None = None
    background: bool = Field(False, description="answer at once and generate meanwhile: the response is read "
                                                "with GET /v1/responses/{id} (needs store)")
    truncation: Literal["disabled"] | None = None
    # extra output: each output token's logprob and its top_logprobs likeliest
    include: list[Literal["message.output_text.logprobs"]] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # SpecRoute's extensions, as on chat
    seed: int | None = None
    top_k: int = Field(0, ge=-1)
    ignore_eos: bool = False
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1)
    speculation: SpeculationRequest | None = None

    @field_validator("input")
    @classmethod
    def _some_input(cls, value: str | list[Any]) -> str | list[Any]:
        if not value:
            raise ValueError("holds no input")
        return value

    @property
    def with_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def stores(self) -> bool:
        return self.store is not False

    def input_items(self) -> list[dict[str, Any]]:
        """This request's input as items (a text: the user's message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": self.input}]
        return [item.model_dump(mode="json", exclude_none=True) for item in self.input]

    def after(self, history: list[dict[str, Any]]) -> ResponsesRequest:
        """This request with `history` (a stored response's conversation) ahead of its input; its
        own instructions only, as OpenAI carries none over."""
        if not history:
            return self
        return self.model_copy(update={"input": _INPUT_ITEMS.validate_python([*history, *self.input_items()])})

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion request that generates this response. A ValueError names the field
        of this request that the chat request refused."""
        body: dict[str, Any] = {
            "model": self.model, "messages": self._messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "seed": self.seed,
            "top_k": self.top_k, "ignore_eos": self.ignore_eos, "priority": self.priority,
            "cache_salt": self.cache_salt, "parallel_tool_calls": self.parallel_tool_calls,
        }
        if self.speculation is not None:
            body["speculation"] = self.speculation.model_dump()
        if self.reasoning and self.reasoning.get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]
        if self.with_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        body["tool_choice"] = (choice if isinstance(choice, str)
                               else NamedToolChoice(type="function", function={"name": choice.name}).model_dump())
        if self.text is not None and (fmt := self.text.format) is not None:
            body["response_format"] = {"type": fmt.type} if fmt.type != "json_schema" else {
                "type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                       "description": fmt.description, "strict": fmt.strict}}
        return chat_request(body, responses_param, "input")

    def _messages(self) -> list[dict[str, Any]]:
        """The chat's messages: instructions first, consecutive function calls as one assistant
        message's tool_calls, their outputs as tool messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        return messages


def responses_param(chat_param: str) -> str:
    """The field of a Responses request that a chat request's field came from."""
    return _FIELD_OF_CHAT.get(chat_param, chat_param)


# -- input items -----------------------------------------------------------------------------
_ITEM_ID_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def with_item_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`items`, each with an id (a new one where it came without), as OpenAI names every input
    item: what GET /v1/responses/{id}/input_items pages by."""
    return [item if item.get("id") else {**item, "id": f"{_ITEM_ID_PREFIX[_item_type(item)]}_{uuid.uuid4().hex}"}
            for item in items]


class InputItemList(BaseModel):
    object: Literal["list"] = "list"
    data: list[dict[str, Any]]
    first_id: str | None
    last_id: str | None
    has_more: bool


def input_item_list(conversation: list[dict[str, Any]], num_output: int, after: str | None, limit: int,
                    order: Literal["asc", "desc"]) -> InputItemList:
    """A stored response's input items: its conversation before its own `num_output` output
    items, the earlier turns included (they made its prompt), in `order` (desc: the newest first),
    `limit` of them after the item `after`. A ValueError where no item is `after`."""
    items = [_listed(item, i) for i, item in enumerate(conversation[: len(conversation) - num_output])]
    if order == "desc":
        items.reverse()
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise ValueError(f"after: no input item {after!r} in this response")
        start = ids.index(after) + 1
    page = items[start : start + limit]
    return InputItemList(data=page, first_id=page[0]["id"] if page else None,
                         last_id=page[-1]["id"] if page else None, has_more=start + limit < len(items))


def _listed(item: dict[str, Any], index: int) -> dict[str, Any]:
    """A stored item as OpenAI lists it: a message with its text as a content part and a status;
    one stored without an id named by its place."""
    if not item.get("id"):
        item = {**item, "id": f"item_{index}"}
    if _item_type(item) != "message":
        return item
    content = item["content"]
    if isinstance(content, str):
        content = [{"type": "output_text" if item["role"] == "assistant" else "input_text", "text": content}]
    return {**item, "type": "message", "content": content, "status": item.get("status") or "completed"}


# -- responses -------------------------------------------------------------------------------
class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[ChatTokenLogprob] = []  # with include message.output_text.logprobs


def logprobs_of(entries: list[TokenLogprobs] | None) -> list[ChatTokenLogprob]:
    return [] if not entries else ChatLogprobs.of(entries).content


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    """A reasoning model's thinking (target.reasoning_parser), ahead of its answer."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[Any] = []
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseError(BaseModel):
    """Why a background response failed."""

    code: str
    message: str


# a background response's status while it is generated (it can then be cancelled)
RUNNING_STATUSES = ("queued", "in_progress")


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    model: str
    output: list[OutputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float
    top_p: float
    tools: list[FunctionTool]
    tool_choice: str | FunctionToolChoice
    parallel_tool_calls: bool
    text: TextConfig
    metadata: dict[str, str] | None = None
    store: bool = False
    background: bool = False
    previous_response_id: str | None = None
    usage: ResponseUsage | None = None
    speculation: SpeculationInfo | None = None  # SpecRoute's: what ran and how well it was accepted

    @classmethod
    def started(cls, request: ResponsesRequest, response_id: str, model: str, store: bool) -> ResponseObject:
        """The response before any output: what `response.created` carries; `store`: whether it
        is kept."""
        return cls(
            id=response_id, created_at=int(time.time()), status="in_progress", model=model, output=[],
            instructions=request.instructions, max_output_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p, tools=request.tools or [],
            tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls,
            text=request.text or TextConfig(format=TextFormat(type="text")), metadata=request.metadata,
            store=store, background=request.background, previous_response_id=request.previous_response_id,
        )

    def finished(self, output: list[OutputItem], result: GenerationResult, finish_reason: str,
                 speculation: SpeculationInfo) -> ResponseObject:
        incomplete = finish_reason == "length"
        usage = ResponseUsage(
            input_tokens=result.num_prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=result.num_cached_tokens),
            output_tokens=result.num_completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=result.num_reasoning_tokens),
            total_tokens=result.num_prompt_tokens + result.num_completion_tokens)
        return self.model_copy(update={
            "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None,
            "speculation": speculation,
        })


def output_items(answer: Answer, message_id: str, reasoning: str | None = None, reasoning_id: str = "",
                 logprobs: list[TokenLogprobs] | None = None) -> list[OutputItem]:
    """The reasoning (where there was some), a message with the answer's text (where it has some;
    with the output's `logprobs`), then its function calls."""
    items: list[OutputItem] = []
    status = "incomplete" if answer.finish_reason == "length" else "completed"
    if reasoning:
        items.append(OutputReasoning(id=reasoning_id or f"rs_{uuid.uuid4().hex}",
                                     content=[ReasoningText(text=reasoning)]))
    if answer.content or answer.content is not None and answer.calls is None and not reasoning:
        items.append(OutputMessage(id=message_id, status=status,
                                   content=[OutputText(text=answer.content, logprobs=logprobs_of(logprobs))]))
    for call in answer.calls or []:
        items.append(OutputFunctionCall(id=f"fc_{uuid.uuid4().hex}", call_id=f"call_{uuid.uuid4().hex[:24]}",
                                        name=call.name, arguments=call.arguments))
    return items


class ResponseEvents:
    """A streamed response's events, as SSE text: the caller feeds the chat's reasoning and text
    as they come (`reasoning`, `text`), then the end (`finish`). The reasoning is the first item
    and ends when the answer starts. With tools under "auto" an answer's content streams as it is
    written and calls go out whole at the end, as on chat."""

    def __init__(self, response: ResponseObject, tool_calls: ToolChoice | None) -> None:
        self.response = response
        self.tool_calls = tool_calls
        self.done: ResponseObject | None = None  # the finished response, once `finish` made it
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self._sequence = 0
        self._held = ""  # the chat's text so far
        self._sent = ""  # of it, the message content streamed
        self._opened = False  # whether the message item has been announced
        self._thought = ""  # the reasoning streamed
        self._thinking = False  # whether the reasoning item is open
        self._tokens: list[TokenLogprobs] = []  # the output's logprobs so far (include message.output_text.logprobs)
        self._tokens_sent = 0  # of them, those a text delta carried

    def start(self) -> list[str]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def reasoning(self, delta: str | None) -> list[str]:
        if not delta:
            return []
        events = []
        if not self._thinking:
            self._thinking = True
            empty = OutputReasoning(id=self.reasoning_id, content=[], status="in_progress")
            events.append(self._event("response.output_item.added", output_index=0, item=empty))
        self._thought += delta
        return [*events, self._event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=0,
                                     content_index=0, delta=delta)]

    def text(self, delta: str, logprobs: list[TokenLogprobs] | None = None) -> list[str]:
        """`logprobs`: the delta's tokens', where the request included them; a text delta carries
        those of the tokens since the last one (text may be held back while tokens come)."""
        self._held += delta
        self._tokens += logprobs or []
        content = self._held if self.tool_calls is None else self.tool_calls.streamed_content(self._held)
        new = (content or "")[len(self._sent):]
        if not new:
            return []
        self._sent += new
        return [*self._open(), self._event("response.output_text.delta", item_id=self.message_id,
                                           output_index=self._message_index, content_index=0, delta=new,
                                           logprobs=self._unsent_tokens())]

    def _unsent_tokens(self) -> list[ChatTokenLogprob]:
        unsent, self._tokens_sent = self._tokens[self._tokens_sent:], len(self._tokens)
        return logprobs_of(unsent)

    def finish(self, finish_reason: str, result: GenerationResult, speculation: SpeculationInfo) -> list[str]:
        answer = answer_of(self._held, finish_reason, self.tool_calls)
        if self._opened and answer.content is None:  # streamed as an answer, cut short: what was sent
            answer = Answer(answer.calls, self._sent, answer.finish_reason)
        items = output_items(answer, self.message_id, self._thought, self.reasoning_id, self._tokens)
        events = self._end_reasoning()
        for index, item in enumerate(items):
            if isinstance(item, OutputReasoning):  # streamed, and ended above
                continue
            if isinstance(item, OutputMessage):
                events += self._open()
                text = item.content[0].text
                if rest := text[len(self._sent):]:
                    events.append(self._event("response.output_text.delta", item_id=item.id, output_index=index,
                                              content_index=0, delta=rest, logprobs=self._unsent_tokens()))
                events += [
                    self._event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                                text=text, logprobs=item.content[0].logprobs),
                    self._event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                                part=item.content[0]),
                ]
            else:
                events += [
                    self._event("response.output_item.added", output_index=index,
                                item=item.model_copy(update={"arguments": "", "status": "in_progress"})),
                    self._event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                delta=item.arguments),
                    self._event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                arguments=item.arguments),
                ]
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        done = self.done = self.response.finished(items, result, finish_reason, speculation)
        kind = "response.completed" if done.status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=done)]

    def error(self, error: ErrorBody) -> str:
        return self._event("error", code=error.code, message=error.message, param=error.param)

    @property
    def _message_index(self) -> int:
        """The message's place in the output: after the reasoning, where there was some."""
        return 1 if self._thought else 0

    def _end_reasoning(self) -> list[str]:
        """The reasoning item's closing events, once the answer starts (or the output ends)."""
        if not self._thinking:
            return []
        self._thinking = False
        item = OutputReasoning(id=self.reasoning_id, content=[ReasoningText(text=self._thought)])
        return [self._event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=0,
                            content_index=0, text=self._thought),
                self._event("response.output_item.done", output_index=0, item=item)]

    def _open(self) -> list[str]:
        """The message item's opening events, the first time its text streams."""
        if self._opened:
            return []
        self._opened = True
        empty = OutputMessage(id=self.message_id, status="in_progress", content=[])
        index = self._message_index
        return [*self._end_reasoning(), self._event("response.output_item.added", output_index=index, item=empty),
                self._event("response.content_part.added", item_id=self.message_id, output_index=index,
                            content_index=0, part=OutputText(text=""))]

    def _event(self, kind: str, **fields: Any) -> str:
        def plain(v: Any) -> Any:
            if isinstance(v, list):
                return [plain(x) for x in v]
            return v.model_dump(mode="json", by_alias=True) if isinstance(v, BaseModel) else v

        payload = {"type": kind, "sequence_number": self._sequence, **{k: plain(v) for k, v in fields.items()}}
        self._sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"
