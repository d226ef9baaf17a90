"""An incremental n-gram index over a growing token sequence: where each n-gram occurred, so a
drafter can read what followed it. Prompt lookup reads the latest occurrence of the longest
match (workers/drafters/ngram.py); suffix decoding reads them all, over the request and over
past outputs (workers/drafters/suffix.py). Adding a token enters one position per n, so lookups
cost the same whatever the sequence's length.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

SEPARATOR = -1  # ends each request in a domain's index, so no match or continuation spans two


class TokenIndex:
    """A growing token sequence and, for each n-gram of min_n..max_n tokens in it, the positions
    right after its occurrences (where a continuation starts), oldest first. Positions are absolute:
    `evict` drops a prefix without renumbering the rest."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens: list[int] = []
        self.start = 0  # absolute position of tokens[0]
        self.after: dict[tuple[int, ...], list[int]] = {}

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, pos: int) -> int:
        """The token at absolute `pos`; SEPARATOR past the end."""
        i = pos - self.start
        return self.tokens[i] if i < len(self.tokens) else SEPARATOR

    def extend(self, ids: Sequence[int]) -> None:
        first = self.end
        self.tokens.extend(ids)
        for j in range(max(first, self.start + 1), self.end):
            if self.at(j) == SEPARATOR:
                continue
            for n in range(self.min_n, self.max_n + 1):
                if (i := j - n - self.start) < 0:
                    break
                key = tuple(self.tokens[i : i + n])
                if SEPARATOR in key:
                    break  # longer n-grams reach further back across it too
                self.after.setdefault(key, []).append(j)

    def evict(self, before: int) -> None:
        """Forget every token before absolute position `before` and the positions that read them."""
        gone = self.tokens[: before - self.start]
        for i in range(len(gone)):
            for n in range(self.min_n, self.max_n + 1):
                key = tuple(gone[i : i + n])
                if len(key) < n:
                    break
                if (positions := self.after.get(key)) is not None:
                    del positions[: bisect.bisect_left(positions, before + 1)]
                    if not positions:
                        del self.after[key]
        del self.tokens[: before - self.start]
        self.start = before

    def occurrences(self, context: Sequence[int]) -> tuple[int, list[int]]:
        """(n, positions): the longest indexed n-gram that ends `context` and occurs here, and the
        positions after its occurrences, oldest first ((0, []): none occurs)."""
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            if positions := self.after.get(tuple(context[-n:])):
                return n, positions
        return 0, []

    def matches(self, context: Sequence[int], max_depth: int, max_occurrences: int) -> list[Match]:
        """The latest `max_occurrences` places where the longest indexed n-gram ending `context` occurs,
        each with how far back the match goes (at most max_depth tokens), most recent first."""
        n, positions = self.occurrences(context)
        out = []
        for pos in reversed(positions[-max_occurrences:]):
            length = n
            while (length < max_depth and length < len(context) and pos - length - 1 >= self.start
                   and self.at(pos - length - 1) == context[-length - 1]):
                length += 1
            out.append(Match(self, pos, length))
        return out


@dataclass(frozen=True)
class Match:
    index: TokenIndex
    pos: int  # where the continuation starts
    length: int  # tokens matched before it

    def at(self, offset: int) -> int:
        return self.index.at(self.pos + offset)
