"""kernel_paths: which path each CPU part took in a built engine, for the start-up log.

Owns: reading that back from what was built (the attention backend's decode kernel, the
runner's decode stack, the layer ops for the model's dtype and device, the quantized linears'
kernels), so the log says what runs, not what was asked for.
Never: chooses a path (CpuKernelChoice and each part do). It reads the layers and linears
the runner drives, so it sits with the runner, above them, not in cpu_kernels/ below them.
"""

from __future__ import annotations

import torch

_QUANT_KERNELS = {"cpu": "panels", "aten": "aten", "triton": "triton", None: "aten"}


def kernel_paths(model: torch.nn.Module, backend, cpu_stack, dtype: torch.dtype,
                 device: torch.device) -> dict[str, str]:
    """{part: path}: attention kernel|rows|torch, decode stack|eager, layer_ops fused|torch,
    quant panels|aten|triton|... (none: no quantized linears), gemm (the float linears):
    panels<=ROWS+onednn (paired by layers/linear.py's pair_with_panels) | amx<=ROWS+onednn
    (bfloat16, paired by pair_with_tiles) | amx (bfloat16 on AMX tiles at every row count:
    deterministic mode) | dot (bfloat16 on avx512_bf16: pack_dot_linears, or deterministic
    mode) | onednn (packed) | aten | det (deterministic mode's float32 linears) | none.
    Deterministic mode shows as attention=rows: every token one row of the paged kernel."""
    from servelm.layers.amx_linear import AmxLinear
    from servelm.layers.det_linear import DetLinear
    from servelm.layers.dot_linear import DotLinear
    from servelm.layers.fused_cpu import fused_ops
    from servelm.layers.linear import PackedLinear
    from servelm.quant.mixed_linear import MixedLinear
    from servelm.quant.quantized_linear import QuantizedLinear

    if getattr(backend, "deterministic", False):
        attention = "rows"
    elif hasattr(backend, "decode_kernel"):
        attention = "kernel" if backend.decode_kernel is not None else "torch"
    else:
        attention = type(backend).__name__
    probe = torch.empty(0, dtype=dtype, device=device)
    quant = sorted({_QUANT_KERNELS.get(getattr(m, "kernel", None), type(m).__name__)
                    for m in model.modules() if isinstance(m, QuantizedLinear)})
    paths = {"attention": attention,
             "decode": "stack" if cpu_stack is not None else "eager",
             "layer_ops": "fused" if fused_ops(probe) is not None else "torch",
             "quant": "+".join(quant) or "none"}
    panels = [m.max_rows for m in model.modules()
              if type(m) is MixedLinear and type(m.small) is DetLinear]
    tiles = [m.max_rows for m in model.modules()
             if type(m) is MixedLinear and type(m.small) is AmxLinear]
    if panels:
        paths["gemm"] = f"panels<={min(panels)}+onednn"
    elif tiles:
        paths["gemm"] = f"amx<={min(tiles)}+onednn"
    elif any(type(m) is AmxLinear for m in model.modules()):  # alone: deterministic mode
        paths["gemm"] = "amx"
    elif any(type(m) is DotLinear for m in model.modules()):
        paths["gemm"] = "dot"
    elif any(isinstance(m, DetLinear) for m in model.modules()):
        paths["gemm"] = "det"
    elif any(type(m) is PackedLinear for m in model.modules()):
        paths["gemm"] = "onednn"
    else:
        paths["gemm"] = "aten" if any(type(m) is torch.nn.Linear
                                      for m in model.modules()) else "none"
    return paths


def describe(paths: dict[str, str]) -> str:
    return " ".join(f"{part}={path}" for part, path in paths.items())
