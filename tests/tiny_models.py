"""Tiny random-weight models: the unit tests' models (import as `tiny_models`)."""


TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def make_tiny_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A random-weight transformers model small enough for a unit test (float32, eval)."""
    import torch
    import transformers

    cfg_name, model_name, extra = TINY_ARCHS[arch]
    kwargs = dict(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    config = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, model_name)(config).eval()
    # Larger-than-default weights make logits spread out, so greedy picks are rarely ties.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    return model


def save_tiny_checkpoint(hf_model, path):
    """`hf_model` as a Hugging Face folder servelm can load by path: its safetensors and a
    word-level tokenizer.json with one word per id of its vocabulary. Returns `path`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    hf_model.save_pretrained(path, safe_serialization=True)
    vocab = {f"w{i}": i for i in range(hf_model.config.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def make_tiny_engine(hf_model, **engine_kwargs):
    """A servelm engine holding the same weights as `hf_model` (no tokenizer: ids only)."""
    from servelm.config import EngineArgs, ModelConfig
    from servelm.engine_builder import assemble_engine

    config = ModelConfig.from_hf_config(hf_model.config.to_dict())
    engine_kwargs.setdefault("num_blocks", 256)
    engine_kwargs.setdefault("block_size", 4)
    args = EngineArgs(model="tiny", **engine_kwargs)
    return assemble_engine(args, config, hf_model.state_dict().items(), None, "tiny")


def prefill_logits(engine, prompt):
    """Logits at every position of `prompt` scored alone in `engine` (blocks freed after)."""
    from servelm.core.runner_state import score_item
    from servelm.engine.sequence import Sequence
    from servelm.protocol import RequestTimings, SamplingParams

    seq = Sequence("p", 0, prompt, SamplingParams(max_tokens=1), RequestTimings(), 1)
    engine.block_manager.allocate(seq, len(prompt))
    try:
        return engine.runner.score([score_item(seq.token_ids, seq.block_table, 0,
                                               len(prompt))])
    finally:
        engine.block_manager.free(seq)


def greedy(engine, prompt, max_tokens):
    """The engine's greedy tokens for `prompt` alone (EOS ignored)."""
    from servelm.protocol import EngineRequest, SamplingParams

    engine.add_request(EngineRequest("greedy", list(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True)))
    out = []
    while engine.has_unfinished:
        out += [t for d in engine.step() for t in d.token_ids]
    return out
