"""Units, data-type sizes and number formatting shared by every planner module.

Owns: bytes per element of each dtype (with its source), decimal GB, human formatting.
Never: holds hardware or model numbers (see hardware.py / model_catalog.py).
"""

from __future__ import annotations

import math

from servelm.planner.errors import PlanInputError

GB = 1e9  # memory is decimal GB throughout, as on GPU datasheets
KiB = 1024

# Bytes per element. Block-quantised formats include their per-block scales, which is why
# q4_k_m is not 0.5: the average bits/weight comes from llama.cpp's quantize table.
DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "int8": 1.0,
    "int4": 0.5,
    "fp4": 0.5,
    "q8_0": 8.5 / 8,
    "q4_k_m": 4.89 / 8,
}
DTYPE_SOURCES: dict[str, str] = {
    "fp32": "IEEE 754 binary32",
    "bf16": "bfloat16, 16 bits",
    "fp16": "IEEE 754 binary16",
    "fp8": "OCP FP8 (E4M3/E5M2), 8 bits; per-tensor scales ignored",
    "int8": "8-bit integer; per-channel scales ignored",
    "int4": "4-bit integer (GPTQ/AWQ-style); group scales ignored",
    "fp4": "4-bit float (NVFP4/MXFP4); block scales ignored",
    "q8_0": "llama.cpp Q8_0: 32 int8 + one fp16 scale per block = 8.5 bits/weight",
    "q4_k_m": "llama.cpp `quantize --help` table: Q4_K_M averages ~4.89 bits/weight",
}
KV_DTYPES = ("fp32", "bf16", "fp16", "fp8", "int8")


def dtype_bytes(param: str, dtype: str, allowed: tuple[str, ...] | None = None) -> float:
    names = allowed if allowed is not None else tuple(DTYPE_BYTES)
    if dtype not in names:
        raise PlanInputError(param, f"unknown dtype {dtype!r}; choose from {', '.join(names)}")
    return DTYPE_BYTES[dtype]


def fmt_num(x: float, digits: int = 4) -> str:
    """Compact number for formula lines: integers with separators, else `digits` sig. figs."""
    if x is None:
        return "n/a"
    if isinstance(x, float) and (math.isinf(x) or math.isnan(x)):
        return "inf" if x > 0 else str(x)
    if float(x).is_integer() and abs(x) < 1e15:
        return f"{int(x):,}"
    if abs(x) >= 1e6 or abs(x) < 1e-3:
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def fmt_bytes(n: float) -> str:
    if math.isinf(n):
        return "inf"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} B"


def fmt_rate(bps: float) -> str:
    return "inf" if math.isinf(bps) else fmt_bytes(bps) + "/s"


def fmt_seconds(s: float) -> str:
    if math.isinf(s):
        return "inf"
    if abs(s) >= 1:
        return f"{s:.3g} s"
    if abs(s) >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} us"


def fmt_flops(f: float) -> str:
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9)):
        if abs(f) >= scale:
            return f"{f / scale:.3g} {unit}"
    return f"{f:.3g} FLOP"


def fmt_count(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g}{unit}"
    return fmt_num(n)
