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
        experts = model.layers[1].mlp.experts
        for name, stacked, packed in (("gate_up_proj", "w13", "q13"), ("down_proj", "w2", "q2")):
            want = ref[f"model.layers.1.mlp.experts.{name}"]
            x = torch.randn(3, want.shape[-1], generator=torch.Generator().manual_seed(0))
            for e in range(want.shape[0]):
                # the experts are packed for servelm's GEMMs where the engine packs its
                # linears, the stacks dropped: each expert's layer must apply its matrix
                got = (x @ getattr(experts, stacked)[e].t() if getattr(experts, stacked)
                       is not None else getattr(experts, packed)[e](x))
                torch.testing.assert_close(got, x @ want[e].t(), rtol=1e-5, atol=1e-5)
