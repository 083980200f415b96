"""Deterministic mode (the engine option --deterministic; docs/determinism.md).

Owns: checking that a built model, KV cache and attention backend can keep the promise (the
same request gives the same tokens and logprobs whatever else the engine is doing), and
switching them to the batch-invariant path:

    linears     DetLinear (servelm/layers/det_linear.py): one fixed-order sum per element
    attention   one C++ paged-kernel row per query token, prefill and decode alike
                (TorchAttentionBackend.set_deterministic)
    decode      the C++ stack takes every step, prefill included (runner/cpu_decode.py)
    norms, rotary, SiLU   servelm's fused kernels (fixed per-row order, cpu_kernels/layer_ops)

Every per-row computation then depends on the row's token, position and cached context only:
not on the batch size, the row's place in it, the prompt's chunking, prefix-cache hits,
preemption and recompute, or speculative verification.
Never: falls back silently. A configuration it cannot make batch-invariant (GPU, a dtype
other than float32, quantized or MoE layers, sliding-window or soft-capped attention, MLA,
CUDA graphs, the torch paths of the CPU kernels) is a ValueError naming what to change.
"""

from __future__ import annotations

import torch

from servelm import cpu_kernels


def enable_deterministic(model: torch.nn.Module, config, backend, device: torch.device,
                         graphs=None) -> None:
    check_supported(model, config, backend, device, graphs)
    from servelm.layers.det_linear import make_deterministic

    make_deterministic(model)
    backend.set_deterministic()


def check_supported(model, config, backend, device: torch.device, graphs=None) -> None:
    from servelm.attention.torch_backend import TorchAttentionBackend

    def refuse(why: str) -> None:
        raise ValueError(f"--deterministic: {why}")

    if device.type != "cpu":
        refuse("the batch-invariant kernels are servelm's CPU kernels; on the GPU (Triton) "
               "path the mode is not available yet (docs/determinism.md)")
    if graphs is not None:
        refuse("CUDA graphs are a GPU path; drop --cuda-graphs")
    if not isinstance(backend, TorchAttentionBackend):
        refuse(f"needs attention backend 'torch', got {getattr(backend, 'name', backend)!r}")
    dtype = model.embed_tokens.weight.dtype if hasattr(model, "embed_tokens") else None
    if dtype != torch.float32:
        refuse(f"runs float32 models (--dtype float32), got {dtype}")
    if config.is_moe:
        refuse("mixture-of-experts models are not covered (expert matmuls group tokens by "
               "batch)")
    if config.is_mla:
        refuse("multi-head latent attention (DeepSeek) is not covered")
    if config.sliding_window or config.attn_logit_softcapping:
        refuse("sliding-window and soft-capped attention are not covered")
    for part in ("attention", "layer_ops"):
        if cpu_kernels.ops_for_mode(part) is None:
            refuse(f"needs servelm's C++ CPU kernels for {part!r} (they did not build, or "
                   f"--cpu-kernels chose 'torch' for it)")
