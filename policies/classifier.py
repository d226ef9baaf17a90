"""The domain classifier: which domain a prompt belongs to, so the selector can route it.

A hashed bag of word and character n-grams (scikit-learn's HashingVectorizer, nothing fitted)
feeds a multinomial logistic regression. Stored without pickle: `classifier.json` holds the
vectorizer settings, the classes and the training record; `classifier.npz` holds the linear
model's coefficients (sparse, float32) and intercepts. Prediction is softmax(X @ W.T + b).

Order of authority in `DomainClassifier.predict`: a domain the request names, then the policy's
rules (first match wins), then the model; below `min_confidence` the policy's default_domain.
No torch, no Ray.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import scipy.sparse as sp
from sklearn.feature_extraction.text import HashingVectorizer
from sklearn.linear_model import LogisticRegression

from policies.paths import REPO_ROOT, resolve_repo_path
from policies.schema import ClassifierSettings, Policy

DEFAULT_MODEL_DIR = REPO_ROOT / "models" / "classifier"
PARAMS_FILE = "classifier.json"
WEIGHTS_FILE = "classifier.npz"
CARD_FILE = "CARD.md"
FORMAT = "specroute-domain-classifier/1"

DOMAINS: tuple[str, ...] = ("code", "math", "summarization", "rag", "translation", "chat")

# Spec-Bench category -> domain. MT-bench's open-ended categories are all "chat".
CATEGORY_TO_DOMAIN: dict[str, str] = {
    "coding": "code",
    "math": "math",
    "math_reasoning": "math",
    "summarization": "summarization",
    "rag": "rag",
    "translation": "translation",
    **{c: "chat" for c in ("qa", "writing", "roleplay", "reasoning", "extraction", "stem", "humanities")},
}

# Vectorizer settings (the whole "fitted" state of the featurizer: hashing needs no vocabulary).
DEFAULT_VECTORIZERS: tuple[dict[str, Any], ...] = (
    {"analyzer": "word", "ngram_range": [1, 2], "n_features": 2**16},
    {"analyzer": "char_wb", "ngram_range": [3, 5], "n_features": 2**16},
)
DEFAULT_C = 10.0
RANDOM_STATE = 0

Source = Literal["request", "rule", "model", "default"]


class ClassifierError(ValueError):
    """A classifier artefact or training set that cannot be used; one line naming the file."""


@dataclass(frozen=True)
class Classification:
    domain: str
    confidence: float  # 1.0 for request and rule; the model's top probability otherwise (0.0: no model)
    source: Source


# ---------------------------------------------------------------------------------------------
# The model: featurizer settings + linear weights


def _vectorizer(spec: dict[str, Any]) -> HashingVectorizer:
    return HashingVectorizer(
        analyzer=spec["analyzer"], ngram_range=tuple(spec["ngram_range"]), n_features=int(spec["n_features"]),
        lowercase=True, alternate_sign=False, norm="l2", dtype=np.float32,
    )


class TextModel:
    """Hashed n-gram features + a linear softmax over `classes`."""

    def __init__(self, vectorizers: Sequence[dict[str, Any]], classes: Sequence[str],
                 coef: sp.csr_matrix, intercept: np.ndarray, meta: dict[str, Any] | None = None) -> None:
        self.vectorizer_specs = [dict(v) for v in vectorizers]
        self._vectorizers = [_vectorizer(v) for v in self.vectorizer_specs]
        self.classes = list(classes)
        self.n_features = sum(int(v["n_features"]) for v in self.vectorizer_specs)
        self.coef = sp.csr_matrix(coef, dtype=np.float32)
        self.intercept = np.asarray(intercept, dtype=np.float32).reshape(-1)
        self.meta = dict(meta or {})
        self._check_shapes("model")

    def _check_shapes(self, where: str) -> None:
        want = (len(self.classes), self.n_features)
        if self.coef.shape != want:
            raise ClassifierError(
                f"{where}: coefficients have shape {self.coef.shape[0]}x{self.coef.shape[1]} but "
                f"{len(self.classes)} classes x {self.n_features} features need {want[0]}x{want[1]}"
            )
        if self.intercept.shape != (len(self.classes),):
            raise ClassifierError(
                f"{where}: intercept has {self.intercept.shape[0]} values but there are {len(self.classes)} classes"
            )

    def features(self, texts: Iterable[str]) -> sp.csr_matrix:
        texts = list(texts)
        return sp.hstack([v.transform(texts) for v in self._vectorizers], format="csr")

    def predict_proba(self, texts: Iterable[str]) -> np.ndarray:
        scores = np.asarray((self.features(texts) @ self.coef.T).todense(), dtype=np.float64) + self.intercept
        scores -= scores.max(axis=1, keepdims=True)
        p = np.exp(scores)
        return p / p.sum(axis=1, keepdims=True)

    def predict(self, texts: Iterable[str]) -> list[tuple[str, float]]:
        proba = self.predict_proba(texts)
        best = proba.argmax(axis=1)
        return [(self.classes[i], float(proba[r, i])) for r, i in enumerate(best)]

    # -- storage: JSON + npz, no pickle ------------------------------------------------------

    def save(self, out_dir: str | Path) -> tuple[Path, Path]:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        coef = self.coef.tocsr()
        coef.sort_indices()
        weights = out / WEIGHTS_FILE
        np.savez_compressed(
            weights, coef_data=coef.data.astype(np.float32), coef_indices=coef.indices.astype(np.int32),
            coef_indptr=coef.indptr.astype(np.int64), intercept=self.intercept.astype(np.float32),
        )
        params = out / PARAMS_FILE
        params.write_text(json.dumps({
            "format": FORMAT, "classes": self.classes, "vectorizers": self.vectorizer_specs,
            "n_features": self.n_features, **self.meta,
        }, indent=2, sort_keys=True) + "\n")
        return params, weights

    @classmethod
    def load(cls, model_dir: str | Path) -> TextModel:
        d = Path(model_dir)
        params_path, weights_path = d / PARAMS_FILE, d / WEIGHTS_FILE
        for p in (params_path, weights_path):
            if not p.is_file():
                raise ClassifierError(f"classifier: no file {p}")
        try:
            params = json.loads(params_path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ClassifierError(f"classifier {params_path}: cannot read JSON: {e}") from None
        if not isinstance(params, dict) or params.get("format") != FORMAT:
            raise ClassifierError(f"classifier {params_path}: not a {FORMAT} file")
        try:
            with np.load(weights_path, allow_pickle=False) as z:
                keys = ("coef_data", "coef_indices", "coef_indptr", "intercept")
                data, indices, indptr, intercept = (z[k] for k in keys)
        except (OSError, ValueError, KeyError) as e:
            raise ClassifierError(f"classifier {weights_path}: cannot read weights: {e}") from None
        classes = params["classes"]
        vecs = params["vectorizers"]
        n_features = sum(int(v["n_features"]) for v in vecs)
        if int(params.get("n_features", n_features)) != n_features:
            raise ClassifierError(
                f"classifier {params_path}: n_features {params['n_features']} but the vectorizers give {n_features}"
            )
        if indptr.shape[0] != len(classes) + 1:
            raise ClassifierError(
                f"classifier {weights_path}: coefficients have {indptr.shape[0] - 1} rows but "
                f"{params_path.name} lists {len(classes)} classes"
            )
        if indices.size and int(indices.max()) >= n_features:
            raise ClassifierError(
                f"classifier {weights_path}: coefficients have {int(indices.max()) + 1}+ columns but "
                f"{params_path.name} gives {n_features} features"
            )
        coef = sp.csr_matrix((data, indices, indptr), shape=(len(classes), n_features))
        meta = {k: v for k, v in params.items() if k not in {"format", "classes", "vectorizers", "n_features"}}
        try:
            return cls(vecs, classes, coef, intercept, meta)
        except ClassifierError as e:
            raise ClassifierError(f"classifier {weights_path}: {str(e).removeprefix('model: ')}") from None


# ---------------------------------------------------------------------------------------------
# The classifier a policy uses


class DomainClassifier:
    def __init__(self, settings: ClassifierSettings, default_domain: str,
                 model: TextModel | None = None, domains: Iterable[str] | None = None) -> None:
        self.settings = settings
        self.default_domain = default_domain
        self.model = model
        self.domains = set(domains) if domains is not None else None

    @classmethod
    def from_policy(cls, policy: Policy, model: TextModel | None = None) -> DomainClassifier:
        """The policy's rules and thresholds; its `classifier.model` loaded unless `model` is given."""
        if model is None and policy.classifier.model:
            model = TextModel.load(resolve_repo_path(policy.classifier.model))
        return cls(policy.classifier, policy.default_domain, model, policy.domains)

    def _rule(self, text: str) -> str | None:
        lowered = text.lower()
        for rule in self.settings.rules:
            pattern = rule.pattern
            if pattern is not None:
                if pattern.search(text):
                    return rule.domain
            elif any(k.lower() in lowered for k in rule.keywords or ()):
                return rule.domain
        return None

    def predict(self, text: str, requested: str | None = None) -> Classification:
        if requested is not None:
            if self.domains is not None and requested not in self.domains:
                known = ", ".join(sorted(self.domains))
                raise ClassifierError(f"speculation.domain: {requested!r} is not a domain (domains: {known})")
            return Classification(requested, 1.0, "request")
        if (domain := self._rule(text)) is not None:
            return Classification(domain, 1.0, "rule")
        if self.model is None:
            return Classification(self.default_domain, 0.0, "default")
        domain, confidence = self.model.predict([text])[0]
        known = self.domains is None or domain in self.domains
        if confidence < self.settings.min_confidence or not known:
            return Classification(self.default_domain, confidence, "default")
        return Classification(domain, confidence, "model")


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class Example:
    text: str
    domain: str
    question_id: int | None  # None: a written prompt, not from Spec-Bench (always trainable)
    category: str | None
    source: str


@dataclass
class TrainResult:
    model: TextModel
    train_ids: list[int]  # Spec-Bench question ids trained on
    heldout_ids: list[int]
    n_train: int
    n_heldout: int
    heldout_accuracy: float | None
    per_domain: dict[str, dict[str, float]] = field(default_factory=dict)  # domain -> {n, accuracy}


def read_examples(path: str | Path) -> list[Example]:
    """Spec-Bench lines (question_id, category, turns: the first turn is the prompt) or
    {"text", "domain"} lines (optional question_id). Raises ClassifierError naming file and line."""
    p = Path(path)
    try:
        lines = p.read_text().splitlines()
    except OSError as e:
        raise ClassifierError(f"cannot read {p}: {e.strerror}") from None
    out: list[Example] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ClassifierError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ClassifierError(f"{where}: expected a JSON object, got {type(row).__name__}")
        qid = row.get("question_id")
        if qid is not None and (not isinstance(qid, int) or isinstance(qid, bool)):
            raise ClassifierError(f"{where}: question_id must be an integer (got {qid!r})")
        if "turns" in row:
            turns, cat = row["turns"], row.get("category")
            if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
                raise ClassifierError(f"{where}: turns must be a non-empty list of strings")
            if cat not in CATEGORY_TO_DOMAIN:
                raise ClassifierError(
                    f"{where}: unknown category {cat!r} (known: {', '.join(sorted(CATEGORY_TO_DOMAIN))})"
                )
            out.append(Example(turns[0], CATEGORY_TO_DOMAIN[cat], qid, cat, str(p)))
        elif "text" in row and "domain" in row:
            text, domain = row["text"], row["domain"]
            if not isinstance(text, str) or not text.strip():
                raise ClassifierError(f"{where}: text must be a non-empty string")
            if domain not in DOMAINS:
                raise ClassifierError(f"{where}: unknown domain {domain!r} (domains: {', '.join(DOMAINS)})")
            out.append(Example(text, domain, qid, None, str(p)))
        else:
            raise ClassifierError(f"{where}: expected question_id/category/turns or text/domain fields")
    if not out:
        raise ClassifierError(f"{p}: no examples")
    return out


def is_heldout(question_id: int | None, holdout_mod: int) -> bool:
    return question_id is not None and question_id % holdout_mod == 0


def train(examples: Sequence[Example], holdout_mod: int = 5, C: float = DEFAULT_C,
          vectorizers: Sequence[dict[str, Any]] = DEFAULT_VECTORIZERS) -> TrainResult:
    """Fit on every example not in the held-out split (question_id % holdout_mod == 0 is never
    trained on); score the held-out split. Deterministic (lbfgs, fixed random_state)."""
    if holdout_mod < 2:
        raise ClassifierError(f"--holdout-mod must be at least 2 (got {holdout_mod})")
    train_ex = [e for e in examples if not is_heldout(e.question_id, holdout_mod)]
    held_ex = [e for e in examples if is_heldout(e.question_id, holdout_mod)]
    classes = sorted({e.domain for e in train_ex})
    if len(classes) < 2:
        raise ClassifierError(f"training needs at least two domains outside the held-out split (got {classes})")
    n_features = sum(int(v["n_features"]) for v in vectorizers)
    empty = TextModel(vectorizers, classes, sp.csr_matrix((len(classes), n_features)), np.zeros(len(classes)))
    X = empty.features(e.text for e in train_ex)
    y = np.array([e.domain for e in train_ex])
    lr = LogisticRegression(C=C, max_iter=2000, random_state=RANDOM_STATE, class_weight="balanced")
    lr.fit(X, y)
    assert list(lr.classes_) == classes
    coef = lr.coef_ if len(classes) > 2 else np.vstack([-lr.coef_, lr.coef_]) / 2
    intercept = lr.intercept_ if len(classes) > 2 else np.array([-lr.intercept_[0], lr.intercept_[0]]) / 2
    coef = sp.csr_matrix(np.where(np.abs(coef) < 1e-7, 0.0, coef).astype(np.float32))
    model = TextModel(vectorizers, classes, coef, intercept, {"C": C, "holdout_mod": holdout_mod})
    acc, per_domain = evaluate(model, held_ex)
    return TrainResult(
        model=model,
        train_ids=sorted(e.question_id for e in train_ex if e.question_id is not None),
        heldout_ids=sorted(e.question_id for e in held_ex if e.question_id is not None),
        n_train=len(train_ex), n_heldout=len(held_ex), heldout_accuracy=acc, per_domain=per_domain,
    )


def evaluate(model: TextModel, examples: Sequence[Example]) -> tuple[float | None, dict[str, dict[str, float]]]:
    """Accuracy of the model alone (argmax, no rules, no threshold) and per true domain."""
    if not examples:
        return None, {}
    pred = [d for d, _ in model.predict(e.text for e in examples)]
    hits = [p == e.domain for p, e in zip(pred, examples)]
    per: dict[str, dict[str, float]] = {}
    for dom in sorted({e.domain for e in examples}):
        idx = [i for i, e in enumerate(examples) if e.domain == dom]
        per[dom] = {"n": len(idx), "accuracy": round(sum(hits[i] for i in idx) / len(idx), 4)}
    return round(sum(hits) / len(hits), 4), per


def _sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def write_artefact(result: TrainResult, out_dir: str | Path, data_files: Sequence[str | Path], command: str) -> Path:
    """Save the model (JSON + npz) and a CARD.md; returns the card's path."""
    out = Path(out_dir)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    result.model.meta.update({
        "trained": stamp, "n_train": result.n_train, "n_heldout": result.n_heldout,
        "heldout_accuracy": result.heldout_accuracy, "per_domain_heldout": result.per_domain,
        "data": [{"path": str(f), "sha256": _sha256(f)} for f in data_files],
        "category_to_domain": CATEGORY_TO_DOMAIN, "command": command, "random_state": RANDOM_STATE,
    })
    params, weights = result.model.save(out)
    size_kb = (params.stat().st_size + weights.stat().st_size) / 1024
    mod = result.model.meta["holdout_mod"]
    chat_cats = ", ".join(c for c, d in CATEGORY_TO_DOMAIN.items() if d == "chat")
    mapping = "\n".join(f"| {c} | {d} |" for c, d in CATEGORY_TO_DOMAIN.items())
    per = "\n".join(f"| {d} | {int(v['n'])} | {v['accuracy']:.4f} |" for d, v in result.per_domain.items())
    acc = "n/a (no held-out examples)" if result.heldout_accuracy is None else f"{result.heldout_accuracy:.4f}"
    data = "\n".join(f"- `{f}` (sha256 `{_sha256(f)[:16]}…`)" for f in data_files)
    vecs = "; ".join(
        f"{v['analyzer']} {tuple(v['ngram_range'])}, 2^{int(v['n_features']).bit_length() - 1} features"
        for v in result.model.vectorizer_specs
    )
    learner = (f"multinomial logistic regression (lbfgs, C={result.model.meta['C']}, class_weight=balanced, "
               f"random_state={RANDOM_STATE})")
    card = f"""# Domain classifier

Routes a prompt to one of SpecRoute's domains ({", ".join(DOMAINS)}) so the selector can pick a
drafter. Loaded by `policies.classifier.DomainClassifier` (set `classifier.model` in a policy to
this folder). The policy's rules and a request's `speculation.domain` override it; below the
policy's `classifier.min_confidence` its `default_domain` applies.

- Trained: {stamp}
- Command: `{command}`
- Model: hashed n-grams (HashingVectorizer: {vecs}; lowercase, l2 per block) + {learner}.
- Storage, no pickle: `{PARAMS_FILE}` (settings, classes, this record) + `{WEIGHTS_FILE}`
  (sparse float32 coefficients, intercepts); {size_kb:.0f} KiB in all.

## Data and split

{data}

Prompt = the first turn of each question. Held-out split: question_id % {mod} == 0, **never trained on**
(written prompts without a question_id are always training data). Trained on {result.n_train} prompts,
evaluated on {result.n_heldout}.

## Held-out accuracy (model alone: argmax, no rules, no threshold)

**Held-out accuracy: {acc}**

| domain | n | accuracy |
|---|---|---|
{per}

## Spec-Bench category → domain

{chat_cats} have no domain of their own: they are open-ended chat and map to `chat`.

| category | domain |
|---|---|
{mapping}

## Limits

Spec-Bench's code and MT-bench math sets are tiny (10 questions each, 8 of them trainable), so
`code` rests mostly on the policy's code rule (fences, `def`/`class`, `function(`). Prompts are
English; the domains are the task's shape, not its topic.
"""
    path = out / CARD_FILE
    path.write_text(card)
    return path
