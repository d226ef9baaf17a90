"""The domain classifier: training split, storage without pickle, override order, the shipped
artefact and `specroute train-classifier`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from policies.classifier import (
    CARD_FILE,
    DEFAULT_MODEL_DIR,
    PARAMS_FILE,
    WEIGHTS_FILE,
    ClassifierError,
    DomainClassifier,
    TextModel,
    evaluate,
    read_examples,
    train,
)
from policies.schema import DEFAULT_POLICY_PATH, ClassifierSettings, load_policy
from router.cli import main

REPO = Path(__file__).resolve().parents[1]
SPEC_BENCH = Path("/work/shared/data/spec_bench/question.jsonl")
# The shipped model must beat this on the held-out split (model alone; 0.8958 when trained).
HELDOUT_ACCURACY_FLOOR = 0.85

TEMPLATES = {
    "coding": ["Write a Python function that {x}.", "Implement a program in C++ to {x}.",
               "Debug this code so that it can {x}."],
    "math_reasoning": ["If {n} apples cost 3 dollars, how much do {n} pears cost? Solve step by step.",
                       "Compute the sum of {n} and 17, then multiply by 4.",
                       "Solve for x: {n}x + 3 = 12."],
    "summarization": ["Summarize the following article about {x} in two sentences.",
                      "Give a brief summary of this news report on {x}."],
    "rag": ["Answer the question using the passage. Passage: {x} was founded long ago. Question: who founded it?",
            "Given the document below about {x}, answer: when did it happen?"],
    "translation": ["Translate German to English: Ich möchte {x} sehen.",
                    "Translate this sentence into English: Je voudrais {x}."],
    "writing": ["Tell me about your favourite {x}.", "Compose a poem about {x}.",
                "What do you think about {x}?"],
}
TOPICS = ["sort a list", "the ocean", "a small town", "reverse a string", "climate", "music", "trains",
          "parse dates", "the moon", "football"]


def synthetic_rows(n_per_category: int = 10) -> list[dict]:
    rows, qid = [], 1
    for cat, temps in TEMPLATES.items():
        for i in range(n_per_category):
            text = temps[i % len(temps)].format(x=TOPICS[i % len(TOPICS)], n=i + 2)
            rows.append({"question_id": qid, "category": cat, "turns": [text, "And a follow-up?"]})
            qid += 1
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory):
    path = write_jsonl(tmp_path_factory.mktemp("data") / "synthetic.jsonl", synthetic_rows())
    extra = write_jsonl(path.with_name("extra.jsonl"), [
        {"text": "Write a Rust function that adds two numbers.", "domain": "code"},
        {"text": "Translate 'good morning' into Spanish.", "domain": "translation", "question_id": 1000},
    ])
    examples = read_examples(path) + read_examples(extra)
    return examples, train(examples, holdout_mod=5)


def test_held_out_split_is_never_trained_on(synthetic) -> None:
    examples, result = synthetic
    assert result.train_ids and result.heldout_ids
    assert all(i % 5 != 0 for i in result.train_ids)
    assert all(i % 5 == 0 for i in result.heldout_ids)
    all_ids = sorted(e.question_id for e in examples if e.question_id is not None)
    assert sorted(result.train_ids + result.heldout_ids) == all_ids
    assert 1000 in result.heldout_ids  # a {text, domain} line with a held-out id is held out too
    # the written prompt without an id is trained on: one more training example than trainable ids
    assert result.n_train == len(result.train_ids) + 1
    assert result.n_heldout == len(result.heldout_ids)


def test_save_load_round_trip_predicts_identically(synthetic, tmp_path: Path) -> None:
    _, result = synthetic
    result.model.save(tmp_path)
    loaded = TextModel.load(tmp_path)
    texts = ["Write a Python function to sort a list.", "Translate German to English: Guten Tag.",
             "Summarize this report.", "hello there"]
    assert loaded.classes == result.model.classes
    np.testing.assert_array_equal(loaded.predict_proba(texts), result.model.predict_proba(texts))
    assert loaded.predict(texts)[0][0] == "code"
    with np.load(tmp_path / WEIGHTS_FILE, allow_pickle=False) as z:  # plain arrays, no pickled objects
        assert all(z[k].dtype != object for k in z.files)


def test_override_order_request_rule_model_default(synthetic) -> None:
    _, result = synthetic
    policy = load_policy(DEFAULT_POLICY_PATH)
    clf = DomainClassifier.from_policy(policy, model=result.model)
    # the model alone
    got = clf.predict("Solve for x: 7x + 3 = 12.")
    assert (got.domain, got.source) == ("math", "model") and got.confidence >= 0.5
    # a rule beats the model: the keyword rule "summarize" on a math-looking prompt
    got = clf.predict("Solve for x: 7x + 3 = 12, then summarize the steps.")
    assert (got.domain, got.source, got.confidence) == ("summarization", "rule", 1.0)
    # the regex rule (code fence) too
    assert clf.predict("```\nx = 1\n```").source == "rule"
    # a request-supplied domain beats rules and model
    got = clf.predict("Please summarize this.", requested="rag")
    assert (got.domain, got.source) == ("rag", "request")
    with pytest.raises(ClassifierError, match="'poetry' is not a domain"):
        clf.predict("x", requested="poetry")


def test_low_confidence_falls_back_to_default_domain(synthetic) -> None:
    _, result = synthetic
    strict = DomainClassifier(ClassifierSettings(min_confidence=0.999), "chat", result.model)
    got = strict.predict("Solve for x: 7x + 3 = 12.")
    assert got.source == "default" and got.domain == "chat" and got.confidence < 0.999
    no_model = DomainClassifier(ClassifierSettings(), "chat", None)
    assert no_model.predict("anything") == no_model.predict("else")
    assert no_model.predict("anything").source == "default"


def test_shipped_artefact_matches_its_card() -> None:
    model = TextModel.load(DEFAULT_MODEL_DIR)
    size = (DEFAULT_MODEL_DIR / PARAMS_FILE).stat().st_size + (DEFAULT_MODEL_DIR / WEIGHTS_FILE).stat().st_size
    assert size < 5 * 2**20
    held = [e for e in read_examples(SPEC_BENCH) if e.question_id % 5 == 0]
    assert len(held) == 96
    acc, per_domain = evaluate(model, held)
    card = (DEFAULT_MODEL_DIR / CARD_FILE).read_text()
    stated = float(card.split("**Held-out accuracy: ")[1].split("**")[0])
    assert acc == pytest.approx(stated, abs=0.001)
    assert acc == pytest.approx(model.meta["heldout_accuracy"], abs=0.001)
    assert acc > HELDOUT_ACCURACY_FLOOR
    assert model.meta["holdout_mod"] == 5
    for domain, v in per_domain.items():
        assert f"| {domain} | {v['n']} | {v['accuracy']:.4f} |" in card


def test_load_refuses_missing_and_mismatched_files(synthetic, tmp_path: Path) -> None:
    with pytest.raises(ClassifierError, match=str(tmp_path / "nowhere" / PARAMS_FILE)):
        TextModel.load(tmp_path / "nowhere")
    _, result = synthetic
    result.model.save(tmp_path)
    (tmp_path / WEIGHTS_FILE).unlink()
    with pytest.raises(ClassifierError, match=f"no file {tmp_path / WEIGHTS_FILE}"):
        TextModel.load(tmp_path)
    result.model.save(tmp_path)
    params = json.loads((tmp_path / PARAMS_FILE).read_text())
    params["classes"] = params["classes"][:-1]
    (tmp_path / PARAMS_FILE).write_text(json.dumps(params))
    n = len(result.model.classes)
    with pytest.raises(ClassifierError, match=f"{n} rows but classifier.json lists {n - 1} classes"):
        TextModel.load(tmp_path)
    params["classes"] = result.model.classes
    params["vectorizers"][1]["n_features"] = 16
    params["n_features"] = params["vectorizers"][0]["n_features"] + 16
    (tmp_path / PARAMS_FILE).write_text(json.dumps(params))
    with pytest.raises(ClassifierError, match="columns but classifier.json gives 65552 features"):
        TextModel.load(tmp_path)


def test_cli_trains_and_writes_the_artefact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = write_jsonl(tmp_path / "tiny.jsonl", synthetic_rows(5))
    out = tmp_path / "clf"
    assert main(["train-classifier", "--data", str(data), "--out", str(out)]) == 0
    assert "held-out accuracy" in capsys.readouterr().out
    for name in (PARAMS_FILE, WEIGHTS_FILE, CARD_FILE):
        assert (out / name).is_file()
    card = (out / CARD_FILE).read_text()
    assert "question_id % 5 == 0" in card and "| qa | chat |" in card and str(data) in card
    assert TextModel.load(out).predict(["Write a Python function that sorts."])[0][0] == "code"


@pytest.mark.parametrize("content, message", [
    ('{"question_id": 1, "category": "coding", "turns": ["x"]}\nnot json\n', "tiny.jsonl:2: not valid JSON"),
    ('{"question_id": 1, "category": "poetry", "turns": ["x"]}\n', "unknown category 'poetry'"),
    ('{"text": "hi", "domain": "weather"}\n', "unknown domain 'weather'"),
    ('{"question_id": 1, "turns": []}\n', "turns must be a non-empty list"),
    ('{"question_id": 5, "category": "coding", "turns": ["x"]}\n', "at least two domains"),
    (None, "cannot read"),
])
def test_cli_bad_data_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            content: str | None, message: str) -> None:
    data = tmp_path / "tiny.jsonl"
    if content is not None:
        data.write_text(content)
    assert main(["train-classifier", "--data", str(data), "--out", str(tmp_path / "clf")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1
    assert err.startswith("specroute train-classifier: error: ")
    assert not (tmp_path / "clf").exists()


def test_policies_classifier_imports_no_torch_or_ray() -> None:
    code = "import sys, policies.classifier; print([m for m in ('torch', 'ray') if m in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"
