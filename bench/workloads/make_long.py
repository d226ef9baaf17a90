"""Write long.jsonl: tasks over long documents, 1k to 7k tokens of context.

    python -m bench.workloads.make_long   # rewrites bench/workloads/long.jsonl

The documents are public texts that ship on every Debian machine and with CPython: the licences
in /usr/share/common-licenses and Python's own LICENSE.txt (its history of Python included).
None of them is in Spec-Bench or in the drafters' training data. Each line is one request: a
document cut at a paragraph boundary so that the whole chat prompt is close to its bucket's size
(category: "1k", "2k", "4k", "7k"), then one of four tasks (summarise, answer a question over,
translate part of, extract from). Sizes are counted with the default target's tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from transformers import AutoTokenizer

from workers.config import TargetConfig
from workers.target import resolve_source

OUT = Path(__file__).with_name("long.jsonl")
LICENSES = Path("/usr/share/common-licenses")
DOCUMENTS = [
    LICENSES / "GPL-3", LICENSES / "LGPL-2.1", LICENSES / "MPL-2.0", LICENSES / "Apache-2.0",
    LICENSES / "GFDL-1.3", LICENSES / "GPL-2", LICENSES / "MPL-1.1", Path(sys.base_prefix) / "lib"
    / f"python{sys.version_info.major}.{sys.version_info.minor}" / "LICENSE.txt",
]
SIZES = {"1k": 1000, "2k": 2000, "4k": 4000, "7k": 7000}  # prompt tokens, chat template included
TASKS = {
    "summarize": "Summarise the document above in five sentences.",
    "qa": "According to the document above, what must someone who distributes the work do? Answer in a short "
          "paragraph and quote the sentence that says so.",
    "translate": "Translate the last paragraph of the document above into French.",
    "extract": "List the terms the document above defines (for example \"the Program\" or \"Licensor\") as a JSON "
               "array of strings, each with a one-line definition taken from the document.",
}
PROMPT = "Read this document.\n\n<document>\n{document}\n</document>\n\n{task}"


def paragraphs(start: int) -> list[str]:
    """The documents' paragraphs from document `start` on, round the list: as many as needed."""
    out: list[str] = []
    for i in range(len(DOCUMENTS)):
        text = DOCUMENTS[(start + i) % len(DOCUMENTS)].read_text(encoding="utf-8", errors="replace")
        out += [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return out


def build(tokenizer: object, size: int, task: str, start: int) -> str:
    """The longest prompt of whole paragraphs that stays within `size` chat tokens."""

    def length(document: str) -> int:
        messages = [{"role": "user", "content": PROMPT.format(document=document, task=task)}]
        return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,  # type: ignore[attr-defined]
                                                 return_dict=False))

    kept: list[str] = []
    for paragraph in paragraphs(start):
        if length("\n\n".join([*kept, paragraph])) > size:
            break
        kept.append(paragraph)
    return PROMPT.format(document="\n\n".join(kept), task=task)


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_source(TargetConfig()))
    lines = []
    for b, (bucket, size) in enumerate(SIZES.items()):
        for t, (name, task) in enumerate(TASKS.items()):
            prompt = build(tokenizer, size, task, start=b + 2 * t)  # another document per task and bucket
            lines.append(json.dumps({"question_id": f"{bucket}-{name}", "category": bucket, "turns": [prompt]}))
    OUT.write_text("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} requests to {OUT}")


if __name__ == "__main__":
    main()
