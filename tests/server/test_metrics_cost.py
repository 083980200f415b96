"""The bandwidth / compute utilisation in /metrics counts every weight a step reads, from
the cost module: on the default CPU path the linears are packed (weights in buffers, not
parameters), and counting only `model.parameters()` left them out."""

from __future__ import annotations

from types import SimpleNamespace

from servelm.planner.hardware import default_peaks
from servelm.server.metrics import CostModel


def test_step_cost_counts_the_packed_linears_of_the_default_model(engine):
    c = engine.model_config  # SmolLM2-135M: its shapes, not typed-in numbers
    linears = c.num_layers * (c.hidden_size * (2 * c.q_size + 2 * c.kv_size)
                              + 3 * c.hidden_size * c.intermediate_size)
    norms = c.num_layers * 2 * c.hidden_size + c.hidden_size
    head = c.vocab_size * c.hidden_size  # tied: the embedding matrix, read as the LM head
    weight_bytes = (linears + norms + head) * 4  # float32, the default dtype
    assert weight_bytes > 500e6  # ~538 MB; the parameters alone were ~113 MB

    cost = CostModel.from_engine(engine, None, None)
    assert cost.weight_bytes == weight_bytes
    # one decode step of 3 sequences at contexts 10, 20, 30: 63 keys attended, 63 pairs
    stats = SimpleNamespace(last_num_tokens=3, last_num_context_tokens=11 + 21 + 31,
                            last_num_attention_pairs=11 + 21 + 31)
    nbytes, flops = cost.step_cost(stats)
    kv_per_token = 2 * c.num_layers * c.kv_size * 4
    assert nbytes == weight_bytes + kv_per_token * (63 + 3)
    attention = 63 * 4 * c.num_layers * c.num_heads * c.head_dim
    assert flops == 3 * 2 * (linears + c.num_layers * 2 * c.hidden_size + head) + attention
    assert (cost.peak_bandwidth, cost.peak_flops) == default_peaks("cpu")
    # the front end's way, with only the ModelConfig and the engine's options
    assert cost == CostModel.from_config(c, dtype="float32", quantization=None,
                                         kv_cache_dtype="auto", device_type="cpu",
                                         peak_bandwidth=None, peak_flops=None)


def test_quantization_and_fp8_kv_change_the_bytes():
    from servelm.config import ModelConfig

    c = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 2048, tie_word_embeddings=True,
                    gguf_weight_type="Q4_1")
    f32 = CostModel.from_config(c, dtype="float32", quantization=None, kv_cache_dtype="auto",
                                device_type="cpu", peak_bandwidth=None, peak_flops=None)
    gguf = CostModel.from_config(c, dtype="float32", quantization="gguf",
                                 kv_cache_dtype="fp8", device_type="cuda", peak_bandwidth=1e9,
                                 peak_flops=2e9)
    assert 4.5 < f32.weight_bytes / gguf.weight_bytes < 5.5  # 4 B vs ~0.75 B per weight
    assert gguf.kv_bytes_per_token * 4 == f32.kv_bytes_per_token
    assert (gguf.peak_bandwidth, gguf.peak_flops) == (1e9, 2e9)
