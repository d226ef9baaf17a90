"""The training corpus of a drafter: public text on this machine, disjoint from the held-out benchmark split.

Sources, named in a comma list (`--data stdlib,pydoc,chat:answers.jsonl`):
  * `stdlib`: the Python standard library's own source files (code), tests and site-packages skipped;
  * `pydoc`: `pydoc_data.topics` (the Python documentation's topics: English prose about code);
  * `chat:PATH`: a JSONL of `{"prompt", "answer"}` pairs rendered through the tokenizer's chat
    template, so the chat format the target serves in is covered too. A prompt of Spec-Bench's
    HELD-OUT split (any turn of a question with question_id % 5 == 0, `policies.classifier.is_heldout`)
    is refused: the split every drafter and the classifier are measured on must stay unseen. The
    train split's prompts (e.g. answered by `specroute gen-answers`) are allowed.

A source may carry a weight, `NAME*W` (e.g. `stdlib,pydoc,chat:answers.jsonl*4`; default 1).

The corpus is deterministic: files and topics are listed sorted, then shuffled with the seed, and
sources are drawn token-balanced by weight (the source with the fewest tokens per unit of weight
so far gives the next document; a source that runs out leaves the rest to the others) until
`max_tokens`. Source files are capped at `DOC_TOKEN_CAP` tokens so a few long
modules cannot dominate; documentation topics and chat exchanges are kept whole. Nothing here imports torch.
"""

from __future__ import annotations

import json
import os
import random
import re
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from policies.classifier import is_heldout

SPEC_BENCH = Path(__file__).resolve().parents[2] / "shared" / "data" / "spec_bench" / "question.jsonl"
DOC_TOKEN_CAP = 4096
SOURCE_KINDS = ("stdlib", "pydoc", "chat")
HELDOUT_MOD = 5  # Spec-Bench's held-out split: question_id % 5 == 0 (bench --heldout-mod 5)
# directories of the standard library that hold tests or third-party code
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


class CorpusError(ValueError):
    """A bad --data specification or source file; the message names the source."""


@dataclass(frozen=True)
class Source:
    kind: str  # one of SOURCE_KINDS
    path: Path | None = None  # chat only
    weight: float = 1.0  # share of the token-balanced draw (`NAME*W`)

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.path}" if self.path is not None else self.kind


def parse_sources(spec: str) -> list[Source]:
    """`stdlib,pydoc,chat:PATH` (each optionally `*W`) -> sources, checked (a chat file must exist)."""
    sources: list[Source] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        weight = 1.0
        if "*" in item:
            item, _, w = item.rpartition("*")
            try:
                weight = float(w)
            except ValueError:
                weight = -1.0
            if not weight > 0 or weight == float("inf"):
                raise CorpusError(f"--data: the weight of {item!r} must be a positive number, got {w!r}")
        kind, sep, rest = item.partition(":")
        if kind not in SOURCE_KINDS:
            raise CorpusError(f"--data: unknown source {item!r}; sources: stdlib, pydoc, chat:PATH.jsonl")
        if kind == "chat":
            if not sep or not rest:
                raise CorpusError("--data: chat needs a file: chat:PATH.jsonl")
            path = Path(rest).expanduser()
            if not path.is_file():
                raise CorpusError(f"--data: no chat file {path}")
            source = Source("chat", path, weight)
        elif sep:
            raise CorpusError(f"--data: source {kind!r} takes no argument (got {item!r})")
        else:
            source = Source(kind, weight=weight)
        if source.label in {s.label for s in sources}:
            raise CorpusError(f"--data: source {source.label!r} is named twice")
        sources.append(source)
    if not sources:
        raise CorpusError("--data is empty; sources: stdlib, pydoc, chat:PATH.jsonl")
    return sources


def stdlib_files(root: Path | None = None) -> list[Path]:
    """The standard library's .py files, sorted, without tests and site-packages."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]  # pruned: site-packages is not even listed
        files += [Path(folder) / n for n in names
                  if n.endswith(".py") and not n.startswith("test_") and not n.endswith("_test.py")]
    return sorted(files)


def _normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


def spec_bench_prompts(path: Path = SPEC_BENCH, heldout_mod: int = HELDOUT_MOD) -> frozenset[str]:
    """Every turn of Spec-Bench's held-out questions (question_id % heldout_mod == 0), normalized;
    empty when the benchmark is not on this machine. A question_id that is not an integer cannot
    be placed in a split, so its turns count as held out too."""
    if not path.is_file():
        return frozenset()
    turns = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            q = json.loads(line)
            try:
                qid = int(q.get("question_id"))
            except (TypeError, ValueError):
                qid = None
            if qid is None or is_heldout(qid, heldout_mod):
                turns.update(_normalize(t) for t in q.get("turns", []))
    return frozenset(turns)


def read_chat_pairs(path: Path, banned: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a JSONL file, in file order; errors name path:line."""
    pairs = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise CorpusError(f"cannot read chat file {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CorpusError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) and row[k] for k in ("prompt", "answer")):
            raise CorpusError(f"{path}:{n}: expected an object with non-empty string fields 'prompt' and 'answer'")
        if _normalize(row["prompt"]) in banned:
            raise CorpusError(f"{path}:{n}: the prompt is a held-out Spec-Bench prompt (question_id % {HELDOUT_MOD} "
                              "== 0); drafters never train on the split they are measured on")
        pairs.append((row["prompt"], row["answer"]))
    if not pairs:
        raise CorpusError(f"chat file {path} has no pairs")
    return pairs


def render_chat(tokenizer: Any, prompt: str, answer: str) -> str:
    """One exchange as the target sees it when serving (its chat template, default system prompt)."""
    messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return f"{prompt}\n{answer}"


def _texts(source: Source, tokenizer: Any, seed: int) -> Iterator[str]:
    """A source's documents in a seeded, reproducible order, read lazily."""
    rng = random.Random(f"{seed}:{source.label}")
    if source.kind == "stdlib":
        files = stdlib_files()
        rng.shuffle(files)
        for path in files:
            try:
                yield path.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
    elif source.kind == "pydoc":
        from pydoc_data.topics import topics

        keys = sorted(topics)
        rng.shuffle(keys)
        yield from (topics[k] for k in keys)
    else:
        assert source.path is not None
        pairs = read_chat_pairs(source.path, spec_bench_prompts())
        rng.shuffle(pairs)
        yield from (render_chat(tokenizer, p, a) for p, a in pairs)


@dataclass
class Corpus:
    documents: list[list[int]]  # token ids
    stats: dict[str, dict[str, int]] = field(default_factory=dict)  # label -> {"documents", "tokens"}

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.documents)


def build_corpus(sources: list[Source], tokenizer: Any, max_tokens: int, seed: int = 0) -> Corpus:
    """Token-balanced draw over the sources until max_tokens (the last document is cut)."""
    streams = {s.label: _texts(s, tokenizer, seed) for s in sources}
    taken = {s.label: 0 for s in sources}
    weight = {s.label: s.weight for s in sources}
    corpus = Corpus([], {s.label: {"documents": 0, "tokens": 0} for s in sources})
    total = 0
    while streams and max_tokens - total >= 2:  # a document needs a pair: two tokens
        label = min(streams, key=lambda k: taken[k] / weight[k])  # dicts keep the --data order for ties
        text = next(streams[label], None)
        if text is None:
            del streams[label]
            continue
        cap = DOC_TOKEN_CAP if label == "stdlib" else max_tokens
        # a token is rarely under 1/8 of the text's characters: no need to tokenize a huge file whole
        ids = tokenizer(text[: 8 * cap], add_special_tokens=False, verbose=False)["input_ids"]
        ids = ids[: min(cap, max_tokens - total)]
        if len(ids) < 2:
            continue
        corpus.documents.append(ids)
        taken[label] += len(ids)
        total += len(ids)
        corpus.stats[label]["documents"] += 1
        corpus.stats[label]["tokens"] += len(ids)
    return corpus
