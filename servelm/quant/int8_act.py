"""Int8 activations for the quantized CPU linears: the choice, and whether this CPU can run it.

`--quant-activations int8` (EngineArgs.quant_activations) rounds each activation row to int8
per 32 columns (d = max|x| / 127, llama.cpp's Q8 blocks) inside servelm's int8-activation
kernels (servelm/cpu_kernels/quant_gemm_a8.cpp), which multiply by the int4 / int8 codes with
integer dot products (avx512_vnni's vpdpbusd, or AVX2's vpmaddubsw on a CPU without AVX-512);
`float` keeps the float32-activation kernels (quant_gemm.cpp). The numerics differ (the
activations' rounding, ~0.4% of a group's largest value), so it is the user's choice;
docs/quantization.md has the measured cost.
`auto` (what a GGUF K-quant file runs without --quantization: servelm/loader/
kquant_default.py) takes each step by its rows: float activations for steps of fewer rows
than `a8_min_rows()` (a step of one or a few rows reads every weight once for little work:
the float kernels' one pass over the codes is as fast), int8 from there (a batch or a prompt
chunk is bound by arithmetic, where the dot products do four to eight times the work an
instruction). The row count is measured per dot-product path (A8_MIN_ROWS); the method
builds both forms of a layer side by side (QuantMethod.by_rows, a MixedLinear).

Owns: the rows from which `auto` takes int8 activations on this CPU; the run-time check that
the CPU runs the kernels' dot products (compiled in, advertised by cpuid, and executed once in
a forked child: a VM may advertise a flag it cannot honour), cached per process; and the one
warning when int8 was asked for and cannot run.

Never: picks a kernel for a layer by itself (Int4Linear / Int8Linear ask `use_int8()` when
they are built), reads the environment, or names the choices (servelm/config/quant_choices.py
does, for EngineArgs).
"""

from __future__ import annotations

import logging

from servelm.config.quant_choices import check_quant_activations

logger = logging.getLogger(__name__)

# Under `auto`: the fewest rows a step needs for int8 activations, per int8_dot_path().
# Ad hoc, AMD EPYC Zen 4, one thread, SmolLM2-135M Q4_K_M's Q5_0 layers (30 of a kind cycled,
# min of 15; docs/quantization.md has the table): 576 x 576 float / int8 on the float panels
# at 1 row 23 / 30 us, 2 rows 27 / 39, 4 rows 45 / 44, 64 rows 1097 / 630; 1536 x 576 at 1
# row 65 / 69, 2 rows 75 / 80, 4 rows 111 / 93, 64 rows 2390 / 1110. AVX2 (an x86-64-v3
# build on the same CPU; its float kernel spends four instructions a weight): int8 in its own
# layout ties or wins at every row count, 576 x 576 at 1 row 33 / 34, 4 rows 58 / 49, 64 rows
# 1865 / 1142; 1536 x 576 at 1 row 83 / 60, 64 rows 5757 / 3224: int8 at every step, one copy.
A8_MIN_ROWS = {"avx512_vnni": 4, "avx2": 1}

_probe: bool | None = None  # the probe's answer, once asked
_path = ""  # int8_dot_path(): the dot products the a8 kernels run on
_warned = False
_min_rows: int | None = None  # a test's override of a8_min_rows()


def int8_dot_usable() -> bool:
    """Whether servelm's int8-activation kernels run on this CPU (avx512_vnni or AVX2, checked
    by executing it). False where servelm's C++ kernels do not build."""
    global _probe
    if _probe is None:
        from servelm import cpu_kernels

        global _path
        try:
            ops = cpu_kernels.load()
            _probe, _path = bool(ops.int8_dot_probe()), str(ops.int8_dot_path())
        except Exception:  # noqa: BLE001 - no kernels: nothing to run int8 activations on
            _probe = False
        logger.info("int8 activations: %s", f"usable ({_path} dot products)" if _probe
                    else "not usable on this CPU (needs avx512_vnni, or AVX2 without AVX-512)")
    return _probe


def set_probe_result(value: bool | None) -> None:
    """Override the probe's answer (None: ask the CPU again); tests simulate a CPU without
    the dot products with False."""
    global _probe, _warned
    _probe, _warned = value, False


def a8_min_rows() -> int | None:
    """Under `auto`: the fewest rows for which a step takes int8 activations on this CPU
    (1: every step), or None where it never does (the CPU runs no dot products for them)."""
    if not int8_dot_usable():
        return None
    if _min_rows is not None:
        return _min_rows
    return A8_MIN_ROWS.get(_path)


def set_a8_min_rows(value: int | None) -> None:
    """Override a8_min_rows() where the CPU runs the dot products (None: the measured table);
    tests move the boundary to the rows their steps have."""
    global _min_rows
    if value is not None and value < 1:
        raise ValueError(f"a8 min rows must be at least 1, got {value}")
    _min_rows = value


def auto_reason() -> str:
    """How `auto` takes steps on this CPU, for the start-up log."""
    rows = a8_min_rows()
    if rows is None:
        return "float activations at every step (no int8 dot products on this CPU)"
    if rows <= 1:
        return f"int8 activations at every step ({_path} dot products)"
    return (f"float activations for steps of up to {rows - 1} rows, int8 from {rows} "
            f"({_path} dot products; measured per path: int8_act.A8_MIN_ROWS)")


def use_int8(activations: str, what: str) -> bool:
    """Whether a layer asked for `activations` computes with int8 ones: 'int8' where the CPU
    runs them; else False, with one warning per process that float activations run instead."""
    global _warned
    if check_quant_activations(activations) == "float":
        return False
    if activations == "auto":
        raise ValueError(f"{what}: activations 'auto' is chosen per step by rows between two "
                         "layers (QuantMethod.by_rows); a layer takes 'float' or 'int8'")
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
