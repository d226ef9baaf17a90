"""The verification cost curve T(1 + k) / T(1) and the plain step's memory-bandwidth floor.

Speculation pays only where verifying k drafted tokens costs little more than one plain step:
the curve says how much more. A plain step must at least stream every weight once, so weight
bytes / memory bandwidth is a floor; plain_step_s / floor_s says how far the step is from it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from workers.models.base import CausalLM, synchronize
from workers.models.llama import FastLlama, Product

DEFAULT_KS = range(0, 17)
DEFAULT_REPS = 10
BANDWIDTH_BYTES = 1 << 30  # far larger than any cache, so the copy measures memory


def weight_bytes(model: CausalLM) -> int:
    """Bytes a plain step streams: every weight matrix and norm vector once. The input
    embedding is not streamed (a step reads one row of it) unless it doubles as the lm_head."""
    if isinstance(model, FastLlama):
        # every field of every layer (whatever the fields are called), then the head: a product
        # counts what it streams in its format (`nbytes`), a norm its vector
        parts = [v for layer in model.layers for v in vars(layer).values()] + [model.final_norm, model.lm_head]
        return sum(p.nbytes if isinstance(p, Product) else p.numel() * p.element_size() for p in parts
                   if isinstance(p, Product | torch.Tensor))
    hf = getattr(model, "model", None)
    if isinstance(hf, torch.nn.Module):
        total = sum(p.numel() * p.element_size() for p in hf.parameters())  # tied weights once
        embed, head = hf.get_input_embeddings().weight, hf.get_output_embeddings().weight
        if embed.data_ptr() != head.data_ptr():
            total -= embed.numel() * embed.element_size()
        return total
    raise TypeError(f"cannot count the weight bytes of {type(model).__name__}")


def measure_bandwidth(
    device: torch.device, num_bytes: int = BANDWIDTH_BYTES, reps: int = DEFAULT_REPS,
) -> float:
    """Memory bandwidth in bytes/s from a large tensor copy (bytes read + bytes written). A copy
    also reads dst before writing it (write-allocate) on most CPUs, so this errs low."""
    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of dst: page faults are not bandwidth
    times = []
    for _ in range(reps):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    # the fastest copy: interference from other processes only ever slows a copy down, and the
    # floor is about what the memory system can do
    return 2 * src.numel() * src.element_size() / min(times)


def measure_verify_curve(
    model: CausalLM, context_len: int = 200, ks: Sequence[int] = DEFAULT_KS, reps: int = DEFAULT_REPS,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
) -> dict:
    """The fastest of `reps` forwards over 1 + k tokens after context_len cached tokens, for each
    k (k = 0 is always measured: it is T(1)), reps interleaved over k so drift hits every k alike;
    plus the bandwidth floor of the plain step. The fastest, as the router's start-up calibration
    takes it: another process only ever slows a forward down, and on a shared 2-core machine a
    median of a few still moved the curve by 10% between runs."""
    ks = sorted({0, *ks})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.info.vocab_size, (context_len + 1 + ks[-1],), generator=gen).to(model.device)
    cache = model.new_cache(context_len + 1 + ks[-1])
    model.forward(ids[:context_len], cache, last_only=True)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for rep in range(reps + 1):  # rep 0 warms up every shape
        for k in ks:
            synchronize(model.device)
            t0 = time.perf_counter()
            model.forward(ids[context_len : context_len + 1 + k], cache)
            synchronize(model.device)
            if rep:
                samples[k].append(time.perf_counter() - t0)
            cache.truncate(context_len)
    step_s = [min(samples[k]) for k in ks]

    num_weight_bytes = weight_bytes(model)
    bandwidth = measure_bandwidth(model.device, bandwidth_bytes, reps)
    floor_s = num_weight_bytes / bandwidth
    return {
        "context_len": context_len,
        "reps": reps,
        "ks": ks,
        "step_s": step_s,
        "ratio": [t / step_s[0] for t in step_s],
        "bandwidth_floor": {
            "weights_bytes": num_weight_bytes,
            "bandwidth_gb_s": bandwidth / 1e9,
            "floor_s": floor_s,
            "plain_step_s": step_s[0],
            "floor_fraction": floor_s / step_s[0],  # 1.0 = the step runs at the bandwidth limit
        },
    }
