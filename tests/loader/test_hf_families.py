"""A checkpoint folder transformers writes for a non-Llama family loads through the HF loader
into the same logits."""

import pytest
import torch

from tiny_families import make_tiny_family_model
from servelm.engine_builder import build_model
from servelm.loader.hf_loader import iter_hf_weights, load_hf_config


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "gemma2"])
def test_saved_checkpoint_loads_and_matches(family, tmp_path):
    hf = make_tiny_family_model(family)
    hf.save_pretrained(tmp_path)
    config = load_hf_config(tmp_path, family)
    model = build_model(config, iter_hf_weights(tmp_path, config), torch.float32,
                        torch.device("cpu"))
    ref = dict(hf.state_dict())
    assert torch.equal(model.embed_tokens.weight, ref["model.embed_tokens.weight"])
    if family != "gemma2":
        gate_up = ref["model.layers.1.mlp.experts.gate_up_proj"]
        assert torch.equal(model.layers[1].mlp.experts.w13, gate_up)
