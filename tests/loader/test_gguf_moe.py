"""Mixture-of-experts GGUF files (Mixtral as llama.cpp writes it, Qwen2-MoE, Qwen3-MoE),
written here with gguf-py's GGUFWriter from tiny random transformers checkpoints: stacked
expert tensors, shared experts and their gate, q/k biases and norms. Tensor names come from
gguf-py's own TensorNameMap (llama.cpp's table), not from the loader's; the reference is the
transformers model holding the values the file stores."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from servelm.config import ModelConfig
from gguf_families import add_shape, add_word_vocab, assert_matches_transformers, finish
from tiny_families import make_tiny_family_model

# family -> (gguf arch, llama.cpp's per-arch routing renormalisation)
ARCHS = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}


def _permute(w, n_head):  # llama.cpp's q/k row order for llama-arch files
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _stored(array, qtype):
    return dequantize(quantize(array, qtype), qtype) if qtype != Q.F32 else array


def _write(path, family, model):
    """The file llama.cpp's converter writes for `model`; the model's parameters are set to
    the values the file holds (Q8_0 experts), so the two compute the same function."""
    arch = ARCHS[family]
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    add_shape(w, cfg)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    n_experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if family != "mixtral":  # Mixtral's experts are feed_forward_length wide
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if family == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    add_word_vocab(w, cfg.vocab_size, "qwen2")
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    state = model.state_dict()
    with torch.no_grad():
        for name, tensor in state.items():
            array = tensor.numpy().astype(np.float32)
            base, suffix = name.rsplit(".", 1)
            if base.endswith("mlp.experts") and suffix in ("gate_up_proj", "down_proj"):
                # transformers 5 stacks the experts ([E, 2I, H] gate|up, [E, H, I]);
                # llama.cpp keeps gate, up and down stacks of their own.
                inter = array.shape[1] // 2
                parts = ({"gate_proj": array[:, :inter], "up_proj": array[:, inter:]}
                         if suffix == "gate_up_proj" else {"down_proj": array})
                for proj, part in parts.items():
                    gname = name_map.get_name(f"{base}.{proj}")
                    w.add_tensor(f"{gname}.weight", quantize(np.ascontiguousarray(part), Q.Q8_0),
                                 raw_dtype=Q.Q8_0)
                    parts[proj] = _stored(np.ascontiguousarray(part), Q.Q8_0)
                merged = (np.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
                          if suffix == "gate_up_proj" else parts["down_proj"])
                tensor.copy_(torch.from_numpy(merged))
                continue
            if arch == "llama" and base.endswith(("q_proj", "k_proj")):
                heads = (cfg.num_attention_heads if base.endswith("q_proj")
                         else cfg.num_key_value_heads)
                array = _permute(array, heads)
            w.add_tensor(f"{name_map.get_name(base)}.{suffix}", array, raw_dtype=Q.F32)
    finish(w)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def moe_file(request, tmp_path_factory):
    family = request.param
    model = make_tiny_family_model(family, seed=7)
    path = tmp_path_factory.mktemp(family) / f"tiny-{family}.gguf"
    _write(path, family, model)
    return family, model, path


def test_config_from_metadata_equals_the_checkpoints(moe_file):
    from servelm.loader import load_model_config, resolve_model

    family, model, path = moe_file
    got = load_model_config(resolve_model(str(path)))
    want = ModelConfig.from_hf_config(model.config.to_dict())
    assert got.architecture == want.architecture == family
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                  "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size", "has_shared_expert_gate",
                  "norm_topk_prob", "attention_bias", "qk_norm", "vocab_size",
                  "tie_word_embeddings", "moe_topk_method", "routed_scaling_factor"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_theta == pytest.approx(want.rope_theta)


def test_logits_and_greedy_match_transformers(moe_file):
    family, model, path = moe_file
    prompt = [5, 17, 33, 2, 101, 7, 250, 64, 9]
    assert_matches_transformers(model, path, prompt, 12)


def test_quantization_gguf_keeps_the_experts_blocks(moe_file):
    """--quantization gguf: every expert's Q8_0 blocks become its int8 layer as they are
    (codes and scale per 32, no requantization), the F32 tensors stay float, and the model
    gives transformers' greedy tokens on the file's values."""
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine
    from servelm.layers.moe import Experts
    from servelm.loader.gguf_loader import iter_gguf_quantized_weights
    from servelm.loader import load_model_config, resolve_model
    from servelm.quant.gguf_blocks import GGUFBlocks
    from tiny_models import greedy, prefill_logits

    family, model, path = moe_file
    config = load_model_config(resolve_model(str(path)))
    blocks = {n: t for n, t in iter_gguf_quantized_weights(path, config)
              if isinstance(t, GGUFBlocks)}
    assert blocks and all(".experts." in n for n in blocks)  # the file's Q8_0 tensors
    engine = build_engine(EngineArgs(model=str(path), num_blocks=64, block_size=4,
                                     dtype="float32", quantization="gguf",
                                     prepared_weights_cache=False))
    experts = [m for m in engine.runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.w13 is None for m in experts)
    first = experts[0].q13[0]  # layer 0, expert 0: [gate | up]
    gate = next(t for n, t in blocks.items() if n.endswith("layers.0.mlp.experts.0.gate_proj"
                                                             ".weight"))
    assert first.group_size == 32  # Q8_0's blocks as they are, not requantized per row
    assert torch.equal(first.dequantize()[:gate.shape[0]], gate.dequantize())
    prompt = [5, 17, 33, 2, 101, 7, 250, 64, 9]
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    # The experts compute with the file's exact values; the gap is the method's int8 head
    # (RTN per 32 of this file's F32 head: exact only for a Q8_0 head), measured 0.51-0.56%.
    got = prefill_logits(engine, prompt)
    assert float((got - ref).norm() / ref.norm()) < 0.01
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(engine, prompt, 12) == want


def test_a_per_expert_file_is_refused_by_name(tmp_path):
    """Old-style files with one tensor per expert (blk.N.ffn_gate.E.weight) are not read as
    something else: the loader names the tensor it cannot place."""
    from servelm.loader.gguf_loader import hf_name

    with pytest.raises(ValueError, match="blk.0.ffn_gate.3.weight"):
        hf_name("blk.0.ffn_gate.3.weight")
    assert hf_name("blk.2.ffn_down_exps.weight", expert=5) == \
        "model.layers.2.mlp.experts.5.down_proj.weight"
