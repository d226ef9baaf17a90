"""Write structured.jsonl: requests whose output must match a JSON schema (`response_format`).

    python -m bench.workloads.make_structured   # rewrites bench/workloads/structured.jsonl

Three families, interleaved: a person's record in free text to an object of five typed fields, a
customer's order to an object with a list of items, and a product review to a label from a fixed
set with a short summary. Each line carries OpenAI's `response_format` with its schema, which the
benchmark applies to every method. Seeded: the file is reproducible.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from bench.workloads.make_repetitive import CITIES, FIRST, JOBS, LAST, PRODUCTS

OUT = Path(__file__).with_name("structured.jsonl")
PER_FAMILY = 12
SEED = 0

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "occupation": {"type": "string"}, "email": {"type": "string"}},
    "required": ["name", "age", "city", "occupation", "email"], "additionalProperties": False,
}
PERSON_PROMPT = "Extract the person in this record as JSON.\n\nRecord: {record}"
RECORDS = [
    "{first} {last} is a {age}-year-old {job} living in {city}. Contact: {email}.",
    "Our new member, {first} {last} ({age}), works as a {job} in {city}; write to {email}.",
    "Name: {first} {last}. Age {age}. Based in {city}, where they work as a {job}. Email {email}.",
]

ORDER = {
    "type": "object",
    "properties": {
        "customer": {"type": "string"},
        "items": {"type": "array", "minItems": 1, "items": {
            "type": "object", "properties": {"product": {"type": "string"}, "quantity": {"type": "integer"},
                                             "unit_price": {"type": "number"}},
            "required": ["product", "quantity", "unit_price"], "additionalProperties": False}},
        "ship_to": {"type": "string"},
    },
    "required": ["customer", "items", "ship_to"], "additionalProperties": False,
}
ORDER_PROMPT = "Turn this order into JSON: the customer, each item with its quantity and unit price, and the city " \
               "to ship to.\n\nOrder: {order}"

REVIEW = {
    "type": "object",
    "properties": {"sentiment": {"enum": ["positive", "negative", "mixed"]},
                   "aspect": {"enum": ["quality", "price", "delivery", "design"]},
                   "summary": {"type": "string", "maxLength": 100}},
    "required": ["sentiment", "aspect", "summary"], "additionalProperties": False,
}
REVIEW_PROMPT = "Classify this product review as JSON: its sentiment, the aspect it is mostly about, and a " \
                "one-sentence summary.\n\nReview of {product}: {review}"
REVIEWS = [
    "I love it. It feels solid and well made, and it still looks new after months of use.",
    "Far too expensive for what it is. At ${price} I expected much more.",
    "It arrived two weeks late and the box was crushed, although the product itself works.",
    "Beautiful to look at, but it scratches easily and one part broke in the first week.",
    "Good value at ${price}; it does the job and I would buy it again.",
    "The shape is clever and the colour is lovely; it fits perfectly on my shelf.",
]


def _format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def person(rng: random.Random, i: int) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    record = rng.choice(RECORDS).format(first=first, last=last, age=rng.randint(21, 70), job=rng.choice(JOBS),
                                        city=rng.choice(CITIES), email=f"{first.lower()}.{last.lower()}@example.com")
    return {"question_id": f"person-{i:02d}", "category": "person", "turns": [PERSON_PROMPT.format(record=record)],
            "response_format": _format("person", PERSON)}


def order(rng: random.Random, i: int) -> dict:
    items = rng.sample(PRODUCTS, rng.randint(1, 3))
    listed = ", ".join(f"{rng.randint(1, 4)} x {name.removeprefix('a ').removeprefix('an ')} at ${price}"
                       for name, price in items)
    text = f"{rng.choice(FIRST)} {rng.choice(LAST)} ordered {listed}, to be shipped to {rng.choice(CITIES)}."
    return {"question_id": f"order-{i:02d}", "category": "order", "turns": [ORDER_PROMPT.format(order=text)],
            "response_format": _format("order", ORDER)}


def review(rng: random.Random, i: int) -> dict:
    product, price = rng.choice(PRODUCTS)
    text = rng.choice(REVIEWS).replace("{price}", str(price))
    return {"question_id": f"review-{i:02d}", "category": "review",
            "turns": [REVIEW_PROMPT.format(product=product, review=text)], "response_format": _format("review", REVIEW)}


def main() -> None:
    rng = random.Random(SEED)
    lines = [make(rng, i) for i in range(PER_FAMILY) for make in (person, order, review)]
    OUT.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
