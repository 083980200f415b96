"""LoRA test helpers: tiny random-weight Llama models and PEFT adapters made for them.

TRITON_INTERPRET is set before any kernel module is imported (as tests/kernels does), so the
SGMV kernel's parity test runs on the CPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(hf_model, path, r=8, targets=("q_proj", "v_proj"), alpha=16, seed=1,
                 use_rslora=False, scale=0.1):
    """A PEFT LoRA adapter of `hf_model` saved at `path`, with random non-zero A and B (PEFT
    initialises B to zero, which would leave the model unchanged). Returns the PeftModel."""
    import copy

    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0,
                     init_lora_weights=False, use_rslora=use_rslora)
    peft_model = get_peft_model(copy.deepcopy(hf_model), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    peft_model.eval()
    peft_model.save_pretrained(str(path))
    return peft_model


@pytest.fixture(scope="module")
def base_hf():
    from tiny_models import make_tiny_hf_model

    return make_tiny_hf_model("llama", seed=0)
