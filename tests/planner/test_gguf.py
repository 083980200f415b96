"""ModelConfig from GGUF metadata, written with gguf's own writer (no weights needed)."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from servelm.cost import count_params  # noqa: E402
from servelm.planner.model_catalog import builtin_model, resolve_model  # noqa: E402


def _write(path, arch, meta, tensors):
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        if isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_string(f"{arch}.{key}", value)
    for name in tensors:
        w.add_tensor(name, np.zeros((1,), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_llama_gguf_matches_hf_config(tmp_path):
    # Llama-3.1-8B's shapes under llama.cpp's metadata keys.
    path = tmp_path / "llama.gguf"
    _write(path, "llama", {"block_count": 32, "embedding_length": 4096,
                           "feed_forward_length": 14336, "attention.head_count": 32,
                           "attention.head_count_kv": 8, "vocab_size": 128256,
                           "context_length": 131072},
           ["token_embd.weight", "output.weight"])
    m = resolve_model(str(path))
    assert m.attention_kind == "GQA" and not m.tie_word_embeddings
    assert count_params(m).total == count_params(builtin_model("Llama-3.1-8B")).total


def test_deepseek_gguf_mla_and_moe(tmp_path):
    path = tmp_path / "ds.gguf"
    _write(path, "deepseek2", {
        "block_count": 61, "embedding_length": 7168, "feed_forward_length": 18432,
        "attention.head_count": 128, "attention.head_count_kv": 128, "vocab_size": 129280,
        "attention.kv_lora_rank": 512, "attention.q_lora_rank": 1536,
        "attention.key_length": 192, "attention.value_length": 128,
        "rope.dimension_count": 64, "expert_count": 256, "expert_used_count": 8,
        "expert_shared_count": 1, "expert_feed_forward_length": 2048,
        "leading_dense_block_count": 3}, ["token_embd.weight", "output.weight"])
    m = resolve_model(str(path))
    ref = builtin_model("DeepSeek-V3")
    assert m.is_mla and m.qk_nope_head_dim == 128 and m.v_head_dim == 128
    assert count_params(m).total == count_params(ref).total
    assert count_params(m).active == count_params(ref).active


def test_tied_embeddings_detected_by_missing_output(tmp_path):
    path = tmp_path / "tied.gguf"
    _write(path, "llama", {"block_count": 2, "embedding_length": 64,
                           "feed_forward_length": 128, "attention.head_count": 4,
                           "vocab_size": 100}, ["token_embd.weight"])
    m = resolve_model(str(path))
    assert m.tie_word_embeddings and m.attention_kind == "MHA"
