"""Random-weight LoRA adapters in the PEFT format for a model's shapes (benchmarks, tests).

Owns: `write_random_adapter(path, model_config, rank, targets)`: adapter_config.json and
adapter_model.safetensors as PEFT writes them (tensor names
base_model.model.model.layers.N.<self_attn|mlp>.<module>.lora_<A|B>.weight), with A and B
both random and non-zero, so every adapter changes the model and adapters differ.
Never: trains anything, or needs the base model's weights (only its ModelConfig).
"""

from __future__ import annotations

import json
import os

from servelm.lora.adapter import LINEAR_PARENT, TARGETS, target_shapes


def write_random_adapter(path: str, model_config, rank: int = 16,
                         targets: tuple[str, ...] = ("q_proj", "v_proj"), alpha: float = 32.0,
                         seed: int = 0, scale: float = 0.02) -> str:
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = target_shapes(model_config)
    tensors = {}
    for layer in range(model_config.num_layers):
        for module in targets:
            linear, slice_ = TARGETS[module]
            n_in, n_out = shapes[(linear, slice_)]
            stem = (f"base_model.model.model.layers.{layer}.{LINEAR_PARENT[linear]}."
                    f"{module}")
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * scale
            tensors[f"{stem}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * scale
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
              "base_model_name_or_path": model_config.name or "", "inference_mode": True}
    with open(os.path.join(path, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return path


__all__ = ["write_random_adapter"]
