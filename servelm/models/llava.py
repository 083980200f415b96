"""LLaVA: a CLIP ViT (fixed resolution, a class token, learned positions) whose
second-to-last layer's patch features pass through a two-layer MLP projector into a Llama
decoder, one prompt token per patch.

The decoder is servelm's Llama stack unchanged (1-D positions); image embeddings come in the
ForwardBatch (`batch.mm`, from servelm/vision/runner.py) and replace the placeholder rows.
Never: preprocesses images (servelm/vision/processors.py) or caches encoder outputs.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.config import ModelConfig
from servelm.models.llama import LlamaForCausalLM
from servelm.models.qwen2_vl import _ACTS, ImageTextLM, _linear, _pixels


class _ClipAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj = _linear(dim, dim), _linear(dim, dim)
        self.v_proj, self.out_proj = _linear(dim, dim), _linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [B, P, E]
        b, p, e = x.shape

        def heads(t):
            return t.view(b, p, self.num_heads, -1).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)),
                                           heads(self.v_proj(x)))
        return self.out_proj(o.transpose(1, 2).reshape(b, p, e))


class _ClipMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2 = _linear(dim, hidden), _linear(hidden, dim)
        self.act = _ACTS[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _ClipLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, hidden: int, act: str, eps: float):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(dim, eps=eps)
        self.self_attn = _ClipAttention(dim, num_heads)
        self.layer_norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = _ClipMLP(dim, hidden, act)

    def forward(self, x):
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Embeddings(nn.Module):
    def __init__(self, dim: int, channels: int, patch: int, num_positions: int):
        super().__init__()
        self.patch = patch
        # Conv2d with stride == kernel is a matmul over each flattened (C, p, p) patch
        self.patch_embedding = _linear(channels * patch * patch, dim, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(dim), requires_grad=False)
        self.position_embedding = nn.Embedding(num_positions, dim,
                                               _weight=torch.empty(num_positions, dim))
        self.position_embedding.requires_grad_(False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, 1+P, E]
        b, c, h, w = pixels.shape
        p = self.patch
        patches = pixels.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = self.patch_embedding(patches.reshape(b, (h // p) * (w // p), c * p * p))
        x = torch.cat([self.class_embedding.expand(b, 1, -1).to(x.dtype), x], dim=1)
        return x + self.position_embedding.weight[:x.shape[1]]


class ClipVisionTower(nn.Module):
    def __init__(self, enc: dict):
        super().__init__()
        dim, eps = int(enc["hidden_size"]), float(enc.get("layer_norm_eps", 1e-5))
        patch, size = int(enc.get("patch_size", 14)), int(enc.get("image_size", 336))
        self.embeddings = _Embeddings(dim, int(enc.get("num_channels", 3)), patch,
                                      (size // patch) ** 2 + 1)
        self.pre_layrnorm = nn.LayerNorm(dim, eps=eps)
        num_layers = int(enc["num_hidden_layers"])
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(
            _ClipLayer(dim, int(enc["num_attention_heads"]), int(enc["intermediate_size"]),
                       enc.get("hidden_act", "quick_gelu"), eps) for _ in range(num_layers))
        self.post_layernorm = nn.LayerNorm(dim, eps=eps)  # loaded; the features skip it
        layer = int(enc.get("_vision_feature_layer", -2))
        # hidden state k is the output of k layers (0: the embeddings after pre_layrnorm)
        self.num_feature_layers = layer if layer >= 0 else num_layers + 1 + layer
        self.keep_cls = enc.get("_vision_feature_select_strategy", "default") == "full"

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = self.pre_layrnorm(self.embeddings(pixels.to(self.pre_layrnorm.weight.dtype)))
        for layer in self.encoder.layers[:self.num_feature_layers]:
            x = layer(x)
        return x if self.keep_cls else x[:, 1:]


class _Projector(nn.Module):
    def __init__(self, n_in: int, n_out: int, act: str, bias: bool):
        super().__init__()
        self.linear_1, self.linear_2 = _linear(n_in, n_out, bias), _linear(n_out, n_out, bias)
        self.act = _ACTS[act]

    def forward(self, x):
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaForConditionalGeneration(ImageTextLM):
    family = "llava"

    def __init__(self, config: ModelConfig, backend, quant=None):
        super().__init__()
        if quant is not None:
            raise ValueError(f"quantization {getattr(quant, 'name', quant)!r} is not supported "
                             "for the llava family (float only)")
        if config.vision is None:
            raise ValueError("llava needs the checkpoint's vision_config")
        enc = config.vision.encoder
        if isinstance(enc.get("_vision_feature_layer"), list):
            raise ValueError("llava: a list of vision_feature_layer values is not supported")
        self.config = config
        self.language_model = LlamaForCausalLM(config, backend)
        self.vision_tower = ClipVisionTower(enc)
        self.multi_modal_projector = _Projector(
            int(enc["hidden_size"]), config.hidden_size, enc.get("_projector_hidden_act", "gelu"),
            bool(enc.get("_multimodal_projector_bias", True)))

    def encode_images(self, images: list) -> list[torch.Tensor]:
        """ImageInputs ([C, H, W] pixels, all one size) -> [num_tokens, hidden] each."""
        device = self.vision_tower.pre_layrnorm.weight.device
        pixels = torch.stack([_pixels(img, device) for img in images])
        return list(self.multi_modal_projector(self.vision_tower(pixels)).unbind(0))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names of either layout: `vision_tower.*` / `multi_modal_projector.*` /
        `language_model.model.*`, or the same under `model.` with `lm_head.*` on top."""
        own = {n: p for n, p in self.named_parameters() if not n.startswith("language_model.")}
        text, loaded = [], set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name.startswith(("vision_tower.", "multi_modal_projector.")):
                name = name.replace("vision_tower.vision_model.", "vision_tower.")
                if name.endswith("patch_embedding.weight"):
                    tensor = tensor.reshape(tensor.shape[0], -1)
                if name not in own or own[name].shape != tensor.shape:
                    raise ValueError(f"checkpoint tensor {raw!r} {tuple(tensor.shape)} has no "
                                     "place in the llava vision tower or projector")
                own[name].data.copy_(tensor)
                loaded.add(name)
                continue
            name = name.removeprefix("language_model.")
            text.append((name if name == "lm_head.weight" else
                         "model." + name.removeprefix("model."), tensor))
        missing = sorted(set(own) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks vision tensors: {missing[:8]}")
        self.language_model.load_weights(text)


__all__ = ["ClipVisionTower", "LlavaForConditionalGeneration"]
