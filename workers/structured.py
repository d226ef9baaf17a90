"""Structured outputs: a request's output held to a JSON schema, a regex, a list of choices or a
Lark grammar (OpenAI's `response_format`, vLLM's `structured_outputs`), through llguidance.

A request's `Guide` follows its output through the grammar and says which tokens may come next.
Under speculation every row a step verifies is masked with the grammar's state after the draft
tokens before it (the matcher walks the draft and rolls back), so row r holds exactly the logits
constrained plain decoding would have masked at that position: greedy output equals constrained
plain decoding's, sampled output follows the masked distribution. A draft token the grammar
forbids has probability 0 there, so verification rejects it (a deterministic draft is cut before
it, costing no row; a sampled draft keeps it, since its rejection decides the residual the next
token is drawn from). Rows past it are never read. The end-of-sequence tokens are allowed where
the grammar may end; once it must end the request stops without a forward for the end token.

Torch-free: the ingress validates formats with it; the engine applies the masks.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from workers.reasoning import THINK_CLOSE, THINK_OPEN, ReasoningStart

FormatKind = Literal["json", "regex", "choice", "grammar"]
ANY_JSON_OBJECT = '{"type": "object"}'  # OpenAI's `json_object`
# JSON written as json.dumps writes it: a model writes what it has read, and free whitespace lets a
# small one pad a document with blank lines until max_tokens; a schema's "x-guidance" may say otherwise
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MATCHER_CACHE = 64  # compiled formats kept per engine (a matcher per format, copied per request)


@dataclass(frozen=True)
class OutputFormat:
    """What a request's output must match. `spec`: a JSON schema as JSON text (kind "json"), a
    regex, a JSON list of strings (kind "choice") or a Lark grammar (llguidance's dialect).
    `reasoning`: the format holds the answer after a reasoning model's thinking (workers/reasoning.py),
    which runs free up to its closing tag; None: the whole output."""

    kind: FormatKind
    spec: str
    reasoning: ReasoningStart | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | None = None) -> OutputFormat:
        """None: any JSON object."""
        return cls("json", ANY_JSON_OBJECT if schema is None else json.dumps(schema))  # key order is the order written

    @classmethod
    def choice(cls, choices: Sequence[str]) -> OutputFormat:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))

    def grammar(self) -> str:
        """The format as an llguidance grammar."""
        answer = self._answer_grammar()
        if self.reasoning is None:
            return answer
        # the answer's grammar as a named subgrammar, after thinking that ends at its first closing tag
        grammars = json.loads(answer)["grammars"] if answer.startswith("{") else [{"lark_grammar": answer}]
        think = "reasoning SPACE" if self.reasoning == "open" else f"({json.dumps(THINK_OPEN)} reasoning SPACE)?"
        top = (f"start: {think} answer\n"
               f"reasoning[lazy]: THOUGHT\nTHOUGHT: /(?s:.*)/ {json.dumps(THINK_CLOSE)}\n"
               "SPACE: /[ \\t\\n]*/\n"
               "answer: @answer\n")
        return json.dumps({"grammars": [{"lark_grammar": top}, {**grammars[0], "name": "answer"}, *grammars[1:]]})

    def _answer_grammar(self) -> str:
        if self.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(self.spec, defaults=JSON_STYLE)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":  # Lark string literals take JSON's escapes
            choices = json.loads(self.spec)
            if not choices:
                raise ValueError("an empty list of choices matches no output")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices))
        return llguidance.LLMatcher.grammar_from_lark(self.spec)


def format_error(fmt: OutputFormat, tokenizer: llguidance.LLTokenizer | None = None) -> str | None:
    """Why `fmt` cannot constrain an output (an invalid schema, regex or grammar), or None."""
    try:
        message = llguidance.LLMatcher.validate_grammar(fmt.grammar(), tokenizer)
    except Exception as e:  # whatever a client's format makes the compiler raise is the format's fault
        return str(e) or type(e).__name__
    return message or None


class Grammars:
    """The engine's structured-output support: its tokenizer as llguidance reads it (built once,
    ~0.3 s) and a matcher per format seen recently, copied for each request that asks for it."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._matcher = functools.lru_cache(maxsize=MATCHER_CACHE)(self._compile)

    def check(self, fmt: OutputFormat) -> None:
        """Raise ValueError naming what is wrong with `fmt` for this tokenizer."""
        self._matcher(fmt)

    def guide(self, fmt: OutputFormat, stop_ids: Iterable[int]) -> Guide:
        """A fresh guide over `fmt` for one request that stops at `stop_ids`."""
        return Guide(self._matcher(fmt).deep_copy(), self.vocab_size, stop_ids)

    def _compile(self, fmt: OutputFormat) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, fmt.grammar(), log_level=0)
        except Exception as e:  # as in format_error: what a client's format makes the compiler raise
            raise ValueError(str(e) or type(e).__name__) from None
        if matcher.is_error():  # a grammar the matcher refuses: its message, as validate_grammar's
            raise ValueError(matcher.get_error())
        return matcher


class Guide:
    """One request's place in its grammar. The output's tokens go in through `advance`; stop
    tokens end the request and are not part of the grammar's text."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, stop_ids: Iterable[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = np.fromiter(sorted(set(stop_ids)), dtype=np.int64)
        self._stop_set = frozenset(self.stop_ids.tolist())

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no more text: only an end token could come next."""
        return self.matcher.is_stopped()

    def forced(self) -> list[int]:
        """The tokens the grammar forces from here (none where it leaves a choice), tokenized as the
        tokenizer would, short of a last token that could merge with the free text after it."""
        return self.matcher.compute_ff_tokens()

    def advance(self, token_id: int) -> None:
        """The output grew by `token_id`, which the last mask allowed."""
        if token_id not in self._stop_set and not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar refused token {token_id}: {self.matcher.get_error()}")

    def valid_prefix(self, draft_ids: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows from here (the state is unchanged)."""
        return self.matcher.validate_tokens(list(draft_ids)) if len(draft_ids) else 0

    def masks(self, draft_ids: Sequence[int]) -> np.ndarray:
        """[k + 1, vocab] bool: the tokens allowed at each row of a step verifying `draft_ids` (row r
        after the first r draft tokens). Rows after the first forbidden draft token, or after a stop
        token, are all True: verification never reaches them. The state is unchanged."""
        rows = len(draft_ids) + 1
        bits = allocate_token_bitmask(rows, self.vocab_size)
        allowed = np.ones((rows, self.vocab_size), dtype=bool)
        consumed = 0
        for r in range(rows):
            fill_next_token_bitmask(self.matcher, bits, r)
            allowed[r] = self._unpack(bits[r])
            if r == rows - 1:
                break
            token = int(draft_ids[r])
            if not allowed[r, token] or token in self._stop_set or not self.matcher.consume_token(token):
                break
            consumed += 1
        if consumed:
            self.matcher.rollback(consumed)
        return allowed

    def allowed(self) -> np.ndarray:
        """[vocab] bool: the tokens allowed next."""
        return self.masks(())[0]

    def _unpack(self, words: np.ndarray) -> np.ndarray:
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_accepting():  # the text may end here: with any of the request's stop tokens
            allowed[self.stop_ids[self.stop_ids < self.vocab_size]] = True
        if not allowed.any():  # a grammar in error allows nothing: end the request rather than draw from nothing
            allowed[self.stop_ids[self.stop_ids < self.vocab_size]] = True
        return allowed
