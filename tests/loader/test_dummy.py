"""Dummy weights cover every parameter of a real model's shape, lazily and reproducibly."""

import inspect

import pytest
import torch

from servelm.config import ModelConfig
from servelm.loader.dummy import (
    DUMMY_CONFIGS,
    dummy_model_config,
    dummy_weights,
    hf_weight_shape,
    is_dummy_name,
)
from servelm.models import get_model_class


def _meta_model(config: ModelConfig):
    with torch.device("meta"):
        return get_model_class(config.architecture)(config, None)


@pytest.mark.parametrize("name", sorted(DUMMY_CONFIGS))
def test_every_parameter_is_covered_with_its_shape(name):
    """The real model's loader accepts the dummy stream (it checks names, shapes and that
    nothing is missing); on the meta device nothing is allocated."""
    config = dummy_model_config("dummy:" + name)
    model = _meta_model(config)
    model.load_weights(dummy_weights(config, device="meta"))  # raises on a gap or mismatch


def test_builtin_shapes_are_the_published_ones():
    qwen = dummy_model_config("dummy:Qwen3-0.6B")
    assert (qwen.num_layers, qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (28, 16, 8, 128)
    assert qwen.tie_word_embeddings and qwen.qk_norm
    assert hf_weight_shape(qwen, "model.layers.0.self_attn.q_proj.weight") == (2048, 1024)
    assert hf_weight_shape(qwen, "model.layers.3.self_attn.k_norm.weight") == (128,)
    llama = dummy_model_config("llama-3.1-8b")
    assert llama.rope_scaling["rope_type"] == "llama3"
    n_params = sum(torch.Size(hf_weight_shape(llama, n)).numel()
                   for n, _ in dummy_weights(llama, device="meta"))
    assert n_params == 8_030_261_248  # Llama-3.1-8B's published parameter count


def test_weights_are_lazy_reproducible_and_load_into_a_small_model():
    config = dummy_model_config("qwen3-0.6b").replace(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, max_position_embeddings=128)
    stream = dummy_weights(config, seed=3)
    assert inspect.isgenerator(stream)
    first = dict(stream)
    again = dict(dummy_weights(config, seed=3))
    other = dict(dummy_weights(config, seed=4))
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(first[name], again[name]) and not torch.equal(first[name], other[name])
    assert torch.equal(first["model.norm.weight"], torch.ones(64))
    assert abs(first[name].std().item() - 0.02) < 0.003
    from servelm.config import EngineArgs
    from servelm.engine_builder import assemble_engine
    from servelm.llm import LLM
    from servelm.protocol import SamplingParams

    engine = assemble_engine(EngineArgs(model="dummy", num_blocks=16, block_size=4), config,
                             dummy_weights(config, seed=3), None, "dummy")
    out = LLM(engine=engine).generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True,
                                                                temperature=0, logprobs=1),
                                      use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4
    assert all(torch.isfinite(torch.tensor(lp.logprob)) for lp in out.logprobs)

def test_unknown_dummy_name_is_a_clear_error():
    assert is_dummy_name("dummy:llama-3.1-8b") and not is_dummy_name("llama-3.1-8b")
    with pytest.raises(ValueError, match="dummy:qwen3-0.6b"):
        dummy_model_config("dummy:gpt-5")
