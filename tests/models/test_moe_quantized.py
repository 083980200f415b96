"""Weight-only int8 / int4 on the MoE families: every expert, attention and dense linear
runs through servelm's quantized layers (the routers stay float), the logits stay within the
method's error of the float model's, and greedy decoding mostly agrees."""

import pytest
import torch

from servelm.config import ModelConfig
from tiny_families import make_tiny_family_model
from tiny_models import greedy


def _engine(hf, quantization):
    from servelm.config import EngineArgs
    from servelm.engine_builder import assemble_engine

    config = ModelConfig.from_hf_config(hf.config.to_dict())
    args = EngineArgs(model="tiny", num_blocks=64, block_size=4, quantization=quantization)
    return assemble_engine(args, config, hf.state_dict().items(), None, "tiny")


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
# (relative logit error, teacher-forced top-1 agreement): measured on these tiny models
# 0.012-0.031 / 0.94-1.0 for int8 and 0.16-0.22 / 0.66-0.78 for int4 (groups of 32)
@pytest.mark.parametrize("method,tol,top1", [("int8", 0.05, 0.85), ("int4", 0.3, 0.5)])
def test_quantized_moe_tracks_the_float_model(family, method, tol, top1):
    from servelm.layers.moe import MoE
    from servelm.quant.quantized_linear import QuantizedLinear
    from tiny_models import prefill_logits

    hf = make_tiny_family_model(family, seed=3)
    ref_engine = _engine(hf, None)
    q_engine = _engine(hf, method)
    model = q_engine.runner.model
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.experts.w13 is None for m in moes)
    assert all(isinstance(q, QuantizedLinear) for m in moes
               for q in [*m.experts.q13, *m.experts.q2])
    assert all(type(m.gate) is torch.nn.Linear for m in moes)  # routers stay float
    attn = model.layers[0].self_attn
    assert all(isinstance(lin, QuantizedLinear) for lin in (attn.qkv_proj, attn.o_proj))
    assert isinstance(model.lm_head, torch.nn.Module) and type(model.lm_head) is not \
        torch.nn.Linear
    prompt = [(7 * i + 3) % 384 for i in range(32)]
    ref, got = prefill_logits(ref_engine, prompt), prefill_logits(q_engine, prompt)
    rel = (got - ref).norm() / ref.norm()
    assert rel < tol, f"{family} {method}: relative logit error {rel:.4f}"
    picks = got.argmax(-1)
    assert (picks == ref.argmax(-1)).float().mean() >= top1
    assert (ref.topk(5, -1).indices == picks[:, None]).any(-1).all()  # never far off
    # decode steps through the quantized experts pick what a prefill of the same tokens does
    out = greedy(q_engine, prompt[:8], 8)
    replay = prefill_logits(q_engine, prompt[:8] + out[:-1]).argmax(-1)[7:].tolist()
    assert replay == out


# (relative logit error, top-1 agreement) measured over seeds 3-5: int8 0.018-0.036 /
# 0.94-1.0 on both; int4 0.21 / 0.62-0.84 on V2, 0.38-0.47 / 0.47-0.62 on V3 (its 24-wide
# q latent is one int4 group, and sigmoid routing moves with the error)
@pytest.mark.parametrize("family,method,tol,top1", [
    ("deepseek_v2", "int8", 0.05, 0.85), ("deepseek_v3", "int8", 0.05, 0.85),
    ("deepseek_v2", "int4", 0.3, 0.5), ("deepseek_v3", "int4", 0.55, 0.4)])
def test_quantized_deepseek_tracks_the_float_model(family, method, tol, top1):
    """MLA's projections, the MLPs and the experts quantized; kv_b (absorbed into q and the
    output at decode) and the routers stay float."""
    from servelm.layers.moe import MoE
    from servelm.quant.quantized_linear import QuantizedLinear
    from tiny_models import prefill_logits

    hf = make_tiny_family_model(family, seed=3)
    ref_engine, q_engine = _engine(hf, None), _engine(hf, method)
    model = q_engine.runner.model
    attn = model.layers[0].self_attn
    projections = [p for p in (attn.q_proj, getattr(attn, "q_a_proj", None),
                               getattr(attn, "q_b_proj", None), attn.kv_a_proj_with_mqa,
                               attn.o_proj) if p is not None]
    assert len(projections) >= 3
    assert all(isinstance(p, QuantizedLinear) for p in projections)
    assert attn.kv_b_weight.dtype == torch.float32
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes and all(m.experts.w13 is None for m in moes)
    assert all(type(m.gate) is torch.nn.Linear for m in moes)
    prompt = [(7 * i + 3) % 384 for i in range(32)]
    ref, got = prefill_logits(ref_engine, prompt), prefill_logits(q_engine, prompt)
    rel = (got - ref).norm() / ref.norm()
    assert rel < tol, f"{family} {method}: relative logit error {rel:.4f}"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= top1
    out = greedy(q_engine, prompt[:8], 8)  # decodes (absorbed path) agree with prefills
    replay = prefill_logits(q_engine, prompt[:8] + out[:-1]).argmax(-1)[7:].tolist()
    assert replay == out


def test_families_without_the_hook_refuse_by_name():
    hf = make_tiny_family_model("gemma2", seed=0)
    with pytest.raises(ValueError, match="'int8' is not supported for the gemma2 family"):
        _engine(hf, "int8")
    with pytest.raises(ValueError, match="int8, int4"):
        _engine(make_tiny_family_model("mixtral"), "fp8")
    with pytest.raises(ValueError, match="'gguf' needs a GGUF file"):  # float weights given
        _engine(make_tiny_family_model("mixtral"), "gguf")
