"""`--dtype auto`: the fastest numerically safe compute dtype for this model on this machine.

The rule, decided once at start-up and logged with its reason:

    CPU   bfloat16 where the CPU runs bfloat16 dot products (avx512_bf16 or AMX-BF16, each
          checked by running it: servelm/cpu_kernels/isa.py) and the checkpoint's weights are
          stored in 16 bits or fewer (bfloat16, float16, a quantized GGUF); float32 elsewhere.
          A float32 checkpoint stays float32: its publisher kept precision that bfloat16
          would round away, so the faster path is not taken silently. Quantized weights
          (--quantization int8|int4|gguf) with float activations run float32: servelm's
          quantized CPU kernels take float32 rows (with --quant-activations int8 the rule
          above applies; so does it for gguf-mixed, whose codes serve only steps of a few
          rows). --deterministic runs float32 (its CPU kernels are float32).
    GPU   bfloat16 where the device supports it, else float16.

On the AMX Xeon of docs/benchmarks.md the bfloat16 path is 2-3x float32 in batch (oneDNN on
AMX tiles); its accuracy against float32 is measured in docs/quantization.md.

Owns: that rule and the reading of a checkpoint's stored dtype (config.json's torch_dtype,
else the safetensors headers; a GGUF file's matrix types).
Never: changes an explicit --dtype.
"""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
_WIDE = {"float32", "F32", "float64", "F64"}


def resolve(requested: str, device: str, source=None, quantization: str | None = None,
            activations: str = "float") -> tuple[str, str]:
    """(dtype, why) for a requested --dtype; source: the loader's ModelSource, or None for
    weights handed in directly (treated as stored in float32). quantization / activations:
    --quantization and --quant-activations (servelm's quantized CPU kernels with float
    activations take float32 rows)."""
    if requested not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {requested!r}")
    if requested != "auto":
        return requested, "as requested"
    if device.startswith("cuda"):
        import torch

        if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
            return "bfloat16", "the GPU supports bfloat16"
        return "float16", "the GPU has no bfloat16"
    from servelm.cpu_kernels import isa

    # gguf-mixed's codes take float32 rows (widened per step); its other form is the dtype's
    if quantization not in (None, "fp8", "gguf-mixed") and activations == "float":
        return "float32", (f"--quantization {quantization} with float activations: its CPU "
                           "kernels take float32 rows")
    stored = stored_dtype(source)
    if stored in _WIDE:
        return "float32", f"the checkpoint is stored in {stored}"
    if not isa.has_bf16_math():
        return "float32", f"the CPU has no usable bfloat16 dot products ({isa.describe()})"
    which = [n for n in ("amx_bf16", "avx512_bf16") if isa.usable(n)]
    return "bfloat16", (f"the CPU runs bfloat16 dot products ({' and '.join(which)}, probed) "
                        f"and the checkpoint is stored in {stored}")


def stored_dtype(source) -> str:
    """The checkpoint's weight storage: a torch dtype name, a GGUF type name ('Q4_1'), or
    'float32' when unknown (in-memory weights, a dummy model)."""
    if source is None or source.kind == "dummy":
        return "float32"
    if source.kind == "gguf":
        return _gguf_matrix_type(Path(source.path))
    return _hf_dtype(Path(source.path))


def _hf_dtype(path: Path) -> str:
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    named = config.get("torch_dtype") or config.get("dtype")
    if isinstance(named, str):
        return named
    for file in sorted(path.glob("*.safetensors"))[:1]:
        return _safetensors_dtype(file)
    return "float32"


def _safetensors_dtype(file: Path) -> str:
    """The dtype most of a safetensors file's bytes are stored in (its header, no tensor read)."""
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    sizes: dict[str, int] = {}
    for name, entry in header.items():
        if name != "__metadata__":
            begin, end = entry["data_offsets"]
            sizes[entry["dtype"]] = sizes.get(entry["dtype"], 0) + end - begin
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
    top = max(sizes, key=sizes.get) if sizes else "F32"
    return names.get(top, top)


def _gguf_matrix_type(file: Path) -> str:
    """The type of the file's 2-D tensors that hold the most elements (norms are often F32
    in a quantized file; the matrices say how the model was stored)."""
    import numpy as np

    from servelm.loader.gguf_loader import gguf_reader  # the indexed reader config loading shares

    counts: dict[str, int] = {}
    for t in gguf_reader(file).tensors:
        if len(t.shape) >= 2:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + int(np.prod(t.shape))
    return max(counts, key=counts.get) if counts else "F32"


def log_choice(requested: str, dtype: str, why: str) -> None:
    if requested == "auto":
        logger.info("dtype auto -> %s: %s", dtype, why)
