"""Qwen2-VL: a ViT over dynamic-resolution images (2-D rotary, 2x2 patch merger) feeding the
Qwen2 decoder, whose rotary follows three positions per token (M-RoPE: time, row, column).

The decoder is servelm's Llama stack (q/k/v biases, as Qwen2) with the rotary replaced by
MRotaryEmbedding; image embeddings and the three position rows come in the ForwardBatch
(`batch.mm`, built by servelm/vision/runner.py), so the model keeps no per-request state.
A batch without images runs on the 1-D positions: for text the three rows are equal, and
M-RoPE with equal rows is plain rope.

Never: preprocesses images (servelm/vision/processors.py) or caches encoder outputs
(servelm/vision/encoder_cache.py).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.rotary import RotaryEmbedding, _rotate
from servelm.models.decoder import DecoderLM
from servelm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM


class MRotaryEmbedding(RotaryEmbedding):
    """Rotary over [3, T] positions: frequency block i of `section` turns with row i % 3."""

    def __init__(self, config: ModelConfig, section: tuple[int, ...]):
        super().__init__(config.head_dim, config.max_position_embeddings, config.rope_theta,
                         config.rope_scaling)
        if sum(section) != config.head_dim // 2:
            raise ValueError(f"mrope_section {list(section)} must sum to head_dim / 2 = "
                             f"{config.head_dim // 2}")
        self.section = tuple(section)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        cos_rows, sin_rows = self.cos[positions], self.sin[positions]  # [3, T, D/2]
        cos = torch.cat([c[i % 3] for i, c in enumerate(cos_rows.split(self.section, -1))], -1)
        sin = torch.cat([s[i % 3] for i, s in enumerate(sin_rows.split(self.section, -1))], -1)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, D/2]
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _linear(n_in: int, n_out: int, bias: bool = True) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias)
    layer.requires_grad_(False)
    return layer


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {"quick_gelu": quick_gelu, "gelu": F.gelu, "silu": F.silu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.qkv = _linear(dim, 3 * dim)
        self.proj = _linear(dim, dim)
        self.fc1 = _linear(dim, mlp_dim)
        self.fc2 = _linear(mlp_dim, dim)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, -1).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)  # [N, H, D]
        outs = []
        for qi, ki, vi in zip(q.split(lengths), k.split(lengths), v.split(lengths)):
            # one image attends within itself only (full, not causal)
            o = F.scaled_dot_product_attention(qi.transpose(0, 1), ki.transpose(0, 1),
                                               vi.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(qi.shape[0], -1))
        x = x + self.proj(torch.cat(outs))
        return x + self.fc2(self.act(self.fc1(self.norm2(x))))


class Qwen2VisionTower(nn.Module):
    def __init__(self, enc: dict, out_dim: int):
        super().__init__()
        self.dim = int(enc["embed_dim"])
        self.num_heads = int(enc["num_heads"])
        self.patch = int(enc.get("patch_size", enc.get("spatial_patch_size", 14)))
        self.temporal = int(enc.get("temporal_patch_size", 2))
        self.merge = int(enc.get("spatial_merge_size", 2))
        channels = int(enc.get("in_channels", enc.get("in_chans", 3)))  # older configs
        self.patch_dim = channels * self.temporal * self.patch ** 2
        self.rope_theta = float((enc.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        # Conv3d with stride == kernel over one patch is a matmul: kept as a linear
        self.patch_embed = _linear(self.patch_dim, self.dim, bias=False)
        mlp_dim = int(self.dim * float(enc.get("mlp_ratio", 4)))
        act = enc.get("hidden_act", "quick_gelu")
        self.blocks = nn.ModuleList(VisionBlock(self.dim, self.num_heads, mlp_dim, act)
                                    for _ in range(int(enc["depth"])))
        merged = self.dim * self.merge ** 2
        self.ln_q = nn.LayerNorm(self.dim, eps=1e-6)
        self.merger_fc1 = _linear(merged, merged)
        self.merger_fc2 = _linear(merged, out_dim)

    def forward(self, pixels: torch.Tensor, grids: list[list[int]]) -> torch.Tensor:
        """pixels: [N patches, C*T*p*p] of every image in order -> [N / merge^2, out_dim]."""
        x = self.patch_embed(pixels.to(self.ln_q.weight.dtype))
        cos, sin = self._rotary(grids, x.device)
        lengths = [t * h * w for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, lengths)
        x = self.ln_q(x).view(-1, self.dim * self.merge ** 2)
        return self.merger_fc2(F.gelu(self.merger_fc1(x)))

    def _rotary(self, grids: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [N, 1, D/2]: the first half of the frequencies turn with the patch's row,
        the second with its column (patches laid out in merge-group order)."""
        m, rows, cols = self.merge, [], []
        for t, h, w in grids:
            hpos = torch.arange(h, device=device)[:, None].expand(h, w)
            wpos = torch.arange(w, device=device)[None, :].expand(h, w)
            for pos, out in ((hpos, rows), (wpos, cols)):
                out.append(pos.reshape(h // m, m, w // m, m).permute(0, 2, 1, 3)
                           .flatten().repeat(t))
        head_dim = self.dim // self.num_heads
        quarter = head_dim // 2
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, quarter, 2, dtype=torch.float,
                                                           device=device) / quarter))
        freqs = torch.cat([torch.cat(rows)[:, None] * inv_freq,
                           torch.cat(cols)[:, None] * inv_freq], dim=-1)  # [N, D/2]
        return freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1)


class _MRopeTextModel(Qwen2ForCausalLM):
    """Qwen2-VL's text decoder: Qwen2 with M-RoPE (sections of the rotary frequencies
    turning with time, row and column)."""

    def make_rotaries(self, config: ModelConfig):
        rotary = MRotaryEmbedding(config, config.vision.mrope_section or (config.head_dim // 2,))
        return [rotary] * config.num_layers


class ImageTextLM(nn.Module):
    """The decoder side of a vision-language family: `language_model` (servelm's Llama
    stack) run with batch.mm's image embeddings in place of some rows' token embeddings,
    and its [3, T] M-RoPE positions where the family has them (LLaVA: None)."""

    language_model: DecoderLM
    # the language model's (checkpoint names are read by the language model's rules)
    packed_modules = LlamaForCausalLM.packed_modules
    checkpoint_packed = LlamaForCausalLM.checkpoint_packed

    @property
    def lm_head(self):
        return self.language_model.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch, **kwargs) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. batch.mm: image
        embeddings for some rows and M-RoPE positions (None: text only). kwargs: the
        language model's (DecoderLM.forward)."""
        lm = self.language_model
        mm = getattr(batch, "mm", None)
        if mm is None:
            return lm(input_ids, positions, batch, **kwargs)
        x = lm.embed(input_ids)
        if mm.rows.numel():
            x[mm.rows] = mm.embeds.to(x.dtype)
        if mm.positions is not None:
            positions = mm.positions
        return lm(input_ids, positions, batch, embeds=x, **kwargs)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    def fast_path(self):
        """Image rows (and M-RoPE positions) are not in the C++ decode stack."""
        from servelm.models.fast_path import Refusal

        return Refusal(f"{self.family}: a vision-language model's rows are not in the stack")


class Qwen2VLForConditionalGeneration(ImageTextLM):
    family = "qwen2_vl"

    def __init__(self, config: ModelConfig, backend, quant=None):
        super().__init__()
        if quant is not None:
            raise ValueError(f"quantization {getattr(quant, 'name', quant)!r} is not supported "
                             "for the qwen2_vl family (float only)")
        if config.vision is None:
            raise ValueError("qwen2_vl needs the checkpoint's vision_config")
        self.config = config
        self.vision = config.vision
        self.language_model = _MRopeTextModel(config, backend)
        self.visual = Qwen2VisionTower(config.vision.encoder, config.hidden_size)

    def encode_images(self, images: list) -> list[torch.Tensor]:
        """ImageInputs -> one [num_tokens, hidden] embedding tensor each, in one encoder run."""
        device = self.visual.ln_q.weight.device
        pixels = torch.cat([_pixels(img, device) for img in images])
        out = self.visual(pixels, [list(img.grid_thw) for img in images])
        return list(out.split([img.num_tokens for img in images]))

    # -- weights ---------------------------------------------------------------------------

    _MERGER = {"merger.mlp.0.": "merger_fc1.", "merger.mlp.2.": "merger_fc2.",
               "merger.ln_q.": "ln_q.", "attn.qkv.": "qkv.", "attn.proj.": "proj.",
               "mlp.fc1.": "fc1.", "mlp.fc2.": "fc2."}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names in either layout transformers writes: `visual.*` / `model.*` /
        `lm_head.*`, or `model.visual.*` / `model.language_model.*`."""
        text = []
        vis = dict(self.visual.named_parameters())
        loaded = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if name.startswith("visual."):
                target = name.removeprefix("visual.")
                for old, new in self._MERGER.items():
                    target = target.replace(old, new)
                if target == "patch_embed.proj.weight":
                    target, tensor = "patch_embed.weight", tensor.reshape(tensor.shape[0], -1)
                if target not in vis:
                    raise ValueError(f"checkpoint tensor {raw!r} has no place in the "
                                     "qwen2_vl vision tower")
                if vis[target].shape != tensor.shape:
                    raise ValueError(f"{raw}: checkpoint shape {tuple(tensor.shape)} != model "
                                     f"shape {tuple(vis[target].shape)}")
                vis[target].data.copy_(tensor)
                loaded.add(target)
            else:
                text.append(("model." + name.removeprefix("language_model.")
                             if name != "lm_head.weight" else name, tensor))
        missing = sorted(set(vis) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks vision tensors: {missing[:8]}")
        self.language_model.load_weights(text)


def _pixels(img, device) -> torch.Tensor:
    t = torch.frombuffer(bytearray(img.pixels), dtype=torch.float32)
    return t.view(*img.shape).to(device)


__all__ = ["ImageTextLM", "MRotaryEmbedding", "Qwen2VLForConditionalGeneration",
           "Qwen2VisionTower"]
