"""Whether a layer's small ops run fused in C++ (servelm/cpu_kernels/layer_ops.cpp).

Eager torch runs a residual add + RMSNorm, rotary and SiLU-and-mul as ~25 small ops per
decoder layer, each a pass over memory and, on the CPU, a parallel region; fused they are 4.
Float32 and bfloat16 CPU tensors (bfloat16: float32 arithmetic inside, each result rounded
once); other dtypes and devices keep the torch code, which defines what the kernels compute.
The engine option `--cpu-kernels layer_ops=MODE` chooses, for the
process (servelm/config/cpu_kernel_choice.py; these ops run deep in every layer, so they read the
choice the engine build set rather than taking an argument):

    auto    fused where the kernels build (default)
    kernel  fused, or an error if the kernels cannot be built
    torch   never
"""

from __future__ import annotations

import torch

from servelm import cpu_kernels

PART = "layer_ops"  # of CpuKernelChoice
_DTYPES = (torch.float32, torch.bfloat16)


def fused_ops(x: torch.Tensor):
    """torch.ops.servelm_cpu if `x` may take the fused kernels, else None."""
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        return None
    return cpu_kernels.ops_for_mode(PART)
