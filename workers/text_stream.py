"""What of a growing output's text can be streamed: the serving path's chunks and the CLI's
printout hold back the same tails."""

from __future__ import annotations


def stream_delta(text: str, sent: str, stop: tuple[str, ...]) -> str:
    """The part of `text` after `sent` that can be streamed now: hold back a trailing incomplete
    character (U+FFFD) and the longest suffix that may still grow into a stop string."""
    end = len(text.rstrip("\ufffd"))
    end -= max((n for s in stop for n in range(1, len(s)) if text.endswith(s[:n], 0, end)), default=0)
    if end <= len(sent) or not text.startswith(sent):
        return ""
    return text[len(sent) : end]
