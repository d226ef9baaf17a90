"""Write edits.jsonl: requests that predict their output (OpenAI's Predicted Outputs).

    python -m bench.workloads.make_edits   # rewrites bench/workloads/edits.jsonl

Three families, interleaved: a small Python function to edit (rename it, add type hints, comment
its return), a JSON record to update, and a two-turn chat whose second turn revises the first
answer. Each line's `prediction` is what a client would send: the text the edit starts from (the
function, the record, the first answer), not the edited result it cannot know. Seeded: the file
is reproducible.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.workloads.make_repetitive import CITIES, FIRST, FIRST_ANSWER, FUNCTIONS, JOBS, LAST, NAMES, PRODUCTS

OUT = Path(__file__).with_name("edits.jsonl")
PER_FAMILY = 12
SEED = 0

CODE_EDITS = ["Rename the function to `{new}`.", "Add type hints to its parameters and its return value.",
              "Add a one-line comment above each return statement saying what it returns."]
CODE = "{edit} Answer with the whole function only.\n\n```python\n{code}\n```"
RECORD = ("Update this JSON record: set \"city\" to \"{city}\" and \"age\" to {age}. Answer with the whole "
          "JSON object only.\n\n```json\n{record}\n```")
REVISE = ["Keep the same description word for word, but add one sentence at the end about the price, ${price}.",
          "Repeat the description, replacing \"everyday use\" with \"daily adventures\"; change nothing else.",
          "Keep the description as it is and add a warranty of two years in its last sentence."]


def code_edit(rng: random.Random, i: int) -> dict:
    code = FUNCTIONS[i % len(FUNCTIONS)].format(name=NAMES[i % len(NAMES)])
    edit = CODE_EDITS[i % len(CODE_EDITS)].format(new=rng.choice(NAMES[6:]))
    return {"category": "code_edit", "turns": [CODE.format(edit=edit, code=code)],
            "prediction": f"```python\n{code}\n```"}


def json_update(rng: random.Random, i: int) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    record = json.dumps({"name": f"{first} {last}", "age": rng.randint(21, 70), "city": rng.choice(CITIES),
                         "occupation": rng.choice(JOBS), "email": f"{first.lower()}.{last.lower()}@example.com",
                         "active": rng.random() < 0.5}, indent=2)
    return {"category": "json_update",
            "turns": [RECORD.format(city=rng.choice(CITIES), age=rng.randint(21, 70), record=record)],
            "prediction": f"```json\n{record}\n```"}


def revise(rng: random.Random, i: int) -> dict:
    product, price = PRODUCTS[i % len(PRODUCTS)]
    first = FIRST_ANSWER.format(product=product)
    second = REVISE[i % len(REVISE)].format(price=price)
    return {"category": "revise", "turns": [second], "prediction": first, "messages": [
        {"role": "user", "content": f"Write a short product description for {product}."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": second},
    ]}


def main() -> None:
    rng = random.Random(SEED)
    lines = []
    for i in range(PER_FAMILY):
        for family in (code_edit, json_update, revise):
            q = family(rng, i)
            lines.append(json.dumps({"question_id": f"{q['category']}-{i:02d}", **q}))
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
