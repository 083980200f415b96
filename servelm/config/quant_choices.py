"""The quantization choices a configuration names: --quantization's methods and
--quant-activations' values, with the check of the latter.

Owns: the names, so that EngineArgs validates them and --help lists them without importing
the quantization package (servelm/quant, a layer above the configuration, builds the layers
each name stands for; its registry and QUANT_METHOD_NAMES are checked to agree by
tests/quant/test_quantized_linear.py).
Never: imports torch or servelm.quant, or knows what a method does.
"""

from __future__ import annotations

from servelm.protocol import InvalidParameterError

# In the order --help lists them (servelm/quant/__init__.py registers each one)
QUANT_METHOD_NAMES: tuple[str, ...] = (
    "int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256", "gguf", "gguf-mixed",
    "fp8", "gptq", "awq", "compressed-tensors")

# What the quantized CPU linears compute with (servelm/quant/int8_act.py); "auto": each step
# by its rows, float activations for few, int8 for many
QUANT_ACTIVATIONS: tuple[str, ...] = ("float", "int8", "auto")


def check_quant_activations(value: str, param: str = "quant_activations") -> str:
    if value not in QUANT_ACTIVATIONS:
        raise InvalidParameterError(f"{param} {value!r}: choose one of {QUANT_ACTIVATIONS}",
                                    param=param)
    return value
