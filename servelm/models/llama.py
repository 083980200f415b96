"""Llama-family decoder (Llama 2/3/3.1, Mistral, SmolLM2), the base of Qwen2 and Qwen3.

Mistral's sliding window (ModelConfig.sliding_window) is honoured: a layer that slides asks
the attention backend for the window once a sequence in the step is longer than it.

Takes `(input_ids[T], positions[T], batch)` over a flat batch of tokens from many sequences:
no padding, no per-request state. q/k/v and gate/up projections are fused into one matmul each.
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.activation import gate_up_silu
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.models.packed import PACKED_MODULES, part_rows, parts_of
from servelm.quant import finalize_linears, make_linear


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend,
                 quant=None):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                    config.attention_bias, quant)
        self.o_proj = make_linear(self.q_size, config.hidden_size, False, quant)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.window = config.sliding_window if config.is_sliding_layer(layer) else 0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)  # q: [T, H, D]
        k = k.view(t, self.num_kv_heads, self.head_dim)  # k: [T, K, D]
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.window and max(batch.seq_lens) > self.window:
            if not getattr(self.backend, "supports_variants", False):
                raise ValueError(f"attention backend {getattr(self.backend, 'name', '?')!r} "
                                 "does not implement sliding_window; use attention_backend "
                                 "'torch'")
            out = self.backend.forward(self.layer, q, k, v, batch, window=self.window)
        else:
            out = self.backend.forward(self.layer, q, k, v, batch)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant=None):
        super().__init__()
        self.gate_up_proj = make_linear(config.hidden_size, 2 * config.intermediate_size,
                                        False, quant)
        self.down_proj = make_linear(config.intermediate_size, config.hidden_size, False, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(gate_up_silu(self.gate_up_proj, x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend,
                 quant=None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer, rotary, backend, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, quant)

    def forward(self, positions, x, residual, batch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, backend, quant=None):
        """quant: a `servelm.quant` method; linear layers then quantize after loading."""
        super().__init__()
        self.config = config
        self.quant = quant
        # An explicit (empty) weight: nn.Embedding would otherwise draw normal_ init, which
        # on the meta device imports torch._dynamo (1.5 s of every start-up).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens.requires_grad_(False)
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, rotary, backend, quant) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = make_linear(config.hidden_size, config.vocab_size, False, quant,
                                       is_lm_head=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return hidden @ self.embed_tokens.weight.t()
        return self.lm_head(hidden)

    # -- weights ---------------------------------------------------------------------------

    packed_modules = PACKED_MODULES  # q/k/v -> qkv_proj, gate/up -> gate_up_proj (packed.py)
    checkpoint_packed: tuple[str, ...] = ()  # its checkpoints store every projection apart

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        parts = parts_of(self.packed_modules)  # HF name fragment -> (packed parameter, index)
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            target, shard = name, None
            for part, (fused, idx) in parts.items():
                if f".{part}." in name:
                    target, shard = name.replace(part, fused), idx
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            self._copy_shard(params[target], tensor, shard, target)
            loaded.add(target if shard is None else f"{target}#{shard}")
        self._check_complete(params, loaded)

    def process_weights_after_loading(self) -> None:
        """Quantize the linear layers now that fused weights are whole (no-op in float)."""
        if self.quant is None:
            return
        head = self.quant.lm_head_method()
        if self.lm_head is None and head is not None:
            # Tied: the head gets its own quantized copy; the lookup keeps the float rows.
            self.lm_head = head.from_float(self.embed_tokens.weight.data, None)
        finalize_linears(self)

    def _packed_name(self, name: str) -> str | None:
        """The packed parameter `name` ("layers.0.self_attn.qkv_proj.weight") belongs to."""
        leaf = name.rsplit(".", 2)[-2]
        return leaf if leaf in self.packed_modules else None

    def _shard_sizes(self, fused: str) -> list[int]:
        return part_rows(self.config, self.packed_modules, self._packed_name(fused))

    def _copy_shard(self, param, tensor, shard, target) -> None:
        if shard is None:
            dst, row = param.data, 0
        else:
            sizes = self._shard_sizes(target)
            row = sum(sizes[:shard])
            dst = param.data.narrow(0, row, sizes[shard])
        if dst.shape != tensor.shape:
            raise ValueError(f"{target} shard {shard}: checkpoint shape {tuple(tensor.shape)} "
                             f"!= model shape {tuple(dst.shape)}")
        if not isinstance(tensor, torch.Tensor):  # GGUF blocks kept quantized (servelm.quant)
            owner = self.get_submodule(target.rpartition(".")[0])
            if hasattr(owner, "load_blocks"):
                owner.load_blocks(tensor, row)
                return
            tensor = tensor.dequantize()
        dst.copy_(tensor)

    def _check_complete(self, params, loaded: set[str]) -> None:
        missing = []
        for name in params:
            fused = self._packed_name(name) is not None
            if fused and name.endswith("weight") or fused and name.endswith("bias"):
                n = len(self._shard_sizes(name))
                missing += [f"{name}#{i}" for i in range(n) if f"{name}#{i}" not in loaded]
            elif name not in loaded:
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
