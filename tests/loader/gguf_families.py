"""Helpers of the GGUF family tests (import as `gguf_families`): a word-level vocabulary in a
GGUFWriter, and the check that a file loads to its transformers checkpoint's function."""

from __future__ import annotations

import torch

from servelm.config import EngineArgs
from tiny_models import greedy, prefill_logits


def add_shape(writer, cfg) -> None:
    """The hyper-parameters every family writes, from a transformers config."""
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)


def add_word_vocab(writer, vocab_size: int, pre: str = "default") -> None:
    """tokenizer.ggml.* for `vocab_size` plain tokens (the tests feed token ids)."""
    tokens = [f"<t{i}>" for i in range(vocab_size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges([])
    writer.add_eos_token_id(0)


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def assert_matches_transformers(model, path, prompt: list[int], max_tokens: int) -> None:
    """The GGUF file served by servelm: prefill logits within 1e-4 of `model`'s, and the
    same greedy tokens as transformers' generate."""
    from servelm.engine_builder import build_engine

    engine = build_engine(EngineArgs(model=str(path), num_blocks=64, block_size=4,
                                     dtype="float32", prepared_weights_cache=False))
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(engine, prompt), ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                              do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()
    assert greedy(engine, prompt, max_tokens) == want
