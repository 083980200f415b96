"""Int8 activations for the quantized CPU linears: the choice, and whether this CPU can run it.

`--quant-activations int8` (EngineArgs.quant_activations) rounds each activation row to int8
per 32 columns (d = max|x| / 127, llama.cpp's Q8 blocks) inside servelm's int8-activation
kernels (servelm/cpu_kernels/quant_gemm_a8.cpp), which multiply by the int4 / int8 codes with
integer dot products (avx512_vnni's vpdpbusd, or AVX2's vpmaddubsw on a CPU without AVX-512);
`float` keeps the float32-activation kernels
(quant_gemm.cpp). The numerics differ (the activations' rounding, ~0.4% of a group's largest
value), so it is the user's choice; docs/quantization.md has the measured cost.

Owns: the run-time check that the CPU runs the kernels' dot products (compiled in, advertised
by cpuid, and executed once in a forked child: a VM may advertise a flag it cannot honour),
cached per process, and the one warning when int8 was asked for and cannot run.

Never: picks a kernel for a layer by itself (Int4Linear / Int8Linear ask `use_int8()` when
they are built), reads the environment, or names the choices (servelm/config/quant_choices.py
does, for EngineArgs).
"""

from __future__ import annotations

import logging

from servelm.config.quant_choices import check_quant_activations

logger = logging.getLogger(__name__)

_probe: bool | None = None  # the probe's answer, once asked
_warned = False


def int8_dot_usable() -> bool:
    """Whether servelm's int8-activation kernels run on this CPU (avx512_vnni or AVX2, checked
    by executing it). False where servelm's C++ kernels do not build."""
    global _probe
    if _probe is None:
        from servelm import cpu_kernels

        path = ""
        try:
            ops = cpu_kernels.load()
            _probe, path = bool(ops.int8_dot_probe()), str(ops.int8_dot_path())
        except Exception:  # noqa: BLE001 - no kernels: nothing to run int8 activations on
            _probe = False
        logger.info("int8 activations: %s", f"usable ({path} dot products)" if _probe
                    else "not usable on this CPU (needs avx512_vnni, or AVX2 without AVX-512)")
    return _probe


def set_probe_result(value: bool | None) -> None:
    """Override the probe's answer (None: ask the CPU again); tests simulate a CPU without
    the dot products with False."""
    global _probe, _warned
    _probe, _warned = value, False


def use_int8(activations: str, what: str) -> bool:
    """Whether a layer asked for `activations` computes with int8 ones: 'int8' where the CPU
    runs them; else False, with one warning per process that float activations run instead."""
    global _warned
    if check_quant_activations(activations) == "float":
        return False
    if int8_dot_usable():
        return True
    if not _warned:
        _warned = True
        logger.warning("quant_activations 'int8' needs avx512_vnni or AVX2 integer dot "
                       "products, which this CPU does not run: %s and the other quantized "
                       "layers keep float32 activations", what)
    return False


A8_SUFFIX = "+a8"  # `servelm eval quality --methods gguf,gguf+a8`: a method with int8 activations


def split_method(method: str) -> tuple[str, str]:
    """An eval method name -> (quantization method, activations): "gguf+a8" is
    ("gguf", "int8"), "gguf" ("gguf", "float")."""
    if method.endswith(A8_SUFFIX):
        return method[: -len(A8_SUFFIX)], "int8"
    return method, "float"
