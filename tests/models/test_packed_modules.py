"""The one packed-modules table (servelm/models/packed.py): each family declares it, and the
model's loading, dummy weights, tensor-parallel slices, GGUF names and LoRA targets all read
it, so they agree with the model's packed parameters."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from servelm.config import ModelConfig
from servelm.loader.dummy import hf_weight_shape
from servelm.loader.gguf_loader import hf_name, packed_whole
from servelm.lora.adapter import TARGETS, target_shapes
from servelm.models import families, get_model_class
from servelm.models.packed import PACKED_MODULES, part_offsets, parts_of
from servelm.parallel.sharding import TensorParallelShard

CONFIG = ModelConfig("llama", 256, 64, 96, 2, 4, 2, 16, 512)
FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} | {"q_size", "kv_size"}


@pytest.mark.parametrize("architecture", sorted(families()))
def test_every_family_declares_a_table_of_config_rows(architecture):
    model = get_model_class(architecture)
    assert {"qkv_proj", "gate_up_proj"} <= set(model.packed_modules)
    for packed, parts in model.packed_modules.items():
        assert parts and all(p.rows in FIELDS for p in parts), packed
    assert set(model.checkpoint_packed) <= set(model.packed_modules)


def test_the_llama_model_packs_its_parameters_as_the_table_says():
    model = get_model_class("llama")(CONFIG, backend=None)
    shapes = {n.rsplit(".", 2)[-2]: p.shape for n, p in model.layers[0].named_parameters()}
    for packed in model.packed_modules:
        start, rows = part_offsets(CONFIG, model.packed_modules, packed)[-1]
        assert shapes[packed] == (start + rows, CONFIG.hidden_size)


def test_dummy_shapes_are_the_parts_of_the_packed_rows():
    for part, (packed, i) in parts_of(PACKED_MODULES).items():
        rows = part_offsets(CONFIG, PACKED_MODULES, packed)[i][1]
        parent = "self_attn" if packed == "qkv_proj" else "mlp"
        name = f"model.layers.0.{parent}.{part}.weight"
        assert hf_weight_shape(CONFIG, name) == (rows, CONFIG.hidden_size)


def test_lora_targets_follow_the_table():
    shapes = target_shapes(CONFIG)
    for part, (packed, i) in parts_of(PACKED_MODULES).items():
        assert TARGETS[part] == (packed, i)
        assert shapes[(packed, i)] == (CONFIG.hidden_size,
                                       part_offsets(CONFIG, PACKED_MODULES, packed)[i][1])


def test_a_packed_checkpoint_tensor_shards_as_its_parts_would():
    """Phi-3 stores qkv_proj and gate_up_proj whole: each rank's slice of the packed tensor is
    its slices of the parts, stacked in the table's order."""
    gen = torch.Generator().manual_seed(0)
    for rank in (0, 1):
        shard = TensorParallelShard(CONFIG.replace(architecture="phi3"), rank, 2)
        for packed, parent in (("qkv_proj", "self_attn"), ("gate_up_proj", "mlp")):
            offsets = part_offsets(CONFIG, PACKED_MODULES, packed)
            whole = torch.randn(sum(r for _, r in offsets), CONFIG.hidden_size, generator=gen)
            _, got = shard.select(f"model.layers.0.{parent}.{packed}.weight", whole)
            want = torch.cat([
                shard.select(f"model.layers.0.{parent}.{p.name}.weight",
                             whole[start:start + rows])[1]
                for p, (start, rows) in zip(PACKED_MODULES[packed], offsets)])
            assert torch.equal(got, want), (rank, packed)


def test_gguf_names_a_tensor_the_checkpoint_keeps_whole_by_the_packed_parameter():
    phi3, llama = CONFIG.replace(architecture="phi3"), CONFIG
    assert hf_name("blk.2.ffn_up.weight", whole=packed_whole(phi3)) == \
        "model.layers.2.mlp.gate_up_proj.weight"
    assert hf_name("blk.2.ffn_up.weight", whole=packed_whole(llama)) == \
        "model.layers.2.mlp.up_proj.weight"
    assert hf_name("blk.2.attn_qkv.weight") == "model.layers.2.self_attn.qkv_proj.weight"
