"""Whether a layer's small ops run fused in C++ (servelm/cpu_kernels/layer_ops.cpp).

Eager torch runs a residual add + RMSNorm, rotary and SiLU-and-mul as ~25 small ops per
decoder layer, each a pass over memory and, on the CPU, a parallel region; fused they are 4.
Float32 CPU tensors only (other dtypes and devices keep the torch code, which defines what
the kernels compute):

    SERVELM_CPU_LAYER_OPS=auto    fused where the kernels build (default)
    SERVELM_CPU_LAYER_OPS=kernel  fused, or an error if the kernels cannot be built
    SERVELM_CPU_LAYER_OPS=torch   never
"""

from __future__ import annotations

import torch

from servelm import cpu_kernels

ENV_VAR = "SERVELM_CPU_LAYER_OPS"


def fused_ops(x: torch.Tensor):
    """torch.ops.servelm_cpu if `x` may take the fused kernels, else None."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return None
    return cpu_kernels.ops_for_mode(ENV_VAR)
