"""Micro-benchmark of the CPU matmul paths a QuantizedLinear can take.

`python -m servelm.quant.microbench [--threads 1 2] [--tokens 1 64] [--iters 5]` times
y = x @ W.T at the default model's (SmolLM2-135M) linear shapes, per path, in microseconds
per layer. Each shape is cycled over enough copies (~200 MB of fp32) that the weights come
from memory, not cache, as in a real decode step. A guide for choosing a fast path, not a
test: numbers on a shared machine are noisy (repeat, compare medians).

Paths: float32 / bfloat16 dense matmul; int8 (per channel) and int4-g32 / int4-g128 on
servelm's C++ kernels (float32 activations, the default); int8 and int4-g32 on aten's packed
ops with bf16 activations ("/aten", the fallback where the C++ kernels do not build).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from servelm.quant.int4_linear import Int4Linear, quantize_int4_groups
from servelm.quant.int8_linear import Int8Linear, quantize_int8_per_channel

# (name, out_features, in_features) of SmolLM2-135M's linear layers, lm_head last.
SHAPES = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
          ("lm_head", 49152, 576)]
PATHS = ["float32", "bfloat16", "int8", "int4-g32", "int4-g128", "int8/aten", "int4-g32/aten"]
_POOL_BYTES = 200 * 2**20


def _build(path: str, weight: torch.Tensor):
    kernel = "aten" if path.endswith("/aten") else "cpu"
    name = path.removesuffix("/aten")
    if name == "float32":
        return lambda x: x @ weight.t()
    if name == "bfloat16":
        w = weight.to(torch.bfloat16)
        return lambda x: (x.to(torch.bfloat16) @ w.t()).float()
    if name == "int8":
        q, scale = quantize_int8_per_channel(weight, torch.bfloat16)
        return Int8Linear(q, scale, None, torch.bfloat16, kernel)
    group = int(name.split("-g")[1])
    q, scale, zero = quantize_int4_groups(weight, group, torch.bfloat16)
    return Int4Linear(q, scale, zero, group, None, torch.bfloat16, kernel)


def _time_us(layers, x, iters: int) -> float:
    def one_pass():
        for layer in layers:
            layer(x)

    one_pass()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        one_pass()
        samples.append((time.perf_counter() - start) / len(layers))
    return statistics.median(samples) * 1e6


def run(threads: list[int], tokens: list[int], iters: int):
    gen = torch.Generator().manual_seed(0)
    for name, out_f, in_f in SHAPES:
        copies = max(1, _POOL_BYTES // (out_f * in_f * 4))
        weights = [torch.randn(out_f, in_f, generator=gen) * 0.05 for _ in range(copies)]
        layers = {p: [_build(p, w) for w in weights] for p in PATHS}
        for num_threads in threads:
            torch.set_num_threads(num_threads)
            for t in tokens:
                x = torch.randn(t, in_f, generator=gen)
                us = {}
                with torch.inference_mode():
                    for p in PATHS:
                        us[p] = _time_us(layers[p], x, iters)
                yield num_threads, name, t, us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64])
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    print("thr shape      T " + " ".join(f"{m:>12}" for m in PATHS) + "   (us/layer, median)")
    for num_threads, name, t, us in run(a.threads, a.tokens, a.iters):
        print(f"{num_threads:>3} {name:<8} {t:>3} " + " ".join(f"{us[m]:>12.0f}" for m in PATHS),
              flush=True)


if __name__ == "__main__":
    main()
