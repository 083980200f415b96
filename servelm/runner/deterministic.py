"""Deterministic mode (the engine option --deterministic; docs/determinism.md).

Owns: checking that a built model, KV cache and attention backend can keep the promise (the
same request gives the same tokens and logprobs whatever else the engine is doing), and
switching them to the batch-invariant path. On the CPU (attention backend 'torch'), in the
model's dtype, float32 or bfloat16:

    linears     float32: DetLinear (servelm/layers/det_linear.py), one fixed-order sum per
                element; bfloat16: servelm's bfloat16 GEMM at every row count, never oneDNN
                (DotLinear on avx512_bf16, AmxLinear where AMX runs; the head a DotLinear
                returning its float32 sums): each element one sum over K in a fixed order
    attention   one C++ paged-kernel row per query token, prefill and decode alike
                (TorchAttentionBackend.set_deterministic), over a cache in the model's dtype
    decode      the C++ stack takes every step, prefill included (runner/cpu_decode.py)
    norms, rotary, SiLU   servelm's fused kernels (fixed per-row order, cpu_kernels/layer_ops)

On the GPU (attention backend 'triton'):

    linears     TritonDetLinear: fixed tiles, K summed tile by tile in order, no split-K
    norms       one Triton program per row (servelm/kernels/batch_invariant.py)
    attention   one decode-kernel row per query token with fixed 256-key splits combined in
                order (TritonAttentionBackend.set_deterministic)
    rotary, SiLU, residual adds, embedding   elementwise or gathers: per row by nature

Every per-row computation then depends on the row's token, position and cached context only:
not on the batch size, the row's place in it, the prompt's chunking, prefix-cache hits,
preemption and recompute, or speculative verification.
Never: falls back silently. A configuration it cannot make batch-invariant (quantized or MoE
layers, sliding-window or soft-capped attention, MLA, CUDA graphs, on the CPU float16, bfloat16
without servelm's bfloat16 GEMM, or the torch paths of the CPU kernels) is a ValueError naming
what to change.
"""

from __future__ import annotations

import torch

from servelm import cpu_kernels


def enable_deterministic(model: torch.nn.Module, config, backend, device: torch.device,
                         graphs=None) -> None:
    kernel = check_supported(model, config, backend, device, graphs)
    from servelm.layers.det_linear import make_deterministic

    make_deterministic(model, kernel)
    backend.set_deterministic()


def check_supported(model, config, backend, device: torch.device, graphs=None) -> str:
    """The kernel family that makes this configuration batch-invariant ('cpu' or 'triton'),
    or a ValueError naming what to change."""
    from servelm.attention.torch_backend import TorchAttentionBackend
    from servelm.layers.det_linear import cpu_linear_kind

    def refuse(why: str) -> None:
        raise ValueError(f"--deterministic: {why}")

    name = getattr(backend, "name", type(backend).__name__)
    if graphs is not None:
        refuse("CUDA graphs pad the batch and fix attention splits per graph; drop "
               "--cuda-graphs")
    _check_model(config, refuse)
    dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else None
    if name == "triton":
        if device.type != "cuda" and not is_interpreting():
            refuse("attention backend 'triton' runs on a GPU")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            refuse(f"runs float32, bfloat16 or float16 models on the GPU, got {dtype}")
        return "triton"
    if device.type != "cpu":
        refuse(f"on the GPU it needs attention backend 'triton', got {name!r}")
    if not isinstance(backend, TorchAttentionBackend):
        refuse(f"on the CPU it needs attention backend 'torch', got {name!r}")
    if dtype == torch.float16:
        refuse("float16 is not covered on the CPU (servelm's CPU GEMMs take float32 or "
               "bfloat16); use --dtype bfloat16 or float32")
    if dtype not in (torch.float32, torch.bfloat16):
        refuse(f"runs float32 or bfloat16 models on the CPU, got {dtype}")
    if dtype == torch.bfloat16 and cpu_linear_kind(dtype) is None:  # layers/det_linear.py
        refuse("bfloat16 needs servelm's bfloat16 GEMM (avx512_bf16 or AMX-BF16 seen to run "
               "here, servelm/cpu_kernels/isa.py); use --dtype float32")
    for part in ("attention", "layer_ops"):
        if cpu_kernels.ops_for_mode(part) is None:
            refuse(f"needs servelm's C++ CPU kernels for {part!r} (they did not build, or "
                   f"--cpu-kernels chose 'torch' for it)")
    return "cpu"


def _check_model(config, refuse) -> None:
    if config.is_moe:
        refuse("mixture-of-experts models are not covered (expert matmuls group tokens by "
               "batch)")
    if config.is_mla:
        refuse("multi-head latent attention (DeepSeek) is not covered")
    if config.sliding_window or config.attn_logit_softcapping:
        refuse("sliding-window and soft-capped attention are not covered")


def is_interpreting() -> bool:
    """Triton kernels run interpreted on the CPU (TRITON_INTERPRET=1: the tests)."""
    from servelm.kernels.dot_dtype import is_interpreting as interpreting

    return interpreting()
