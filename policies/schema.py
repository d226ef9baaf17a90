"""The YAML routing policy: pydantic models, loading, and the check against the engine's drafters.

A bad policy is refused with one message naming the field path and the value it got, e.g.
`domains.code.k_max: 3 is below k_min 4`, so `specroute policy check` and the hot reload can
reject it while the running policy stays in force. Every default lives here, once, in the
models. No torch, no Ray.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from policies.paths import REPO_ROOT
from policies.records import PLAIN  # the drafter name of plain decoding (no draft, k = 0)

DEFAULT_POLICY_PATH = REPO_ROOT / "policies" / "default_policy.yaml"

# The largest draft length anywhere: the bound on every domain's k_max and the default of the
# engine's EngineConfig.max_draft_len, which imports it from here.
MAX_DRAFT_LEN = 16
# The prior acceptance rate of a drafter that a domain lists without one in `priors`.
DEFAULT_PRIOR = 0.5

_DOMAIN_NAME = re.compile(r"[a-z][a-z0-9_]*")


class PolicyError(ValueError):
    """A policy that cannot be used: bad YAML, a bad field, or a drafter the engine lacks.
    The message is one line naming the field path and the bad value."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class DomainPolicy(_Strict):
    """How one domain is served: which drafters it may use, k bounds, priors, fallback to plain."""

    drafters: list[str] = Field(
        min_length=1,
        description=f"drafters this domain may use, by engine name; {PLAIN!r} is plain decoding",
    )
    k_min: int = Field(1, ge=1, description="smallest draft length the selector may choose")
    k_max: int = Field(8, ge=1, le=MAX_DRAFT_LEN, description="largest draft length the selector may choose")
    priors: dict[str, float] = Field(
        default_factory=dict,
        description=f"drafter -> prior acceptance rate in [0, 1], used until live statistics accrue; "
                    f"unlisted drafters get {DEFAULT_PRIOR}",
    )
    fallback_threshold: float = Field(
        1.0, gt=0, description="predicted speedup below which the request falls back to plain decoding"
    )
    hysteresis: float = Field(
        0.05, ge=0,
        description="leave plain decoding only when predicted speedup > fallback_threshold + hysteresis",
    )
    cheap_first: bool = Field(
        False,
        description="each step, try a cheap drafter (prompt lookup) before the chosen drafter or plain decoding: "
                    "its proposal takes the step when it has one and the cheap drafter's acceptance, given that "
                    "it proposes, predicts a better step than the choice",
    )

    @model_validator(mode="after")
    def _check(self) -> DomainPolicy:
        # messages start with the field name; the loader prefixes the domain's path
        for i, name in enumerate(self.drafters):
            if not name.strip():
                raise ValueError(f"drafters.{i}: drafter name is empty (got {name!r})")
        if dups := sorted({d for d in self.drafters if self.drafters.count(d) > 1}):
            raise ValueError(f"drafters: {', '.join(map(repr, dups))} listed more than once (got {self.drafters})")
        if self.k_max < self.k_min:
            raise ValueError(f"k_max: {self.k_max} is below k_min {self.k_min}")
        for name, prior in self.priors.items():
            if name not in self.drafters:
                raise ValueError(f"priors.{name}: {name!r} is not in this domain's drafters {self.drafters}")
            if name == PLAIN:
                raise ValueError(f"priors.{name}: plain decoding drafts nothing and takes no prior (got {prior})")
            if not 0.0 <= prior <= 1.0:
                raise ValueError(f"priors.{name}: {prior} is outside [0, 1]")
        return self


class Rule(_Strict):
    """A classifier override: a prompt matching `regex` (Python syntax, searched anywhere; use
    (?i) for case-insensitive) or containing any of `keywords` (case-insensitive) is `domain`."""

    domain: str = Field(description="the domain a matching prompt gets; must be in domains")
    regex: str | None = Field(None, description="a Python regular expression")
    keywords: list[str] | None = Field(None, description="non-empty list of case-insensitive substrings")

    @model_validator(mode="after")
    def _check(self) -> Rule:
        if (self.regex is None) == (self.keywords is None):
            got = "both" if self.regex is not None else "neither"
            raise ValueError(f"regex: a rule takes either regex or keywords, not {got}")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as e:
                raise ValueError(f"regex: bad regular expression {self.regex!r}: {e}") from None
        if self.keywords is not None:
            if not self.keywords:
                raise ValueError("keywords: empty list (got [])")
            for i, word in enumerate(self.keywords):
                if not word.strip():
                    raise ValueError(f"keywords.{i}: empty keyword (got {word!r})")
        return self

    @property
    def pattern(self) -> re.Pattern[str] | None:
        """The compiled regex (re caches compilations), or None for a keyword rule."""
        return None if self.regex is None else re.compile(self.regex)


class ClassifierSettings(_Strict):
    model: str | None = Field(None, description="trained domain classifier; null: rules and default_domain only")
    min_confidence: float = Field(
        0.5, ge=0.0, le=1.0, description="below this classifier confidence the default_domain applies"
    )
    rules: list[Rule] = Field(default_factory=list, description="overrides, tried in order before the model")


class ExplorationSettings(_Strict):
    method: Literal["ucb", "thompson"] = Field("ucb", description="how arms with thin statistics are explored")
    ucb_c: float = Field(1.0, ge=0.0, description="UCB exploration weight (ucb only)")
    min_samples: int = Field(20, ge=0, description="draft steps below which an arm counts as unexplored")
    probe_every_steps: int = Field(
        32, ge=1, description="while on plain decoding, probe a drafter every this many steps to come back"
    )


class WindowSettings(_Strict):
    seconds: float = Field(300.0, gt=0, description="live statistics older than this are forgotten")
    min_draft_tokens: int = Field(
        64, ge=0, description="draft tokens a window needs before its statistics override the priors"
    )


class Policy(_Strict):
    version: str = Field(min_length=1, description="returned with every response; bump it on each change")
    default_domain: str = Field(description="the domain when no rule matches and the classifier is unsure")
    domains: dict[str, DomainPolicy] = Field(min_length=1, description="domain name -> how it is served")
    classifier: ClassifierSettings = ClassifierSettings()
    exploration: ExplorationSettings = ExplorationSettings()
    window: WindowSettings = WindowSettings()

    @field_validator("version", mode="before")
    @classmethod
    def _number_version(cls, value: Any) -> Any:
        # `version: 2` or `version: 1.1` in YAML means the string
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> Policy:
        if not self.version.strip():
            raise ValueError(f"version: empty (got {self.version!r})")
        for name in self.domains:
            if not _DOMAIN_NAME.fullmatch(name):
                raise ValueError(f"domains.{name}: domain names are lowercase identifiers (got {name!r})")
        known = ", ".join(self.domains)
        if self.default_domain not in self.domains:
            raise ValueError(f"default_domain: {self.default_domain!r} is not a domain (domains: {known})")
        for i, rule in enumerate(self.classifier.rules):
            if rule.domain not in self.domains:
                raise ValueError(f"classifier.rules.{i}.domain: {rule.domain!r} is not a domain (domains: {known})")
        return self


def describe_errors(e: ValidationError, root: str = "policy") -> str:
    """One line naming every bad field path and the value it got (`root` names a top-level error)."""
    parts = []
    for err in e.errors():
        path = ".".join(str(p) for p in err["loc"])
        if err["type"] == "value_error":  # ours: the message starts with the field, names the value
            msg = str(err["ctx"]["error"])
            parts.append(f"{path}.{msg}" if path else msg)
        elif err["type"] == "missing":
            parts.append(f"{path}: required field is missing")
        else:
            got = repr(err.get("input"))
            got = got if len(got) <= 80 else got[:77] + "..."
            parts.append(f"{path or root}: {err['msg']} (got {got})")
    return "; ".join(parts)


def load_policy(text_or_path: str | Path | Mapping[str, Any]) -> Policy:
    """A validated Policy from a file (a Path, or a str ending in .yaml/.yml), YAML text, or an
    already parsed mapping. Raises PolicyError naming the problem."""
    source = "policy"
    data: Any = text_or_path
    if isinstance(text_or_path, str) and "\n" not in text_or_path and text_or_path.endswith((".yaml", ".yml")):
        text_or_path = Path(text_or_path)
    if isinstance(text_or_path, Path):
        source = f"policy {text_or_path}"
        try:
            text_or_path = text_or_path.read_text()
        except OSError as e:
            raise PolicyError(f"cannot read {source}: {e.strerror}") from None
        except UnicodeDecodeError as e:  # a binary or corrupted file
            raise PolicyError(f"{source} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    if isinstance(text_or_path, str):
        try:
            data = yaml.safe_load(text_or_path)
        except yaml.YAMLError as e:
            detail = " ".join(str(e).split())
            raise PolicyError(f"{source} is not valid YAML: {detail}") from None
    if not isinstance(data, Mapping):
        raise PolicyError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Policy.model_validate(dict(data))
    except ValidationError as e:
        where = f"{source}: " if source != "policy" else ""
        raise PolicyError(where + describe_errors(e)) from None


@dataclass(frozen=True)
class UsablePolicy:
    policy: Policy  # the domains' drafter lists cut to the engine's (and their priors)
    ignored: tuple[str, ...]  # one line per drafter named but not configured, naming its fields


def check_policy_drafters(policy: Policy, configured: set[str]) -> UsablePolicy:
    """The policy as an engine with `configured` drafters runs it. A drafter a domain names but
    the engine lacks is ignored and reported (one policy then serves deployments with different
    drafters, e.g. the shipped one on an engine without trained drafters); a domain left with
    nothing it can run is refused. Plain decoding (PLAIN) is always available."""
    available = set(configured) | {PLAIN}
    shown = ", ".join(sorted(available))
    fields_of: dict[str, list[str]] = {}  # a drafter the engine lacks -> the fields naming it
    problems: list[str] = []
    domains: dict[str, DomainPolicy] = {}
    for domain, dp in policy.domains.items():
        missing = [name for name in dp.drafters if name not in available]
        for name in missing:
            fields_of.setdefault(name, []).append(f"domains.{domain}.drafters")
        kept = [name for name in dp.drafters if name in available]
        if not kept:
            problems.append(f"domains.{domain}.drafters: none of {dp.drafters} is configured in the engine "
                            f"(configured: {shown})")
            continue
        priors = {name: p for name, p in dp.priors.items() if name in kept}
        domains[domain] = dp.model_copy(update={"drafters": kept, "priors": priors}) if missing else dp
    if problems:
        raise PolicyError("; ".join(problems))
    ignored = tuple(f"{', '.join(fields)}: {name!r} is not configured in the engine (configured: {shown})"
                    for name, fields in fields_of.items())
    return UsablePolicy(policy.model_copy(update={"domains": domains}) if ignored else policy, ignored)
