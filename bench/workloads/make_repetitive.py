"""Write repetitive.jsonl: templated requests with varying inputs, as served traffic repeats.

    python -m bench.workloads.make_repetitive   # rewrites bench/workloads/repetitive.jsonl

Four families, interleaved in file order (run the file in order, `specroute bench --order file`,
so a cache warms up as a service's would): record-to-JSON extraction, SQL from a schema and a
question, unit tests for a small function, and a two-turn chat whose second turn asks to revise
the first answer (written here, so the prompt is the same for every method). Seeded: the file is
reproducible.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).with_name("repetitive.jsonl")
PER_FAMILY = 12
SEED = 0

FIRST = ["Maria", "James", "Aiko", "Omar", "Lena", "Carlos", "Priya", "Tom", "Sofia", "Ivan", "Grace", "Mateo",
         "Nadia", "Peter", "Yuki", "Hassan"]
LAST = ["Garcia", "Smith", "Tanaka", "Haddad", "Novak", "Rossi", "Patel", "Brown", "Costa", "Petrov", "Kim",
        "Silva", "Ahmed", "Jones", "Sato", "Ali"]
CITIES = ["Lisbon", "Denver", "Osaka", "Cairo", "Prague", "Turin", "Pune", "Leeds", "Porto", "Kazan", "Busan",
          "Recife", "Tunis", "Austin", "Kyoto", "Lahore"]
JOBS = ["nurse", "teacher", "software engineer", "chef", "architect", "pilot", "accountant", "electrician",
        "pharmacist", "journalist", "carpenter", "librarian"]

EXTRACTION = (
    "Extract the person in this record as JSON with exactly these keys: \"name\", \"age\", \"city\", "
    "\"occupation\", \"email\". Answer with the JSON object only.\n\nRecord: {record}"
)
RECORD_STYLES = [
    "{first} {last} is a {age}-year-old {job} living in {city}. Contact: {email}.",
    "Our new member, {first} {last} ({age}), works as a {job} in {city}; write to {email}.",
    "Name: {first} {last}. Age {age}. Based in {city}, where they work as a {job}. Email {email}.",
]

SCHEMA = """\
CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department_id INTEGER, salary REAL, hired DATE);
CREATE TABLE departments (id INTEGER PRIMARY KEY, name TEXT, city TEXT);
CREATE TABLE projects (id INTEGER PRIMARY KEY, name TEXT, department_id INTEGER, budget REAL);"""
SQL = ("Given this SQLite schema:\n\n{schema}\n\nWrite one SQL query that answers: {question} "
       "Answer with the query only.")
SQL_QUESTIONS = [
    "the names of all employees in the {dept} department.",
    "the average salary of employees hired after {year}-01-01.",
    "the number of employees per department, largest first.",
    "the projects of departments located in {city} with a budget above {budget}.",
    "the highest-paid employee in each department.",
    "the total project budget of the {dept} department.",
    "employees earning more than {salary}, ordered by salary.",
    "departments that have no projects.",
]
DEPTS = ["Sales", "Engineering", "Finance", "Marketing", "Support", "Research"]

TESTS = ("Write pytest unit tests for this function. Cover normal inputs and edge cases. Answer with "
         "the test code only.\n\n```python\n{code}\n```")
FUNCTIONS = [
    "def {name}(items):\n    \"\"\"Return the largest item, or None for an empty list.\"\"\"\n"
    "    return max(items) if items else None",
    "def {name}(text):\n    \"\"\"Return text with its words in reverse order.\"\"\"\n"
    "    return \" \".join(reversed(text.split()))",
    "def {name}(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n    if n < 2:\n        return False\n"
    "    return all(n % d for d in range(2, int(n ** 0.5) + 1))",
    "def {name}(a, b):\n    \"\"\"Return the greatest common divisor of a and b.\"\"\"\n    while b:\n"
    "        a, b = b, a % b\n    return abs(a)",
    "def {name}(word):\n    \"\"\"Return True if word reads the same backwards, ignoring case.\"\"\"\n"
    "    w = word.lower()\n    return w == w[::-1]",
    "def {name}(values):\n    \"\"\"Return the mean of values; raise ValueError when empty.\"\"\"\n"
    "    if not values:\n        raise ValueError(\"empty\")\n    return sum(values) / len(values)",
]
NAMES = ["largest", "reverse_words", "is_prime", "gcd", "is_palindrome", "mean", "find_max", "flip_words",
         "check_prime", "greatest_common_divisor", "palindrome", "average"]

PRODUCTS = [("a stainless steel water bottle", 24), ("a pair of wireless earbuds", 59), ("a bamboo cutting board", 18),
            ("a wool travel blanket", 45), ("a smart desk lamp", 39), ("a cast iron skillet", 32),
            ("a waterproof hiking backpack", 79), ("a ceramic pour-over coffee set", 28),
            ("a folding camping chair", 35), ("a mechanical keyboard", 89), ("a yoga mat", 22),
            ("a portable phone charger", 29)]
FIRST_ANSWER = (
    "Meet {product}: built to last and designed for everyday use. It is light enough to carry anywhere, "
    "easy to clean, and made from durable materials that hold up for years. Whether you are at home, at work "
    "or on the road, it fits right into your routine. A thoughtful gift and a smart choice for yourself."
)
REVISE = ["Revise the description: make it half as long and mention the price of ${price}.",
          "Rewrite it for a social media post under 40 words, ending with the price ${price}.",
          "Keep the same description but add one sentence about the price, ${price}, and a warranty of two years."]


def extraction(rng: random.Random, i: int) -> dict:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    record = rng.choice(RECORD_STYLES).format(
        first=first, last=last, age=rng.randrange(21, 70), job=rng.choice(JOBS), city=rng.choice(CITIES),
        email=f"{first.lower()}.{last.lower()}@example.com")
    return {"category": "extraction", "turns": [EXTRACTION.format(record=record)]}


def sql(rng: random.Random, i: int) -> dict:
    question = SQL_QUESTIONS[i % len(SQL_QUESTIONS)].format(
        dept=rng.choice(DEPTS), year=rng.randrange(2015, 2024), city=rng.choice(CITIES),
        budget=rng.randrange(1, 10) * 10000, salary=rng.randrange(4, 12) * 10000)
    return {"category": "sql", "turns": [SQL.format(schema=SCHEMA, question=question)]}


def unit_tests(rng: random.Random, i: int) -> dict:
    code = FUNCTIONS[i % len(FUNCTIONS)].format(name=NAMES[i % len(NAMES)])
    return {"category": "unit_tests", "turns": [TESTS.format(code=code)]}


def revise(rng: random.Random, i: int) -> dict:
    product, price = PRODUCTS[i % len(PRODUCTS)]
    ask = f"Write a short product description for {product}."
    second = rng.choice(REVISE).format(price=price)
    return {"category": "revise", "turns": [second], "messages": [
        {"role": "user", "content": ask},
        {"role": "assistant", "content": FIRST_ANSWER.format(product=product)},
        {"role": "user", "content": second},
    ]}


def main() -> None:
    rng = random.Random(SEED)
    families = [extraction, sql, unit_tests, revise]
    lines = []
    for i in range(PER_FAMILY):
        for family in families:
            q = family(rng, i)
            lines.append(json.dumps({"question_id": f"{q['category']}-{i:02d}", **q}))
    OUT.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
