"""Packed modules: which checkpoint projections a model stacks into one parameter.

Owns the one table every reader of checkpoint names derives from: the model's weight
loading (models/decoder.py), dummy weights (loader/dummy.py), a
tensor-parallel rank's slices (parallel/sharding.py), the GGUF names of a fused tensor
(loader/gguf_loader.py) and LoRA's targets (lora/adapter.py, lora/manager.py). A family
sets it as its class attribute `packed_modules` (the frame does: DecoderLM),
so a new packing is declared once. Never: imports torch (LoRA's adapter checks run without
it).

    packed parameter   parts stacked in its rows, in order, each with its ModelConfig rows
    qkv_proj           q_proj (q_size) | k_proj (kv_size) | v_proj (kv_size)
    gate_up_proj       gate_proj (intermediate_size) | up_proj (intermediate_size)
    w13 (experts)      w1 (moe_intermediate_size) | w3 (moe_intermediate_size)

Every part reads the layer's input (hidden_size columns).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class Part(NamedTuple):
    """One checkpoint projection inside a packed parameter."""

    name: str  # its checkpoint name, "k_proj"
    rows: str  # the ModelConfig field that is its number of rows, "kv_size"


PackedModules = Mapping[str, tuple[Part, ...]]

# The dense decoder layer's (every family's attention and MLP)
PACKED_MODULES: PackedModules = {
    "qkv_proj": (Part("q_proj", "q_size"), Part("k_proj", "kv_size"), Part("v_proj", "kv_size")),
    "gate_up_proj": (Part("gate_proj", "intermediate_size"),
                     Part("up_proj", "intermediate_size")),
}
# Mixtures of experts: the routed experts' gate and up rows in one stacked tensor, named as
# Mixtral's checkpoints name them (w1, w3; Qwen-MoE and DeepSeek name them as gate_up_proj's)
MOE_PACKED_MODULES: PackedModules = {
    **PACKED_MODULES,
    "w13": (Part("w1", "moe_intermediate_size"), Part("w3", "moe_intermediate_size")),
}


class PartOf(NamedTuple):
    packed: str  # "qkv_proj"
    index: int  # the part's place in its rows, 1 for k_proj


def parts_of(table: PackedModules) -> dict[str, PartOf]:
    """Checkpoint projection -> (packed parameter, index): {"k_proj": ("qkv_proj", 1), ...}."""
    return {p.name: PartOf(packed, i) for packed, parts in table.items()
            for i, p in enumerate(parts)}


def part_rows(config, table: PackedModules, packed: str) -> list[int]:
    """Rows of each part of `packed` for this config: qkv_proj -> [q_size, kv_size, kv_size]."""
    return [getattr(config, p.rows) for p in table[packed]]


def part_offsets(config, table: PackedModules, packed: str) -> list[tuple[int, int]]:
    """(first row, rows) of each part of `packed` in the packed parameter."""
    out, start = [], 0
    for rows in part_rows(config, table, packed):
        out.append((start, rows))
        start += rows
    return out


def packed_modules_for(config) -> PackedModules:
    """The packed-modules table of the family that serves `config` (imports its class)."""
    from servelm.models import get_model_class

    return get_model_class(config.architecture).packed_modules
