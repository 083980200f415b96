"""DeepSeek's latent attention on the Triton backend (interpreted on the CPU): the same
logits and greedy tokens as the torch backend, decodes through the split-K kernel over the
[latent | rope key] cache, prefill chunks after a cached prefix."""

import pytest
import torch

from tiny_families import make_tiny_family_model
from tiny_models import greedy, make_tiny_engine, prefill_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_triton_mla_matches_the_torch_backend(family, monkeypatch):
    from servelm.attention import triton_backend

    calls = []
    kernel = triton_backend.decode_attention
    monkeypatch.setattr(triton_backend, "decode_attention",
                        lambda *a, **kw: calls.append(a[1].shape) or kernel(*a, **kw))
    hf = make_tiny_family_model(family, seed=6)
    ref = make_tiny_engine(hf, num_blocks=64)
    tri = make_tiny_engine(hf, num_blocks=64, attention_backend="triton", device=DEVICE,
                           max_num_batched_tokens=8)  # prompts in chunks of 8
    prompt = [(5 * i + 2) % 384 for i in range(19)]
    torch.testing.assert_close(prefill_logits(tri, prompt).cpu(), prefill_logits(ref, prompt),
                               atol=1e-4, rtol=1e-4)
    assert greedy(tri, prompt, 6) == greedy(ref, prompt, 6)
    assert tri.runner.backend.name == "triton"
    cfg = hf.config
    entry = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    # 5 decode steps x 3 layers, each over the one-head [latent | rope key] cache
    assert len(calls) == 5 * cfg.num_hidden_layers and all(
        shape[1:] == (1, entry) for shape in calls)
