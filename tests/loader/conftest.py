"""Session fixtures: the default GGUF as servelm loads it, and as transformers loads it.

transformers' GGUF code is the independent reference; each load takes seconds, so once per
session.
"""

import pytest
import torch


@pytest.fixture(scope="session")
def gguf_source(default_model_path):
    from servelm.loader import resolve_model

    return resolve_model(str(default_model_path))


@pytest.fixture(scope="session")
def gguf_tokenizer(gguf_source):
    from servelm.loader import load_tokenizer

    return load_tokenizer(gguf_source)


@pytest.fixture(scope="session")
def reference_tokenizer(default_model_path):
    """transformers' own conversion of the GGUF vocabulary (AutoTokenizer with gguf_file)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        default_model_path.parent, gguf_file=default_model_path.name
    )


@pytest.fixture(scope="session")
def reference_gguf_tensors(default_model_path):
    """The GGUF's tensors as transformers dequantizes, un-permutes and names them.

    This is the code `from_pretrained(..., gguf_file=...)` runs for llama files; calling it
    directly skips the model instantiation, which would also require `accelerate`.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The model only supplies parameter names for transformers' GGUF->HF name map (and a
    # tensor transformers cannot name is dropped, so a wrong layer count fails the name
    # comparison). The head counts used to un-permute q/k are read by transformers itself.
    config = LlamaConfig(num_hidden_layers=30, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    loaded = load_gguf_checkpoint(str(default_model_path), return_tensors=True, model_to_load=model)
    return loaded["tensors"]
