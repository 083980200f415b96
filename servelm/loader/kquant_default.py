"""kquant_default: how a GGUF K-quant file served without --quantization runs.

Owns: `default_method(source, args)`, "gguf" for a K-quant file (general.file_type a
Q4_K / Q5_K / Q6_K mix) whose every matrix `gguf` keeps exactly (K-quants as KQuantLinear,
Q4_0 / Q4_1 / Q5_0 / Q8_0 as int4 / int8 codes, float tensors as they are), on the CPU with
servelm's quantized and decode-stack kernels; else None (the file's values in float, as
before), with the reason logged either way. And `default_args(source, args)`, the engine
arguments that says: --quantization gguf with activations "auto" (servelm/quant/int8_act.py:
each step by its rows, float activations for a few rows, int8 for batches and prompt chunks,
as llama.cpp runs them, where this CPU's dot products win), unless --quant-activations int8
was asked for (int8 at every step) or --deterministic (whose steps must not change form with
the batch: float at every step).

Why: on the C++ decode stack a Q4_K_M file's codes decode faster than its dequantized
bfloat16 weights and hold the file's bytes instead of a float copy (docs/quantization.md has
the figures). A file with a type `gguf` requantizes (Q5_1, Q2_K, Q3_K, ...) keeps the float
default, which changes no weight.

Never: overrides an explicit --quantization, or reads a tensor's data (the index only).
"""

from __future__ import annotations

import dataclasses
import logging

logger = logging.getLogger(__name__)

# the file types whose matrices are mostly K-quants (gguf-py's LlamaFileType names)
KQUANT_FILE_TYPES = ("MOSTLY_Q4_K_S", "MOSTLY_Q4_K_M", "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M",
                     "MOSTLY_Q6_K")
# kquant_gemm.cpp's kPanelMinRows: steps of this many rows or more take the panels kernel
PANEL_MIN_ROWS = 8
# the types `gguf` keeps exactly (servelm/quant/methods.py GGUFMethod)
EXACT_TYPES = frozenset({"Q4_K", "Q5_K", "Q6_K", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "F32", "F16",
                         "BF16"})


def default_args(source, args):
    """`args` (an EngineArgs without --quantization) with the K-quant default, if it applies:
    quantization "gguf" and its activations (see the module doc)."""
    method = default_method(source, args)
    if method is None:
        return args
    activations = args.quant_activations
    if activations == "float" and not args.deterministic:
        activations = "auto"
    logger.info("%s: %s", source.path, _activations_reason(activations))
    return dataclasses.replace(args, quantization=method, quant_activations=activations)


def _activations_reason(activations: str) -> str:
    from servelm.quant.int8_act import auto_reason

    if activations == "auto":
        return "its int8 and int4 layers take " + auto_reason()
    if activations == "int8":
        return "its int8 and int4 layers take int8 activations at every step (as asked)"
    return "its int8 and int4 layers take float activations at every step (--deterministic)"


def default_method(source, args) -> str | None:
    """"gguf" where a K-quant file keeps its codes by default (see the module doc), else
    None; `args` an EngineArgs without --quantization."""
    if source.kind != "gguf":
        return None
    why = _refusal(source, args)
    if why is None:
        logger.info("%s is a K-quant file: its codes are kept (--quantization gguf) and run "
                    "on the decode stack, faster than its float values; each step's K-quant "
                    "kernel goes by its rows (a weight decode per 4 rows below %d, %s)",
                    source.path, *_kquant_kernels())
        return "gguf"
    if why:
        logger.info("%s: the file's values in float (%s)", source.path, why)
    return None


def _kquant_kernels() -> tuple[int, str]:
    """(the rows from which the panels kernel runs, what runs at and above them): the panels,
    every weight decode serving all the step's rows, are built where avx512_vnni is."""
    from servelm.cpu_kernels import isa

    if isa.usable("avx512_vnni"):
        return PANEL_MIN_ROWS, "one per step from there, avx512_vnni's panels"
    return PANEL_MIN_ROWS, "and above too: no avx512_vnni for the panels"


def _refusal(source, args) -> str | None:
    """Why the codes are not the default ("" for a file that is not a K-quant mix), or None."""
    from gguf import LlamaFileType

    from servelm import cpu_kernels
    from servelm.loader.gguf_loader import gguf_reader

    reader = gguf_reader(source.path)
    field = reader.fields.get("general.file_type")
    try:
        file_type = LlamaFileType(int(field.contents())).name if field is not None else ""
    except ValueError:
        file_type = ""
    if file_type not in KQUANT_FILE_TYPES:
        return ""
    if args.device != "cpu":
        return f"the K-quant kernels and the decode stack are CPU kernels; device {args.device}"
    choice = args.cpu_kernel_choice()
    for part in ("quant", "decode"):
        if choice.mode(part) == "torch":
            return f"--cpu-kernels {part}=torch"
    inexact = sorted({t.tensor_type.name for t in reader.tensors if len(t.shape) >= 2}
                     - EXACT_TYPES)
    if inexact:
        return f"--quantization gguf would requantize its {', '.join(inexact)} matrices"
    if cpu_kernels.ops_for_mode("quant", choice.mode("quant")) is None:
        return "servelm's C++ CPU kernels did not build"
    return None
