"""Structured outputs under speculation: every verified row masked by the grammar's state after
the draft tokens before it, so greedy output equals guided plain decoding's for every drafter
kind, sampled output follows the masked distribution, and the output matches its format."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from helpers import assert_follows_joint, write_eagle, write_medusa_heads

from workers.batch import BatchEngine
from workers.config import (
    PLAIN,
    EagleDrafterConfig,
    EngineConfig,
    GrammarDrafterConfig,
    LookaheadDrafterConfig,
    MedusaDrafterConfig,
    ModelConfig,
    ModelDrafterConfig,
    NgramDrafterConfig,
    PredictionDrafterConfig,
    SuffixDrafterConfig,
    TreeConfig,
)
from workers.drafters.registry import build_drafter
from workers.engine import SpecEngine, StepOrder
from workers.result import RequestError
from workers.sampling import SamplingParams, probs_from_logits
from workers.structured import OutputFormat, format_error

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                                                         "maxItems": 3},
                   "n": {"type": "integer"}},
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}
DRAFTERS = ["grammar", "ngram", "self", "self_tree", "other", "suffix", "lookahead", "eagle", "medusa"]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: Path, tiny_drafter_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> SpecEngine:
    """The tiny target with a drafter of every kind: the target itself as a chain and as a tree
    (drafting without the grammar: a guided step cuts what it forbids), a sampled model of its own,
    training-free ones, EAGLE and Medusa heads."""
    target = ModelConfig(model=str(tiny_llama_dir))
    base = SpecEngine.from_config(EngineConfig.model_validate({
        "target": {"model": str(tiny_llama_dir), "max_model_len": 512},
        "drafters": [
            NgramDrafterConfig().model_dump(), PredictionDrafterConfig().model_dump(), GrammarDrafterConfig().model_dump(),
            SuffixDrafterConfig().model_dump(), LookaheadDrafterConfig().model_dump(),
            ModelDrafterConfig(name="self", model=target).model_dump(),
            ModelDrafterConfig(name="self_tree", model=target, tree=TreeConfig(topk=2, nodes=6)).model_dump(),
            ModelDrafterConfig(name="other", model=ModelConfig(model=str(tiny_drafter_dir))).model_dump(),
        ],
        "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 32},
    }))
    heads = [MedusaDrafterConfig(path=str(write_medusa_heads(tmp_path_factory.mktemp("m"), base))),
             EagleDrafterConfig(path=str(write_eagle(tmp_path_factory.mktemp("e"), base)))]
    extra = {c.name: build_drafter(c, base.target) for c in heads}
    return SpecEngine(base.target, {**base.drafters, **extra}, base.config)


def guided(fmt: OutputFormat, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 48, "output_format": fmt, **kw})


# -- formats and the guide ------------------------------------------------------------------------
def test_formats_compile_and_bad_ones_say_why() -> None:
    assert format_error(OutputFormat.json_schema(SCHEMA)) is None
    assert format_error(OutputFormat.json_schema()) is None
    assert format_error(OutputFormat("regex", r"\d{3}-[a-z]+")) is None
    assert format_error(OutputFormat.choice(['say "yes"', "no\\", "ünï\n"])) is None
    assert format_error(OutputFormat("grammar", 'start: "(" num ")"\nnum: /[0-9]+/')) is None
    assert "unclosed" in format_error(OutputFormat("regex", "[unclosed"))
    assert "foo" in format_error(OutputFormat.json_schema({"type": "foo"}))
    assert "nope" in format_error(OutputFormat("grammar", "start: nope"))
    assert "empty" in format_error(OutputFormat.choice([]))


def test_masks_follow_the_draft_and_leave_the_state_as_it_was(engine: SpecEngine) -> None:
    guide = engine.grammars.guide(OutputFormat.json_schema(SCHEMA), {2})
    first = guide.allowed()
    assert {engine.tokenizer.decode([t]) for t in first.nonzero()[0]} <= {"{", '{"', "{\n", " ", "\n", "  ", "{\n\n"} \
        or first.sum() < 20  # an object opens: a handful of spellings of "{"
    draft = engine.encode_text('{"name": "x"')
    masks = guide.masks(draft)
    assert masks.shape == (len(draft) + 1, engine.target.model.info.vocab_size)
    assert all(masks[r, t] for r, t in enumerate(draft))  # each draft token allowed where it stands
    assert not masks[len(draft), 2]  # the object is not closed: no end token yet
    assert (guide.allowed() == first).all()  # rolled back
    assert guide.valid_prefix(draft) == len(draft)
    bad = [*draft[:2], engine.encode_text("}")[0], *draft[2:]]
    assert guide.valid_prefix(bad) == 2
    cut = guide.masks(bad)
    assert not cut[2, bad[2]] and cut[3:].all()  # rows after the forbidden token: never read, all True
    for t in engine.encode_text('{"name": "x", "tags": [], "n": 7}'):
        assert guide.allowed()[t]
        guide.advance(t)
    assert guide.done and guide.allowed()[2]


# -- losslessness ---------------------------------------------------------------------------------
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("fmt", [OutputFormat.json_schema(SCHEMA), OutputFormat("regex", r"[^{}<>]{1,80}")],
                         ids=["schema", "text"])
def test_guided_greedy_output_is_guided_plain_output(engine: SpecEngine, drafter: str, fmt: OutputFormat) -> None:
    """A schema cuts most drafts before the forward; a regex of nearly any text lets the drafts
    through, for the masked rows to accept or reject."""
    prompt = engine.encode("Describe a user as JSON.")
    plain = engine.generate(prompt, guided(fmt))
    out = engine.generate(prompt, guided(fmt), drafter, 4)
    assert out.token_ids == plain.token_ids
    if fmt.kind == "json":
        assert plain.finish_reason == "stop"  # the grammar ended the output: a document of the schema
        jsonschema.validate(json.loads(plain.text), SCHEMA)
        unguided = engine.generate(prompt, SamplingParams(max_tokens=48), drafter, 4).token_ids
        assert unguided != plain.token_ids  # the grammar changed what the random target writes
    else:
        assert not set("{}<>") & set(plain.text)
        # ngram and suffix draft repeats only; nearly any text is free: nothing forced
        assert out.num_draft_tokens > 0 or drafter in ("ngram", "suffix", "grammar")


def test_the_grammar_drafter_drafts_what_the_format_forces(engine: SpecEngine) -> None:
    fmt = OutputFormat.json_schema(SCHEMA)
    guide = engine.grammars.guide(fmt, {2})
    for t in engine.encode_text('{"name": "x"'):
        guide.advance(t)
    # the next key, short of the " [" a longer token could merge with what follows
    assert engine.tokenizer.decode(guide.forced()) == ', "tags":'
    prompt = engine.encode("Describe a user as JSON.")
    plain = engine.generate(prompt, guided(fmt))
    out = engine.generate(prompt, guided(fmt), "grammar", 8)
    assert out.token_ids == plain.token_ids
    # the keys, quotes and separators: a third of the document or more, drafted and accepted
    assert out.num_accepted_tokens >= len(plain.token_ids) // 3
    assert out.num_accepted_tokens >= 0.9 * out.num_draft_tokens
    free = engine.generate(prompt, SamplingParams(max_tokens=16), "grammar", 8)
    assert free.num_draft_tokens == 0  # no format, nothing forced


def test_the_router_drafts_from_the_grammar_only_for_guided_requests(engine: SpecEngine) -> None:
    from policies.schema import load_policy
    from policies.stats import MemoryStats
    from workers.routing import RoutedBatch, Router, Speculation, generate

    policy = load_policy({
        "version": "t", "default_domain": "chat",
        "domains": {"chat": {"drafters": ["grammar", "ngram", "self", "none"], "k_min": 1, "k_max": 8,
                             "priors": {"grammar": 0.9, "ngram": 0.5, "self": 0.5}, "cheap_first": True}},
        "classifier": {"rules": []},
    })
    router = Router(engine, policy, MemoryStats(), seed=0)
    prompt = engine.encode("Describe a user as JSON.")
    free, fmt = SamplingParams(max_tokens=24), guided(OutputFormat.json_schema(SCHEMA))
    bare = router.start(prompt, free, "text", Speculation())
    assert "grammar" not in bare.cheap.shadow and "grammar" not in bare.plan.estimates
    bare.close()
    plain = engine.generate(prompt, fmt).token_ids
    result = generate(router, prompt, fmt, "text")
    assert result.token_ids == plain and "grammar" in result.drafters
    batch = RoutedBatch(router)
    running = [batch.add(prompt, q, "text", Speculation()) for q in (fmt, free, fmt)]
    while batch.num_running or batch.num_waiting:
        batch.step()
    assert [r.result().token_ids for r in running] == [plain, engine.generate(prompt, free).token_ids, plain]


def test_a_draft_of_the_guided_output_is_accepted_whole(engine: SpecEngine) -> None:
    prompt = engine.encode("Pick one.")
    fmt = OutputFormat("regex", r"(alpha|beta|gamma) [0-9]{6}")
    plain = engine.generate(prompt, guided(fmt))
    assert re.fullmatch(r"(alpha|beta|gamma) [0-9]{6}", plain.text) and plain.finish_reason == "stop"
    # the grammar's end needs no forward of its own: one step a token, none for the end token
    assert plain.num_steps == len(plain.token_ids)
    out = engine.generate(prompt, guided(fmt, prediction=tuple(plain.token_ids)), "prediction", 8)
    assert out.token_ids == plain.token_ids
    # every draft accepted whole (the last step ends where the grammar does, before its bonus token)
    assert out.prediction is not None and out.prediction.rejected == 0
    assert out.num_accepted_tokens >= len(plain.token_ids) - out.num_steps


@pytest.mark.parametrize("drafter", ["prediction", "other"])
def test_guided_sampling_follows_the_masked_distribution(engine: SpecEngine, drafter: str) -> None:
    """Two sampled tokens under a two-digit regex: the pairs follow the target's distribution
    masked at each position, drafted deterministically (a draft token the grammar allows, then
    one it forbids) or by a sampled model (whose proposals the grammar mostly forbids)."""
    fmt = OutputFormat("regex", "[1-3][4-6]")
    params = SamplingParams(max_tokens=2, temperature=1.5, output_format=fmt)
    prompt = engine.encode("Numbers:", chat=False)
    digit = {d: engine.encode_text(d)[0] for d in "1234569"}
    model = engine.target.model
    guide = engine.grammars.guide(fmt, set())
    cache = model.new_cache(len(prompt) + 2)
    first = model.forward(torch.tensor(prompt), cache, last_only=True).logits[0]
    p1 = probs_from_logits(first.masked_fill(~torch.from_numpy(guide.allowed()), float("-inf"))[None], params)[0]
    joint = {}
    for a in p1.nonzero().flatten().tolist():
        cache.truncate(len(prompt))
        guide.advance(a)
        second = model.forward(torch.tensor([a]), cache).logits[0]
        p2 = probs_from_logits(second.masked_fill(~torch.from_numpy(guide.allowed()), float("-inf"))[None], params)[0]
        guide.matcher.rollback(1)
        joint |= {(a, b): p1[a].item() * p2[b].item() for b in p2.nonzero().flatten().tolist()}
    assert len(joint) == 9 and {a for a, _ in joint} == {digit[d] for d in "123"}

    prediction = (digit["2"], digit["9"])
    results = assert_follows_joint(joint, 600, lambda seed: engine.generate(
        prompt, SamplingParams(max_tokens=2, temperature=1.5, output_format=fmt, seed=seed, prediction=prediction),
        drafter, 2))
    assert all(r.finish_reason == "stop" for r in results)  # the two digits complete the grammar
    if drafter == "prediction":  # "9" cut before the forward: one draft token a request, accepted or not
        assert {r.steps[0].num_draft_tokens for r in results} == {1}
        assert 0 < sum(r.num_accepted_tokens for r in results) < len(results)


def test_guided_and_free_requests_share_a_batch_losslessly(engine: SpecEngine) -> None:
    prompts = [engine.encode(t) for t in ("Describe a user.", "Tell me a story.", "Pick one.", "hi")]
    formats = [OutputFormat.json_schema(SCHEMA), None, OutputFormat.choice(["red", "green", "blue"]), None]
    orders = [StepOrder("self", 3), StepOrder("ngram", 4), StepOrder("other", 2), StepOrder("self_tree", 3)]
    params = [SamplingParams(max_tokens=32, output_format=f) for f in formats]
    alone = [engine.generate(p, q).token_ids for p, q in zip(prompts, params)]
    batch = BatchEngine(engine)
    gens = [batch.add(p, q) for p, q in zip(prompts, params)]
    while batch.num_unfinished:
        step = batch.step({g: o for g, o in zip(gens, orders) if g in batch.schedule()})
        assert not step.failed
    assert [g.output_ids for g in gens] == alone
    assert engine.tokenizer.decode(alone[2], skip_special_tokens=True) in {"red", "green", "blue"}


def test_a_format_that_does_not_compile_is_refused_naming_the_field(engine: SpecEngine) -> None:
    with pytest.raises(RequestError) as info:
        engine.generate(engine.encode("hi"), guided(OutputFormat("regex", "(")))
    assert info.value.param == "response_format" and "regex" in info.value.message


def test_the_shipped_target_writes_a_document_of_the_schema(real_engine) -> None:
    """The integration model with the shipped drafters: greedy guided output is valid JSON of the
    schema, identical with prompt lookup and the router's choice of drafters."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"},
                                               "country": {"type": "string"}},
              "required": ["city", "population", "country"], "additionalProperties": False}
    prompt = real_engine.encode("Give the city, country and population of Paris as JSON.")
    params = SamplingParams(max_tokens=64, output_format=OutputFormat.json_schema(schema))
    plain = real_engine.generate(prompt, params)
    assert plain.finish_reason == "stop"
    document = json.loads(plain.text)
    jsonschema.validate(document, schema)
    assert "Paris" in document["city"]
    assert real_engine.generate(prompt, params, "ngram", 6).token_ids == plain.token_ids
    assert real_engine.generate(prompt, params, PLAIN, 0).token_ids == plain.token_ids
