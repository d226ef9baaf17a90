"""`specroute train-drafter --kind eagle` end to end on the tiny target (seconds), and its corpus."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from router.cli import main
from training.corpus import (
    CorpusError,
    build_corpus,
    parse_sources,
    read_chat_pairs,
    render_chat,
    spec_bench_prompts,
    stdlib_files,
)
from training.features import FeatureSet, select_draft_vocab, vocab_coverage
from workers.config import EagleDrafterConfig, EngineConfig, TargetConfig
from workers.drafters.eagle import EagleNet
from workers.sampling import SamplingParams

SMALL = ["--data", "pydoc", "--max-tokens", "4000", "--chunk-len", "256", "--seq-len", "64", "--batch", "4",
         "--lr", "1e-3", "--save-every", "3", "--draft-vocab", "2048"]


def train(target: Path, out: Path, *extra: str) -> int:
    return main(["train-drafter", "--kind", "eagle", "--target", str(target), *SMALL, "--out", str(out), *extra])


@pytest.fixture(scope="module")
def trained(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("eagle") / "drafter"
    assert train(tiny_llama_dir, out, "--steps", "6") == 0
    return out


def record(out: Path) -> dict:
    return json.loads((out / "config.json").read_text())["specroute_training"]


def test_output_is_an_eagle_checkpoint_with_a_card(trained: Path, tiny_llama_dir: Path) -> None:
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    net = EagleNet.load(trained, config["hidden_size"], config["vocab_size"])
    assert net.lm_head is not None and net.lm_head.weight.shape == (2048, config["hidden_size"])
    vocab = net.draft_vocab
    assert len(set(vocab.tolist())) == 2048 and int(vocab.min()) >= 0 and int(vocab.max()) < config["vocab_size"]
    assert config["eos_token_id"] in vocab[:2].tolist()  # the end-of-sequence token always has a row
    rec = record(trained)
    assert rec["step"] == 6 and rec["corpus"]["tokens"] == 4000
    assert rec["corpus"]["sources"] == {"pydoc": {"documents": rec["corpus"]["sources"]["pydoc"]["documents"], "tokens": 4000}}
    assert 0.5 < rec["draft_vocab"]["coverage"] <= 1.0 and rec["draft_vocab"]["head"] == "frozen"
    card = (trained / "CARD.md").read_text()
    for needle in ("pydoc", "4000", "--steps 6", "Draft vocabulary", "| math_reasoning |", "complete"):
        assert needle in card


def test_training_lowers_the_held_out_loss(trained: Path) -> None:
    rec = record(trained)
    before, after = rec["eval_initial"], rec["eval_final"]
    assert before["pairs"] == after["pairs"] > 0  # the same held-out windows, before and after
    assert after["loss"] < before["loss"], (before, after)
    assert after["reg"] < before["reg"]


def test_frozen_head_keeps_the_targets_rows(trained: Path, tiny_llama_dir: Path) -> None:
    weights = load_file(str(trained / "model.safetensors"))
    target = load_file(str(tiny_llama_dir / "model.safetensors"))
    lm_head = target.get("lm_head.weight", target["model.embed_tokens.weight"])  # tied
    torch.testing.assert_close(weights["lm_head.weight"], lm_head[weights["draft_vocab"]])


def test_engine_drafts_with_it_and_stays_lossless(trained: Path, tiny_llama_dir: Path) -> None:
    from workers.engine import SpecEngine

    config = EngineConfig(target=TargetConfig(model=str(tiny_llama_dir), max_model_len=512),
                          drafters=[EagleDrafterConfig(path=str(trained))])
    engine = SpecEngine.from_config(config)
    drafted = 0
    for text in ("Write a Python function that sorts a list.", "Explain the with statement."):
        prompt = engine.encode(text)
        params = SamplingParams(max_tokens=24)
        plain, spec = engine.generate(prompt, params), engine.generate(prompt, params, "eagle", 4)
        assert spec.token_ids == plain.token_ids and spec.text == plain.text
        drafted += spec.num_draft_tokens
    assert drafted > 0


def test_resume_repeats_the_uninterrupted_run(trained: Path, tiny_llama_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "resumed"
    assert train(tiny_llama_dir, out, "--steps", "6", "--stop-at", "4") == 0
    assert json.loads((out / "train_state" / "state.json").read_text())["step"] == 4
    assert "partial: step 4 of 6" in (out / "CARD.md").read_text()
    capsys.readouterr()
    assert train(tiny_llama_dir, out, "--steps", "6") == 2  # a run is there: --resume or another --out
    assert "--resume" in capsys.readouterr().err
    assert train(tiny_llama_dir, out, "--steps", "6", "--resume", "--noise", "0.2") == 2
    assert "--noise 0.2" in capsys.readouterr().err
    assert train(tiny_llama_dir, out, "--steps", "6", "--resume") == 0
    assert record(out)["step"] == 6 and len(record(out)["sessions"]) == 2
    got, want = load_file(str(out / "model.safetensors")), load_file(str(trained / "model.safetensors"))
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["eagle", "medusa", "model"])
def test_eval_data_holds_out_a_separate_corpus(kind: str, tiny_llama_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    chat = tmp_path / "unseen.jsonl"
    chat.write_text("".join(json.dumps({"prompt": f"Tell me about the number {i}.", "answer": f"{i} is a number. " * 20})
                            + "\n" for i in range(8)))
    out = tmp_path / kind
    argv = ["train-drafter", "--kind", kind, "--target", str(tiny_llama_dir), "--data", "pydoc", "--max-tokens", "2000",
            "--chunk-len", "128", "--seq-len", "32", "--batch", "2", "--steps", "2", "--draft-vocab", "512",
            "--eval-data", f"chat:{chat}", "--eval-windows", "3", "--out", str(out)]
    assert main([*argv, "--stop-at", "1"]) == 0
    assert (out / "train_state" / "eval_features.safetensors").is_file()  # the resume evaluates on the same text
    capsys.readouterr()
    assert main([*argv, "--resume"]) == 0
    assert re.search(r"held out features: \d+ tokens from \S+eval_features", capsys.readouterr().err)  # not rerun
    rec = json.loads((out / "config.json").read_text())["specroute_training"]
    windows = rec["windows"]
    assert windows["held_out"] == 3 and windows["held_out_from"] == f"--eval-data chat:{chat}"
    assert list(windows["held_out_sources"]) == [f"chat:{chat}"]
    assert windows["held_out_sources"][f"chat:{chat}"]["tokens"] <= 3 * 32  # what three windows can hold
    # every window of the training corpus trains
    assert windows["train"] == len(FeatureSet.load(out / "train_state" / "features.safetensors").windows(32))
    assert rec["eval_initial"] and rec["eval_final"]
    assert f"3 held out (never trained on; `--eval-data chat:{chat}`, a separate corpus of" in (out / "CARD.md").read_text()
    argv[argv.index("--eval-data") + 1] = "pydoc"  # the training text itself
    assert main([*argv[:-1], str(tmp_path / "overlap")]) == 2
    assert "--eval-data: pydoc is in the training corpus too" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--kind", "lora"], "unknown drafter kind 'lora'"),
    (["--kind", "medusa", "--noise", "0.2", "--train-head"], "--noise, --train-head: not an option of --kind medusa"),
    (["--kind", "eagle", "--num-heads", "2"], "--num-heads: not an option of --kind eagle"),
    (["--kind", "model", "--num-heads", "2"], "--num-heads: not an option of --kind model"),
    (["--kind", "model", "--num-layers", "2", "--init-layers", "0,1,5"], "--init-layers names 3 layers"),
    (["--data", "pydoc,chat:missing.jsonl"], "missing.jsonl"),
    (["--data", "wikipedia"], "unknown source 'wikipedia'"),
    (["--data", ""], "--data is empty"),
    (["--eval-data", "chat:missing.jsonl"], "missing.jsonl"),
    (["--eval-data", "stdlib", "--eval-windows", "0"], "--eval-data needs --eval-windows > 0"),
    (["--steps", "4", "--stop-at", "5"], "--stop-at"),
    (["--lr", "0"], "--lr and --grad-clip must be positive"),  # a given 0 reaches the trainer, not its default
    (["--init", "nowhere"], "--init must be one of target, random or an EAGLE checkpoint folder; no nowhere/config.json"),
    ([], "no such directory"),  # the target
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--data", "pydoc", *argv] if "--data" not in argv else argv
    code = main(["train-drafter", "--target", str(tmp_path / "no-model"), "--out", str(tmp_path / "o"), *argv])
    err = capsys.readouterr().err
    assert code == 2 and needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


# -- corpus ------------------------------------------------------------------------------------------
def test_stdlib_files_skip_tests_and_site_packages() -> None:
    files = stdlib_files()
    assert len(files) > 300 and files == sorted(files)
    parts = {p for f in files for p in f.parts}
    assert not {"test", "tests", "idle_test", "site-packages"} & parts
    assert not any(f.name.startswith("test_") for f in files)
    assert any(f.name == "functools.py" for f in files)


def test_chat_pairs_render_and_refuse_held_out_spec_bench(tmp_path: Path, tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    bench = tmp_path / "question.jsonl"
    bench.write_text(json.dumps({"question_id": 5, "category": "qa", "turns": ["What is  the capital of France?"]}) + "\n"
                     + json.dumps({"question_id": 6, "category": "qa", "turns": ["Name a prime."]}) + "\n")
    banned = spec_bench_prompts(bench)  # held out: question_id % 5 == 0 only
    assert banned == {"what is the capital of france?"}
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"prompt": "Name a prime.", "answer": "7 is prime."}) + "\n\n")
    assert read_chat_pairs(chat, banned) == [("Name a prime.", "7 is prime.")]  # a train-split prompt is fine
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    text = render_chat(tok, "Name a prime.", "7 is prime.")
    assert text.index("Name a prime.") < text.index("7 is prime.") and "<|im_start|>assistant" in text
    chat.write_text(json.dumps({"prompt": "what is the capital of  france?", "answer": "Paris."}) + "\n")
    with pytest.raises(CorpusError, match=r"chat.jsonl:1: the prompt is a held-out Spec-Bench prompt"):
        read_chat_pairs(chat, banned)
    chat.write_text('{"prompt": "x"}\n')
    with pytest.raises(CorpusError, match=r"chat.jsonl:1: expected an object"):
        read_chat_pairs(chat)
    with pytest.raises(CorpusError, match="named twice"):
        parse_sources("pydoc,pydoc")


def test_corpus_is_deterministic_balanced_and_capped(tiny_llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    sources = parse_sources("stdlib,pydoc")
    a, b = build_corpus(sources, tok, 20_000, seed=3), build_corpus(sources, tok, 20_000, seed=3)
    assert a.documents == b.documents and a.num_tokens == 20_000
    tokens = {k: v["tokens"] for k, v in a.stats.items()}
    assert sum(tokens.values()) == 20_000 and min(tokens.values()) > 5_000  # both sources drawn
    assert build_corpus(sources, tok, 20_000, seed=4).documents != a.documents
    weighted = build_corpus(parse_sources("stdlib,pydoc*3"), tok, 20_000, seed=3)  # pydoc: 3/4 of the draw
    assert weighted.num_tokens == 20_000 and 13_000 < weighted.stats["pydoc"]["tokens"] < 17_000
    for bad in ("pydoc*0", "pydoc*x", "pydoc*-1"):
        with pytest.raises(CorpusError, match="weight"):
            parse_sources(bad)
    with pytest.raises(CorpusError, match="named twice"):
        parse_sources("pydoc,pydoc*2")


def test_draft_vocab_is_most_frequent_first() -> None:
    ids = torch.tensor([5, 5, 5, 2, 2, 9, 7, 7, 7, 7])
    vocab = select_draft_vocab(ids, 12, 4, first=[11])
    assert vocab.tolist() == [11, 7, 5, 2]  # forced first, then by count
    assert select_draft_vocab(ids, 12, 6).tolist() == [7, 5, 2, 9, 0, 1]  # ties and unseen by id
    assert vocab_coverage(ids, vocab) == pytest.approx(0.9)


def test_target_init_starts_as_the_identity(tiny_llama_dir: Path) -> None:
    from training.eagle import eagle_config_for, init_from_target
    from workers.config import ModelConfig
    from workers.target import load_model

    model = load_model(ModelConfig(model=str(tiny_llama_dir))).model
    vocab = torch.arange(10, 110)
    net = EagleNet(eagle_config_for(model, len(vocab)))
    init_from_target(net, model, vocab)
    feats = torch.randn(2, 7, model.info.hidden_size)
    embeds = model.embed[torch.randint(0, 1000, (2, 7))]
    with torch.no_grad():
        pred = net(embeds, feats, model.cos[:7], model.sin_signed[:7])
    torch.testing.assert_close(pred, feats)  # fc = [0 | I], zero output projections: f_t passes through
    q = net.layers[0].self_attn.q_proj.weight
    torch.testing.assert_close(q, model.layers[-1].qkv.w_t.t()[: q.shape[0]])  # reads like the target's last layer
    torch.testing.assert_close(net.lm_head.weight, model.lm_head.w_t[:, vocab].t())
    assert net.draft_vocab.tolist() == vocab.tolist()


# -- the training-time test (--unroll) ---------------------------------------------------------------
def test_unroll_mask_sees_what_drafting_sees() -> None:
    from training.eagle import unroll_mask

    # step 2, query 2 continues the draft that began after true pair 1: true keys 0..1, its own step-2 key
    assert unroll_mask(4, 2)[2].tolist() == [True, True, False, False] + [False, False, True, False]
    # step 3, query 3: true keys 0..1, the step-2 key of the same draft (2) and its own step-3 key (3)
    assert unroll_mask(4, 3)[3].tolist() == [True, True, False, False] + [False, False, True, False] + \
        [False, False, False, True]
    assert torch.equal(unroll_mask(5, 1), torch.ones(5, 5, dtype=torch.bool).tril())  # step 1: causal


def test_unrolled_steps_equal_drafting_with_the_cache(tiny_llama_dir: Path) -> None:
    """Step j of the parallel unroll at position s is exactly the j-th draft step run sequentially
    through the drafting cache from true pair s - j + 1, fed the head's own features."""
    from training.eagle import eagle_config_for, unrolled_predictions
    from workers.config import ModelConfig
    from workers.drafters.eagle import EagleCache
    from workers.target import load_model

    model = load_model(ModelConfig(model=str(tiny_llama_dir))).model
    torch.manual_seed(0)
    net = EagleNet(eagle_config_for(model, None)).eval()
    t, cfg = 9, net.cfg
    feats = torch.randn(1, t, cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (t,))
    embeds = model.embed[ids].float()[None]
    cos, sin = model.cos[:t].float(), model.sin_signed[:t].float()
    with torch.no_grad():
        preds = unrolled_predictions(net, embeds, feats, cos, sin, 3)
        for p in range(t - 2):  # a draft begins after true pair p
            shape = (cfg.num_key_value_heads, t, cfg.head_dim)
            cache = EagleCache(torch.empty(shape), torch.empty(shape))
            out = net(embeds[:, : p + 1], feats[:, : p + 1], cos[: p + 1], sin[: p + 1], cache)[:, -1:]
            torch.testing.assert_close(out[0, 0], preds[0][0, p], rtol=1e-4, atol=1e-4)
            for j in (2, 3):
                s = p + j - 1
                out = net(embeds[:, s : s + 1], out, cos[s : s + 1], sin[s : s + 1], cache)
                torch.testing.assert_close(out[0, 0], preds[j - 1][0, s], rtol=1e-4, atol=1e-4)


def test_unrolled_training_reports_later_draft_steps(tiny_llama_dir: Path, tmp_path: Path, trained: Path) -> None:
    out = tmp_path / "unrolled"
    features = trained / "train_state" / "features.safetensors"
    assert train(tiny_llama_dir, out, "--steps", "4", "--unroll", "2", "--features", str(features)) == 0
    rec = record(out)
    assert rec["corpus"]["tokens"] == record(trained)["corpus"]["tokens"]  # the other run's features, reused
    before, after = rec["eval_initial"], rec["eval_final"]
    assert {"top1", "top1_2"} <= after.keys() and after["loss"] < before["loss"]
    assert "top1_2" in record(trained)["eval_final"]  # EAGLE-1 runs report draft step 2 too
    card = (out / "CARD.md").read_text()
    assert "--unroll 2" in card and "draft step 2" in card
    # fine-tuning starts where the checkpoint ended: same features, same held-out windows, same loss
    tuned = tmp_path / "tuned"
    assert train(tiny_llama_dir, tuned, "--steps", "1", "--init", str(trained), "--features", str(features)) == 0
    assert record(tuned)["eval_initial"]["loss"] == pytest.approx(record(trained)["eval_final"]["loss"], rel=1e-4)
    assert f"from the EAGLE checkpoint `{trained}`" in (tuned / "CARD.md").read_text()

    from training.args import TrainError
    from training.eagle import EagleTrainArgs, train_eagle

    with pytest.raises(TrainError, match="--unroll must be at least 1"):
        train_eagle(EagleTrainArgs(target=str(tiny_llama_dir), data="pydoc", out=str(tmp_path / "bad"), unroll=0))


# -- gen-answers -------------------------------------------------------------------------------------
def test_read_prompts_keeps_the_train_split_only(tmp_path: Path) -> None:
    from training.answers import read_prompts

    bench = tmp_path / "question.jsonl"
    bench.write_text("".join(json.dumps({"question_id": q, "category": "qa", "turns": [f"Question {q}?", "More?"]}) + "\n"
                             for q in (1, 5, 6, 10)))
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"prompt": "Name a prime.", "category": "math"}) + "\n" + json.dumps({"prompt": "Question 6?"}) + "\n")
    rows, skipped = read_prompts([bench, own], 5, spec_bench=bench)
    assert [r.prompt for r in rows] == ["Question 1?", "Question 6?", "Name a prime."] and skipped == 2
    assert rows[0].id == "spec-bench-1" and rows[2].category == "math"
    assert len(read_prompts([bench, own], 5, limit=1, spec_bench=bench)[0]) == 1
    own.write_text(json.dumps({"prompt": "question  10?"}) + "\n")
    with pytest.raises(CorpusError, match=r"own.jsonl:1: the prompt is a held-out Spec-Bench prompt"):
        read_prompts([own], 5, spec_bench=bench)
    own.write_text('{"answer": "x"}\n')
    with pytest.raises(CorpusError, match=r"own.jsonl:1: expected"):
        read_prompts([own], 5, spec_bench=bench)


def test_gen_answers_writes_the_targets_greedy_answers_and_resumes(tiny_llama_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    texts = ["Name a prime.", "Write a haiku about rain, please.", "Sort [3, 1, 2]."]
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    out = tmp_path / "answers.jsonl"
    argv = ["gen-answers", "--target", str(tiny_llama_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "5", "--batch", "2"]
    assert main([*argv, "--limit", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["prompt"] for r in rows) == sorted(texts[:2])
    assert all(r["answer"] and 1 <= r["num_tokens"] <= 5 for r in rows)
    assert read_chat_pairs(out)  # the output is a chat source for train-drafter as it is
    # batched with left padding, each answer is the target's own greedy continuation: as the engine decodes alone
    from workers.engine import SpecEngine

    engine = SpecEngine.from_config(EngineConfig(target=TargetConfig(model=str(tiny_llama_dir), max_model_len=512)))
    for r in rows:
        plain = engine.generate(engine.encode(r["prompt"]), SamplingParams(max_tokens=5))
        assert engine.tokenizer.decode(plain.token_ids, skip_special_tokens=True).strip() == r["answer"]
    capsys.readouterr()
    assert main(argv) == 0  # continued: only the third prompt is answered now
    assert "2 already in" in capsys.readouterr().out
    assert sorted(json.loads(line)["prompt"] for line in out.read_text().splitlines()) == sorted(texts)
    assert main([*argv[:4], str(tmp_path / "none.jsonl"), *argv[5:]]) == 2
    assert "no file" in capsys.readouterr().err


def test_gen_answers_samples_several_answers_per_prompt(tiny_llama_dir: Path, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("Name a prime.", "Sort [3, 1, 2].")))
    out = tmp_path / "sampled.jsonl"
    argv = ["gen-answers", "--target", str(tiny_llama_dir), "--prompts", str(prompts), "--out", str(out),
            "--max-tokens", "8", "--batch", "3", "--temperature", "1.0"]
    assert main([*argv, "--samples", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["prompt"], r["sample"]) for r in rows) == [("Name a prime.", 0), ("Name a prime.", 1),
                                                                 ("Sort [3, 1, 2].", 0), ("Sort [3, 1, 2].", 1)]
    # a random tiny model at temperature 1 does not repeat itself: the samples are draws, not copies
    assert len({r["answer"] for r in rows}) > 2
    capsys.readouterr()
    assert main([*argv, "--samples", "3"]) == 0  # continued: only sample 2 of each prompt is new
    assert "4 already in" in capsys.readouterr().out
    assert sorted(json.loads(line)["sample"] for line in out.read_text().splitlines()) == [0, 0, 1, 1, 2, 2]
    assert main([*argv[:-2], "--samples", "2"]) == 2  # greedy answers to one prompt are all the same
    assert "--samples above 1 needs --temperature > 0" in capsys.readouterr().err
    assert main([*argv[:-1], "-0.5"]) == 2
    assert "--temperature must be >= 0" in capsys.readouterr().err
