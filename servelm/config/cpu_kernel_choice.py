"""CpuKernelChoice: which CPU parts may take servelm's C++ kernels, from one engine option.

Owns: parsing `--cpu-kernels` / EngineArgs.cpu_kernels, the one typed place the choice is
read from text. Parts:

    attention   paged decode attention (servelm/attention/paged_attention_cpu.py)
    decode      the whole-model decode stack (servelm/runner/cpu_decode.py)
    layer_ops   fused RMSNorm, rotary, SiLU-and-mul (servelm/layers/fused_cpu.py)
    quant       int4/int8 matmuls on panels (servelm/quant/cpu_panels.py)
    gemm        float linears on servelm's own GEMMs: float32 steps of few rows on the panel
                GEMM, oneDNN above; bfloat16 steps of few rows on AMX tiles where they run,
                oneDNN above; else bfloat16 at every row count on avx512_bf16 dot products
                where they run (servelm/layers/linear.py, `pair_with_panels`,
                `pair_with_tiles`, `pack_dot_linears`)

and for each a mode: 'auto' (the kernels where they build, else torch), 'kernel' (the kernels,
or an error), 'torch' (never). "torch" sets every part; "attention=torch,decode=kernel" sets
two and leaves the rest 'auto'; "torch,quant=auto" sets all, then one.

It sits in config/ with the option it parses (EngineArgs validates it at construction);
servelm/cpu_kernels/ holds the process's current choice and acts on it.
Never: imports torch, or takes a choice from the environment: the SERVELM_CPU_* variables that
chose these paths before are no longer read (`stale_env_vars` names any still set, so the
engine build can say which option replaced them).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

MODES = ("auto", "kernel", "torch")
PARTS = ("attention", "decode", "layer_ops", "quant", "gemm")
# The environment variables that chose each part before the engine option did.
_OLD_ENV_VARS = {part: f"SERVELM_CPU_{part.upper()}"
                 for part in ("attention", "decode", "layer_ops", "quant")}


@dataclass(frozen=True)
class CpuKernelChoice:
    attention: str = "auto"
    decode: str = "auto"
    layer_ops: str = "auto"
    quant: str = "auto"
    gemm: str = "auto"

    def __post_init__(self) -> None:
        for part in PARTS:
            if getattr(self, part) not in MODES:
                raise ValueError(f"cpu_kernels: {part}={getattr(self, part)!r}: choose one "
                                 f"of {MODES}")

    @classmethod
    def parse(cls, text: str) -> CpuKernelChoice:
        """'auto' | 'kernel' | 'torch' | 'PART=MODE,...' (a bare mode first sets all)."""
        modes: dict[str, str] = {}
        for i, item in enumerate(x.strip().lower() for x in text.split(",")):
            part, sep, value = item.partition("=")
            if not sep:
                if i or item not in MODES:
                    raise ValueError(f"cpu_kernels: {item!r}: expected one of {MODES} or "
                                     f"PART=MODE with PART one of {PARTS}")
                modes = dict.fromkeys(PARTS, item)
                continue
            if part not in PARTS:
                raise ValueError(f"cpu_kernels: unknown part {part!r}; parts: {PARTS}")
            modes[part] = value
        return cls(**modes)

    def mode(self, part: str) -> str:
        return getattr(self, part)

    def replace(self, **modes: str) -> CpuKernelChoice:
        return dataclasses.replace(self, **modes)

    def __str__(self) -> str:
        values = {getattr(self, p) for p in PARTS}
        if len(values) == 1:
            return values.pop()
        return ",".join(f"{p}={getattr(self, p)}" for p in PARTS)


def stale_env_vars() -> list[str]:
    """SERVELM_CPU_* variables set in the environment, which nothing reads any more."""
    return [f"{var}={os.environ[var]}" for var in _OLD_ENV_VARS.values() if var in os.environ]
