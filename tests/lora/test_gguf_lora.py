"""LoRA over the default model's GGUF blocks kept as they are (--quantization gguf): the
adapter's products ride on the quantized projections; its change of the logits matches the
same adapter's change over the dequantized float32 weights."""

import pytest
import torch

pytestmark = pytest.mark.slow  # two builds of the default model

MODEL = "smollm2-135m-instruct"


def _logits(engine, prompt, name):
    from test_parity import lora_logits

    return lora_logits(engine, prompt, name)


def test_adapter_over_gguf_blocks(default_model_path, tmp_path):
    from servelm.bench.lora_adapters import write_random_adapter
    from servelm.config import EngineArgs
    from servelm.engine_builder import build_engine

    engines = {}
    for quant in (None, "gguf"):
        engines[quant] = build_engine(EngineArgs(model=MODEL, quantization=quant,
                                                 enable_lora=True, max_loras=1,
                                                 kv_cache_memory=32 * 2**20))
    write_random_adapter(str(tmp_path / "a"), engines[None].model_config, rank=8,
                         targets=("q_proj", "v_proj", "down_proj"), scale=0.05)
    prompt = engines[None].tokenizer.encode("The capital of France is")
    deltas = {}
    for quant, engine in engines.items():
        engine.load_lora("a", str(tmp_path / "a"))
        deltas[quant] = _logits(engine, prompt, "a") - _logits(engine, prompt, None)
        assert engine.runner.lora.num_lora_steps == 1
    assert deltas[None].abs().max() > 0.5  # the adapter changes the model
    err = (deltas["gguf"] - deltas[None]).abs().max() / deltas[None].abs().max()
    assert err < 0.25, err  # Q4_1 blocks change the base a little, not the adapter's effect
