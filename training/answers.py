"""Chat data in the target's own words (`specroute gen-answers`): its answers to prompts.

EAGLE learns to predict the target's features on text the target itself would write, so the chat
source of a drafter's corpus is best the target's own answers. Prompts come from JSONL files of
either shape:
  * Spec-Bench questions (`question_id`, `category`, `turns`): the first turn, and only of the
    TRAIN split; a question with question_id % heldout_mod == 0 is held out and skipped;
  * `{"prompt": ...}` lines (optional `id`, `category`): any prompt that is not a held-out
    Spec-Bench prompt (that one is refused, naming the line).
Answers are generated in batches through transformers (left padding), each prompt wrapped in the
target's chat template as the engine does when serving, cut at the first end-of-sequence token.
Greedy by default (one answer per prompt: the text greedy serving visits); with `temperature > 0`,
`samples` answers per prompt drawn from the target's own distribution, which multiplies the chat
data a fixed set of prompts gives (a distilled drafter learns the target's whole next-token
distribution at every position, so sampled text teaches it as much as greedy text). The output is
`{"prompt", "answer", "id", "category", "sample", "num_tokens", "finish_reason"}` per line, written
as each batch finishes; an existing output is continued ((prompt, sample) pairs already answered are
skipped), so an interrupted run resumes (a resumed sampling run draws other samples than an
uninterrupted one would: batches are seeded by their position in the run).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.classifier import is_heldout
from training.corpus import HELDOUT_MOD, SPEC_BENCH, CorpusError, _normalize, spec_bench_prompts


@dataclass(frozen=True)
class PromptRow:
    id: str
    category: str
    prompt: str


def read_prompts(paths: Sequence[Path], heldout_mod: int = HELDOUT_MOD, limit: int | None = None,
                 spec_bench: Path = SPEC_BENCH) -> tuple[list[PromptRow], int]:
    """(prompts, number of held-out Spec-Bench questions skipped), in file order, duplicates dropped."""
    banned = spec_bench_prompts(spec_bench, heldout_mod)
    rows: list[PromptRow] = []
    seen: set[str] = set()
    skipped = 0
    for path in paths:
        try:
            lines = Path(path).read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise CorpusError(f"cannot read prompts file {path}: {e}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise CorpusError(f"{path}:{n}: not JSON ({e.msg})") from None
            if isinstance(obj, dict) and "turns" in obj and "question_id" in obj:
                try:
                    qid = int(obj["question_id"])
                except (TypeError, ValueError):
                    qid = None
                if qid is None or is_heldout(qid, heldout_mod):
                    skipped += 1  # held out (or unsplittable): never answered, never trained on
                    continue
                turns = obj["turns"]
                if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                    raise CorpusError(f"{path}:{n}: a Spec-Bench question needs a list of string turns")
                row = PromptRow(f"spec-bench-{qid}", str(obj.get("category", "")), turns[0])
            elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
                row = PromptRow(str(obj.get("id", f"{Path(path).name}:{n}")), str(obj.get("category", "")),
                                obj["prompt"])
            else:
                raise CorpusError(f"{path}:{n}: expected a Spec-Bench question (question_id, turns) "
                                  "or an object with a non-empty string 'prompt'")
            if _normalize(row.prompt) in banned:
                raise CorpusError(f"{path}:{n}: the prompt is a held-out Spec-Bench prompt "
                                  f"(question_id % {heldout_mod} == 0); drafters never train on it")
            if row.prompt in seen:
                continue
            seen.add(row.prompt)
            rows.append(row)
    if limit is not None:
        rows = rows[:limit]
    return rows, skipped


def done_prompts(out: Path) -> set[tuple[str, int]]:
    """(prompt, sample) pairs already answered in an existing output (a resumed run skips them)."""
    if not out.is_file():
        return set()
    done = set()
    for line in out.read_text(encoding="utf-8").splitlines():
        if line.strip():
            try:
                row = json.loads(line)
                done.add((row["prompt"], int(row.get("sample", 0))))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                continue  # a line cut by an interruption: answered again
    return done


def check_sampling(temperature: float, samples: int) -> None:
    """Settings gen-answers can honour: greedy (temperature 0) gives one answer per prompt."""
    if temperature < 0:
        raise CorpusError(f"--temperature must be >= 0, got {temperature}")
    if samples < 1:
        raise CorpusError(f"--samples must be at least 1, got {samples}")
    if samples > 1 and temperature == 0:
        raise CorpusError("--samples above 1 needs --temperature > 0 (greedy answers to one prompt are all the same)")


def generate_answers(
    model: Any, tokenizer: Any, rows: Sequence[PromptRow], out: Path, *, max_tokens: int = 256, batch: int = 8,
    max_prompt_tokens: int = 1024, temperature: float = 0.0, samples: int = 1, seed: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Answers of `model` to `rows` (greedy, or `samples` each at `temperature`), appended to `out`
    batch by batch. Prompts are sorted by length so a batch pads little; a prompt over
    max_prompt_tokens is skipped."""
    import torch
    from transformers import GenerationConfig

    from workers.target import eos_token_ids

    check_sampling(temperature, samples)
    done = done_prompts(out)
    encoded = []
    too_long = 0
    for row in rows:
        todo = [i for i in range(samples) if (row.prompt, i) not in done]
        if not todo:
            continue
        messages = [{"role": "user", "content": row.prompt}]
        if getattr(tokenizer, "chat_template", None):
            ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        else:
            ids = tokenizer.encode(row.prompt)
        if len(ids) > max_prompt_tokens:
            too_long += 1
            continue
        encoded += [(row, i, ids) for i in todo]
    encoded.sort(key=lambda r: len(r[2]))
    eos = sorted(eos_token_ids(model.generation_config, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else \
        {"do_sample": False}  # no top-k / top-p truncation: only the temperature reshapes the target's distribution
    config = GenerationConfig(max_new_tokens=max_tokens, eos_token_id=eos, pad_token_id=pad, **sampling)
    out.parent.mkdir(parents=True, exist_ok=True)
    start, tokens, written = time.perf_counter(), 0, 0
    with out.open("a", encoding="utf-8") as f:
        for b in range(0, len(encoded), batch):
            part = encoded[b : b + batch]
            width = max(len(ids) for _, _, ids in part)
            input_ids = torch.full((len(part), width), pad, dtype=torch.long)
            mask = torch.zeros((len(part), width), dtype=torch.long)
            for i, (_, _, ids) in enumerate(part):  # left padding: every prompt ends at the last column
                input_ids[i, width - len(ids):] = torch.tensor(ids)
                mask[i, width - len(ids):] = 1
            if temperature > 0:
                torch.manual_seed(seed * 1_000_003 + b)  # sampling draws from torch's global generator
            with torch.no_grad():
                gen = model.generate(input_ids.to(model.device), attention_mask=mask.to(model.device),
                                     generation_config=config)
            for (row, sample, _), seq in zip(part, gen[:, width:].tolist()):
                cut = next((i for i, t in enumerate(seq) if t in eos), None)
                answer_ids = seq if cut is None else seq[:cut]
                answer = tokenizer.decode(answer_ids, skip_special_tokens=True).strip()
                if not answer:
                    continue
                f.write(json.dumps({"prompt": row.prompt, "answer": answer, "id": row.id, "category": row.category,
                                    "sample": sample, "num_tokens": len(answer_ids),
                                    "finish_reason": "length" if cut is None else "stop"}) + "\n")
                tokens += len(answer_ids)
                written += 1
            f.flush()
            wall = time.perf_counter() - start
            log(f"answers: {written}/{len(encoded)} answers, {tokens} tokens, {wall:.0f} s "
                f"({tokens / wall if wall > 0 else 0:.0f} tokens/s)")
    wall = time.perf_counter() - start
    return {"written": written, "already_done": len(done), "too_long": too_long, "tokens": tokens,
            "wall_s": round(wall, 1)}
