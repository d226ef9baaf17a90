"""OpenAI-compatible request and response models for /v1/completions and /v1/chat/completions,
plus SpecRoute's extensions: `speculation` (request: the plan asked for; response: what ran and
how well it was accepted), and vLLM's sampling extensions: `top_k`, `min_p`, `ignore_eos`,
`min_tokens`, `stop_token_ids`, `include_stop_str_in_output`, `allowed_token_ids`, `bad_words`,
`skip_special_tokens`, `truncate_prompt_tokens` and `prompt_logprobs`, and its output extension
`return_token_ids` (the prompt's and the output's token ids beside the text).

`logprobs` report the target's raw distribution (before penalties, temperature, top-k and top-p;
vLLM's default), read off the rows that verified each token (workers/logprobs.py). Penalties and
`logit_bias` apply to every verified row with its own history (workers/penalties.py), and so do
the bans of `allowed_token_ids`, `min_tokens` and `bad_words` (workers/bans.py). A
`prediction` (OpenAI's Predicted Outputs) is drafted from, never emitted as is
(workers/drafters/prediction.py); `usage.completion_tokens_details` counts its tokens. A
completion's `echo` repeats the prompt ahead of it, with `logprobs` the prompt tokens' too (read
off the prefill's rows; the first token has none; `max_tokens: 0` with it: the prompt alone):
lm-evaluation-harness's loglikelihood requests.
`response_format` (OpenAI's `json_object` / `json_schema`, on both endpoints) and vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`) hold the output to a format: every
verified row is masked by the grammar (workers/structured.py), so speculation stays lossless.
`tools` are decoded the same way, under the calls' schemas (router/tools.py): "required" calls,
a named function's, or with "auto" (the default) calls or an answer, which streams as content.
On chat, vLLM's `continue_final_message` continues an assistant message the client started (with
`add_generation_prompt: false`), and `echo` starts the answer's content with it; `priority` (on
both endpoints) orders admission under the scheduler's priority policy, and `cache_salt` keeps a
tenant's cached state (reused prompt prefixes, the suffix drafter's memory) to its own requests.

Every field OpenAI defines is accepted. Those that do not change what is generated (`user`,
`metadata`, ...) are ignored; those this server does not implement (`functions`, `audio`, ...)
are accepted at their no-op value and refused otherwise, naming the field, rather than silently
answered without them. A field OpenAI does not define is refused: a typo must not pass unnoticed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from router.tools import NO_PARAMETERS, ToolChoice
from workers.config import (
    AUTO,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    ToolCallParser,
)
from workers.result import Logprob, TokenLogprobs
from workers.structured import OutputFormat, format_error

MAX_CHOICES = 16  # `n`: a request's choices each take a slot of the worker's batch
MAX_SEQUENCES = 64  # a completion's prompts times `n`: each its own request in the worker's batch
_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")  # each endpoint's names for it


# -- requests --------------------------------------------------------------------------------
# The values of OpenAI's unimplemented fields that ask for nothing (a client library may send them)
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "best_of": (None, 1), "functions": (None, []), "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,), "moderation": (None,),
}


def _no_op(value: Any, info: ValidationInfo) -> Any:
    """`value` if it asks for nothing; a field this server does not implement is refused otherwise."""
    if value not in _NO_OP_VALUES[info.field_name]:
        raise ValueError(f"not supported by this server (got {value!r})")
    return value


class SpeculationRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    drafter: str = Field(
        AUTO, description='"auto" (the router decides), "none" (plain decoding) or a drafter name')
    draft_len: int | None = Field(None, description='"auto" (null) or K >= 1 tokens per draft')
    domain: str | None = Field(None, description="a policy domain, overriding the classifier (null: classify)")

    @field_validator("draft_len", mode="before")
    @classmethod
    def _draft_len(cls, value: Any) -> Any:
        if value is None or value == AUTO:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f'must be "auto" or an integer >= 1, got {value!r}')
        return value


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="extension, as in vLLM: with include_usage, every "
                                                            "chunk carries the usage so far")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Prediction(BaseModel):
    """OpenAI's Predicted Outputs: text the output is expected to repeat (a file an edit rewrites)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema", description="null: any JSON object")
    strict: bool | None = Field(None, description="the output always matches the schema here, strict or not")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given with type "json_schema", and only then')
        return self

    @property
    def output_format(self) -> OutputFormat | None:
        if self.type == "text":
            return None
        return OutputFormat.json_schema(self.json_schema.schema_ if self.json_schema is not None else None)


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of a JSON schema, a regex, choices, a Lark grammar."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = Field(None, description="a Lark grammar (llguidance's dialect)")
    json_object: bool | None = Field(None, description="true: any JSON object")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {len(given)})")
        return self

    @property
    def output_format(self) -> OutputFormat:
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return OutputFormat.json_schema(schema)
        if self.regex is not None:
            return OutputFormat("regex", self.regex)
        if self.choice is not None:
            return OutputFormat.choice(self.choice)
        if self.grammar is not None:
            return OutputFormat("grammar", self.grammar)
        return OutputFormat.json_schema()


def _checked_format(value: ResponseFormat | StructuredOutputs | None) -> Any:
    """A format that compiles (its schema, regex or grammar is checked here, at the ingress)."""
    try:
        fmt = value.output_format if value is not None else None
    except ValueError as e:  # a `json` text that is not JSON
        raise ValueError(f"not a JSON schema: {e}") from None
    if fmt is not None and (error := format_error(fmt)) is not None:
        raise ValueError(error.strip())
    return value


RequestT = TypeVar("RequestT", bound=BaseModel)


def with_sampling_defaults(body: RequestT, defaults: Mapping[str, float | int]) -> RequestT:
    """`body` (any endpoint's request) with each sampling field it left out that `defaults` names
    set to the default (the model's generation config, workers/target.py `sampling_defaults`); the
    default `max_tokens` goes to the endpoint's own field for it where the request set none."""
    fields, sent = type(body).model_fields, body.model_fields_set
    update = {name: value for name, value in defaults.items()
              if name != "max_tokens" and name in fields and name not in sent}
    limits = [name for name in _MAX_TOKENS_FIELDS if name in fields]
    if "max_tokens" in defaults and limits and not sent.intersection(limits):
        update[limits[0]] = defaults["max_tokens"]
    return body.model_copy(update=update) if update else body


class GenerationRequestBase(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = Field(None, description="the served model name (optional: there is one)")
    max_tokens: int | None = Field(None, ge=1, description="tokens to generate (default: the engine's)")
    temperature: float = Field(1.0, ge=0, le=2, description="0 = greedy; OpenAI's default is 1")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="extension: 0 or -1 = whole vocabulary")
    min_p: float = Field(0.0, ge=0, le=1, description="extension, as in vLLM: drop tokens less likely than min_p "
                                                    "times the likeliest (0: none)")
    seed: int | None = None
    stop: list[str] = Field(default_factory=list, description="a string or a list of strings")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="extension, as in vLLM: token ids that end the output as end-of-sequence does")
    include_stop_str_in_output: bool = Field(False, description="extension, as in vLLM: keep the stop string found")
    min_tokens: int = Field(0, ge=0, description="extension, as in vLLM: no stop token or string before this many "
                                                 "output tokens")
    allowed_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, min_length=1, description="extension, as in vLLM: the only token ids the output may take")
    bad_words: list[str] | None = Field(
        None, max_length=MAX_BAD_WORDS, description="extension, as in vLLM: words the output never contains "
                                                    "(their last token is banned after the others)")
    skip_special_tokens: bool = Field(True, description="extension, as in vLLM: leave special tokens out of the text")
    return_tokens_as_token_ids: bool = Field(False, description='extension, as in vLLM: logprobs name tokens '
                                                                '"token_id:N", not by their text')
    return_token_ids: bool = Field(False, description="extension, as in vLLM: the prompt's and each choice's "
                                                      "token ids beside the text (streamed: the prompt's on the first "
                                                      "chunk, each chunk's new ones)")
    truncate_prompt_tokens: int | None = Field(
        None, ge=-1, description="extension, as in vLLM: keep the prompt's last so many tokens (-1: as many as "
                                 "the model's context holds)")
    stream: bool = False
    stream_options: StreamOptions | None = None
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="extension, as in vLLM: each prompt token's logprob and rank, and "
                                                 "this many likeliest at its position (not with stream)")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="choices to generate, each its own request in the batch")
    ignore_eos: bool = Field(False, description="extension: keep generating past end-of-sequence")
    priority: int = Field(0, description="extension, as in vLLM: lower is admitted first, under the scheduler's "
                                         "priority policy (any other value is refused under first come first served)")
    cache_salt: str | None = Field(
        None, min_length=1, description="extension, as in vLLM: cached state (reused prompt prefixes, the suffix "
                                        "drafter's memory of past outputs) is shared only with requests of this salt")
    speculation: SpeculationRequest = Field(default_factory=SpeculationRequest)
    # OpenAI fields that do not change the output: accepted and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    repetition_penalty: float | None = Field(None, ge=1 / MAX_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY,
                                             description="extension, as in vLLM: 1 = none")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias added to its logit")
    prediction: Prediction | None = Field(
        None, description="the output expected, drafted from (OpenAI's on chat; an extension on completions)")
    response_format: ResponseFormat | None = Field(
        None, description="text, any JSON object, or JSON of a schema (OpenAI's on chat; also on completions)")
    structured_outputs: StructuredOutputs | None = Field(
        None, description="extension, as in vLLM: the output matches a JSON schema, regex, choice or grammar")

    @field_validator("prompt_logprobs")
    @classmethod
    def _not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and info.data.get("stream"):
            raise ValueError("not available with stream: true")  # as vLLM: the prompt is scored before any chunk
        return value

    @field_validator("response_format", "structured_outputs")
    @classmethod
    def _format_compiles(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name == "structured_outputs" and value is not None and (
                (given := info.data.get("response_format")) is not None and given.type != "text"):
            raise ValueError("give response_format or structured_outputs, not both")
        return _checked_format(value)

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tool definitions a chat template may render."""
        return None

    @property
    def generation_prompt(self) -> bool:
        """Whether the chat template opens the assistant's message after the chat."""
        return True

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """More variables for the chat template."""
        return None

    @property
    def continues_last_message(self) -> bool:
        """Whether the output continues the chat's last message, left open."""
        return False

    @property
    def output_format(self) -> OutputFormat | None:
        """What the output must match, if anything."""
        if self.structured_outputs is not None:
            return self.structured_outputs.output_format
        return self.response_format.output_format if self.response_format is not None else None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value: Any) -> Any:
        if value is None:
            return []
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list):
            return [s for s in value if s != ""]  # an empty stop string would match at once
        return value

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: list[str]) -> list[str]:
        if len(value) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop strings, got {len(value)}")
        longest = max((len(s) for s in value), default=0)
        if longest > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters, got one of {longest}")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (value or {}).items():
            if not (token.isascii() and token.isdigit()):
                raise ValueError(f"keys are token ids, got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"biases lie in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias} for {token}")
        return value

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not all(word.strip() for word in value):
            raise ValueError("a bad word is empty")
        return value

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate_prompt_tokens(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("keeps at least one token (-1: as many as the context holds)")
        return value

    @field_validator("speculation", mode="before")
    @classmethod
    def _speculation(cls, value: Any) -> Any:
        return {} if value is None else value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def num_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; n: each token's and its position's n likeliest."""
        return None

    @property
    def echoes(self) -> bool:
        """Whether the response repeats the prompt ahead of the output (completions' `echo`)."""
        return False

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}


class CompletionRequest(GenerationRequestBase):
    max_tokens: int | None = Field(None, ge=0, description="tokens to generate (default: the engine's); 0, with "
                                                          "echo or prompt_logprobs: the prompt scored, nothing "
                                                          "generated")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="the prompt, used as is (no chat template): a text, token ids, or a list of either "
                    "(each prompt gets `n` choices, indexed prompt by prompt)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="each token's logprob and this many likeliest at its position")
    echo: bool | None = Field(None, description="the prompt ahead of the completion (with logprobs: its tokens' too)")
    suffix: str | None = None
    best_of: int | None = None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def echoes(self) -> bool:
        return bool(self.echo)

    @field_validator("suffix", "best_of")
    @classmethod
    def _unsupported_here(cls, value: Any, info: ValidationInfo) -> Any:
        return _no_op(value, info)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, value: Any) -> Any:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list holds no prompt")
            ids = [t for p in value if isinstance(p, list) for t in p]  # a list of token id lists
            ids += [t for t in value if not isinstance(t, (str, list))]  # one token id list
            if any(isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in ids):
                raise ValueError("token ids are integers >= 0")
        return value

    @field_validator("prompt")
    @classmethod
    def _prompt_count(cls, value: Any, info: ValidationInfo) -> Any:
        n = info.data.get("n") or 1
        if isinstance(value, list) and value and isinstance(value[0], (str, list)) and len(value) * n > MAX_SEQUENCES:
            raise ValueError(f"{len(value)} prompts of n = {n} choices each: at most {MAX_SEQUENCES} in all")
        return value

    @property
    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls, as they were answered")
    tool_call_id: str | None = Field(None, description="the call a tool message answers")
    name: str | None = None  # OpenAI's, not read
    refusal: str | None = None  # OpenAI's, not read
    # an assistant's earlier thinking, as a reasoning parser answered it (`reasoning_content`: the
    # older name); templates that show it read `reasoning_content`
    reasoning: str | None = None
    reasoning_content: str | None = None

    def as_template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (Hugging Face's convention: a call's arguments
        as an object, where they parse)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _json_or_text(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if (reasoning := self.reasoning or self.reasoning_content) is not None:
            out["reasoning_content"] = reasoning
        return out


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# apply_chat_template's own arguments: the request's other fields set them
_TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                                 "add_generation_prompt", "continue_final_message", "return_dict",
                                 "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
                                 "max_length", "return_tensors"})


def _template_variables(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value and (taken := sorted(_TEMPLATE_ARGUMENTS & set(value))):
        raise ValueError(f"{', '.join(taken)}: set by the request's own fields, not a template variable")
    return value


def _continues_without_generation_prompt(value: bool, info: ValidationInfo) -> bool:
    """`continue_final_message` leaves the last message open: the template must not open another."""
    if value and info.data.get("add_generation_prompt"):
        raise ValueError("continues the last message, so the template must not open another: "
                         "send add_generation_prompt: false")
    return value


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (null: none)")
    strict: bool | None = Field(None, description="the arguments always match the schema here, strict or not")


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(GenerationRequestBase):
    _tool_call_parser: ToolCallParser = PrivateAttr("generic")  # the server's (`use_tool_call_parser`)
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    parallel_tool_calls: bool | None = None
    reasoning_effort: str | None = Field(None, description="the chat template's variable `reasoning_effort` (as "
                                                           "transformers' gpt-oss template reads it), unless "
                                                           "chat_template_kwargs set it")
    logprobs: bool | None = Field(None, description="return each output token's logprob")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                     description="and this many likeliest tokens at its position")
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, validate_default=True,
        description='"auto" (the default with tools: calls or an answer), "required" or a named function: calls '
                    'decoded under their schemas; "none": an answer')
    # extensions, as in vLLM: an assistant message started by the client and continued
    add_generation_prompt: bool = Field(True, description="extension: open the assistant's message after the "
                                                          "chat (the template's generation prompt)")
    continue_final_message: bool = Field(
        False, description="extension: leave the last message open and continue it (an assistant message the "
                           "client started); needs add_generation_prompt: false")
    echo: bool = Field(False, description="extension: the answer's content starts with the last message's, "
                                          "when that message is the assistant's")
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension: more variables for the chat template (e.g. Qwen3's enable_thinking: false)")
    include_reasoning: bool = Field(True, description="extension: answer a reasoning model's thinking as "
                                                      "`reasoning` (false: leave it out)")
    # OpenAI's chat fields that do not change the output here: accepted and ignored (one verbosity
    # here; the prefix cache is this server's own, cache_salt bounds it)
    verbosity: Literal["low", "medium", "high"] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None

    @field_validator("functions", "function_call", "modalities", "audio", "web_search_options", "moderation")
    @classmethod
    def _unsupported_here(cls, value: Any, info: ValidationInfo) -> Any:
        return _no_op(value, info)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, value: Any, info: ValidationInfo) -> Any:
        names = [t.function.name for t in info.data.get("tools") or []]
        if value == "required" and not names:
            raise ValueError('"required" needs tools')
        if isinstance(value, NamedToolChoice) and value.function.name not in names:
            raise ValueError(f"no tool is named {value.function.name!r} (tools: {', '.join(names) or 'none'})")
        calls = bool(names) and value != "none"
        formats = (info.data.get("structured_outputs"), info.data.get("response_format"))
        if calls and (formats[0] is not None or formats[1] not in (None, ResponseFormat(type="text"))):
            raise ValueError("tool calls have their own format: send it without response_format or structured_outputs")
        if calls and (error := format_error(cls._tool_calls(info.data.get("tools"), value, True).output_format)):
            raise ValueError(f"a tool's parameters do not compile: {error.strip()}")
        return value

    @staticmethod
    def _tool_calls(tools: list[Tool] | None, choice: Any, parallel: bool) -> ToolChoice | None:
        if not tools or choice == "none":
            return None
        schemas = {t.function.name: t.function.parameters or NO_PARAMETERS for t in tools}
        if isinstance(choice, NamedToolChoice):
            return ToolChoice(schemas, choice.function.name, parallel)
        return ToolChoice(schemas, None, parallel, auto=choice != "required")

    @property
    def tool_calls(self) -> ToolChoice | None:
        """The calls the request asks for, decoded under their schemas, written as the target's
        parser reads them; None: an ordinary answer."""
        calls = self._tool_calls(self.tools, self.tool_choice, self.parallel_tool_calls is not False)
        return None if calls is None else replace(calls, parser=self._tool_call_parser)

    def use_tool_call_parser(self, parser: ToolCallParser) -> ChatCompletionRequest:
        """Set how the served target writes tool calls (`target.tool_call_parser`); the server's
        setting, not the client's."""
        self._tool_call_parser = parser
        return self

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def output_format(self) -> OutputFormat | None:
        calls = self.tool_calls
        return calls.output_format if calls is not None else super().output_format

    @field_validator("continue_final_message")
    @classmethod
    def _continue_final_message(cls, value: bool, info: ValidationInfo) -> bool:
        return _continues_without_generation_prompt(value, info)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _chat_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables(value)

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    @field_validator("echo")
    @classmethod
    def _echo(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("tools") and info.data.get("tool_choice") != "none":
            raise ValueError("echoes text, and tool calls are not text: send it without tools or with "
                             'tool_choice "none"')
        return value

    @property
    def generation_prompt(self) -> bool:
        return self.add_generation_prompt

    @property
    def continues_last_message(self) -> bool:
        return self.continue_final_message

    @property
    def echoed(self) -> str:
        """What the answer's content starts with: the last message's, where `echo` asks and it is
        the assistant's."""
        last = self.messages[-1]
        return last.as_template_message()["content"] if self.echo and last.role == "assistant" else ""

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return value

    @property
    def num_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a raw prompt, or chat messages as /v1/chat/completions renders them."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, validate_default=True)
    add_special_tokens: bool | None = Field(
        None, description="a raw prompt: the tokenizer's special tokens, as /v1/completions adds them (default "
                          "true); messages: false only, the chat template writes them")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = Field(False, description="each token as the vocabulary spells it")

    @field_validator("messages")
    @classmethod
    def _one_prompt(cls, value: list[ChatMessage] | None, info: ValidationInfo) -> list[ChatMessage] | None:
        if (value is None) == (info.data.get("prompt") is None):
            raise ValueError("give a prompt or messages, one of them")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _chat_template_kwargs(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _template_variables(value)

    @field_validator("add_special_tokens")
    @classmethod
    def _special_tokens(cls, value: bool | None, info: ValidationInfo) -> bool | None:
        if value and info.data.get("messages") is not None:
            raise ValueError("the chat template writes the special tokens: true only with a prompt")
        return value

    @field_validator("continue_final_message")
    @classmethod
    def _continue_final_message(cls, value: bool, info: ValidationInfo) -> bool:
        return _continues_without_generation_prompt(value, info)


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# -- responses -------------------------------------------------------------------------------
class CompletionTokensDetails(BaseModel):
    """Where a request predicted its output: predicted tokens drafted and accepted as output, and
    drafted but rejected by verification (computed, not emitted); where a reasoning model thought,
    the tokens of its thinking."""

    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    reasoning_tokens: int = 0


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens found in the prefix cache, not prefilled (workers/prefix.py)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None  # with a `prediction` or thinking only


class ContextSpanInfo(BaseModel):
    """The steps a request ran in one context bucket; a long request crosses several."""

    bucket: str  # "0-512", "512-1k", "1k-2k", "2k-4k" or "4k+": tokens before the step
    num_steps: int
    num_tokens: int  # completion tokens emitted in the bucket
    num_draft_tokens: int
    num_accepted_tokens: int


class SpeculationInfo(BaseModel):
    """What ran for one request: the shape of vLLM's per-request speculative-decoding metrics plus
    the routing decision."""

    domain: str | None = None  # from the request, a policy rule, the classifier or the default
    policy_version: str | None = None  # the routing policy that planned the request
    reason: str | None = None  # why the plan: best, explore, fallback, policy or forced
    drafter: str  # the plan's drafter ("none": plain decoding)
    draft_len: int  # the plan's k (0 for plain decoding)
    schedule: list[list[str | int]] = []  # [drafter, k, steps]: what each run of steps asked
    fallbacks: list[str] = []  # the reason of each switch to plain decoding
    context: list[ContextSpanInfo] = []  # the steps per context bucket, in the order crossed
    drafters: list[str]  # drafters that actually proposed, in order of first use
    num_steps: int  # target forwards
    num_draft_tokens: int
    num_accepted_tokens: int
    mean_acceptance_length: float  # tokens per target forward, bonus included
    acceptance_histogram: list[int]  # drafts accepted at position i, summed over steps
    fallback_reason: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]

    @classmethod
    def of(cls, entry: Logprob, as_ids: bool = False) -> TopLogprob:
        """`as_ids`: the token as "token_id:N" (vLLM's return_tokens_as_token_ids), its bytes that text's."""
        if as_ids:
            token = token_as_id(entry.token_id)
            return cls(token=token, logprob=entry.logprob, bytes=list(token.encode()))
        return cls(token=entry.token, logprob=entry.logprob, bytes=list(entry.bytes))


def token_as_id(token_id: int) -> str:
    """A token written as its id, where text would be ambiguous (vLLM's return_tokens_as_token_ids)."""
    return f"token_id:{token_id}"


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]  # the position's likeliest tokens, largest first


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]
    refusal: None = None

    @classmethod
    def of(cls, entries: list[TokenLogprobs], as_ids: bool = False) -> ChatLogprobs:
        return cls(content=[
            ChatTokenLogprob(**TopLogprob.of(e.chosen, as_ids).model_dump(),
                             top_logprobs=[TopLogprob.of(t, as_ids) for t in e.top])
            for e in entries
        ])


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]  # None: an echoed prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]  # the likeliest tokens and the chosen one
    text_offset: list[int]  # where each token's text starts in the completion (echoed: in prompt + completion)

    @classmethod
    def of(cls, entries: list[TokenLogprobs], offset: int = 0, as_ids: bool = False) -> CompletionLogprobs:
        """`offset`: where the first token's text starts (a stream's later chunk); `as_ids`: tokens
        as "token_id:N" (the offsets stay those of the text)."""
        starts = [offset]
        for e in entries[:-1]:
            starts.append(starts[-1] + len(e.chosen.token))

        def name(entry: Logprob) -> str:
            return token_as_id(entry.token_id) if as_ids else entry.token

        return cls(
            tokens=[name(e.chosen) for e in entries],
            token_logprobs=[e.chosen.logprob for e in entries],
            top_logprobs=[None if e.chosen.logprob is None else {name(t): t.logprob for t in (*e.top, e.chosen)}
                          for e in entries],
            text_offset=starts,
        )


class PromptLogprob(BaseModel):
    """vLLM's shape of a prompt token's logprob (`prompt_logprobs`)."""

    logprob: float
    rank: int | None  # 1: the likeliest at its position
    decoded_token: str


# per prompt token (the first, which nothing predicts: None), its logprob and its position's
# likeliest, keyed by token id
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def prompt_logprobs_of(entries: list[TokenLogprobs] | None, as_ids: bool = False) -> PromptLogprobs | None:
    if entries is None:
        return None

    def of(entry: Logprob) -> PromptLogprob:
        assert entry.logprob is not None
        return PromptLogprob(logprob=entry.logprob, rank=entry.rank,
                             decoded_token=token_as_id(entry.token_id) if as_ids else entry.token)

    return [None if e.chosen.logprob is None else {str(t.token_id): of(t) for t in (e.chosen, *e.top)}
            for e in entries]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended the output
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, where the request asked
    # vLLM's return_token_ids: the prompt's (a stream's first chunk) and the output's (a chunk's new ones)
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None


class ToolCallDelta(ToolCall):
    index: int  # which of the choice's calls


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning: str | None = None  # a reasoning model's thinking (target.reasoning_parser)
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_absent_parts(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("reasoning", "tool_calls"):
            if out.get(key) is None:
                out.pop(key, None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended the output
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the output's


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's, where the request asked: one prompt, every choice's
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: one prompt, every choice's


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # on the last chunk, as on ChatChoice
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the chunk's new output tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: on each choice's first chunk


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    speculation: SpeculationInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specroute"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
