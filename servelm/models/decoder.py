"""DecoderLM: the frame the non-Llama families share (embedding, layers, final norm, head)
and their weight loading from Hugging Face names.

A family subclasses it with its decoder layer and its name rules; each layer takes
`(positions, x, residual, batch) -> (x, residual)` as the Llama layers do, so the early-exit
draft (spec/draft.py) runs any family's first N layers. These families are not
LlamaForCausalLM subclasses on purpose: the CPU decode stack (runner/cpu_decode.py) takes
Llama-shaped models only and tells them apart by that type, so these run eagerly.

Never: quantizes (a quantization method is refused at build, naming the family).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.activation import act_and_mul, gate_up_silu, silu_and_mul
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.models.packed import PACKED_MODULES, PackedModules, part_offsets


class Placement(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, start+len) of `target` (the whole
    tensor when rows is None), inside expert `expert` of a stacked expert tensor."""

    target: str
    rows: tuple[int, int] | None = None
    expert: int | None = None


Rule = tuple[str, Callable[[re.Match], Placement | None]]


# weight-only methods built from float weights, per linear (servelm/quant/methods.py), and
# 'gguf': a GGUF file's Q8_0/Q4_0/Q4_1 blocks kept as they are (float values elsewhere)
_EXPERT_METHODS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256", "gguf")


class DecoderLM(nn.Module):
    family = ""  # for error messages
    # Families whose linears a weight-only method (int8, int4) may quantize after loading
    # (process_weights_after_loading); the others refuse a method by name.
    quantizable = False
    # checkpoint projections stacked into one parameter (packed.py): the rules read it
    packed_modules: PackedModules = PACKED_MODULES
    # the packed parameters its checkpoints store whole, under the packed name (Phi-3's)
    checkpoint_packed: tuple[str, ...] = ()
    # (regex over the HF name without "model.", -> Placement or None to skip), first match wins
    rules: tuple[Rule, ...] = ()

    def __init__(self, config: ModelConfig, quant=None):
        super().__init__()
        # (param name, expert or None) -> {first row: GGUF blocks} under --quantization gguf
        self._gguf_blocks: dict[tuple[str, int | None], dict[int, object]] = {}
        if quant is not None and not (self.quantizable and quant.name in _EXPERT_METHODS):
            raise ValueError(f"quantization {getattr(quant, 'name', quant)!r} is not supported "
                             f"for the {self.family or config.architecture} family (float only"
                             + (f"; {', '.join(_EXPERT_METHODS)} quantize it" if
                                self.quantizable else "") + ")")
        self.config = config
        self.quant = quant
        # An explicit (empty) weight: nn.Embedding would otherwise draw normal_ init, which
        # on the meta device imports torch._dynamo (1.5 s of every start-up).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens.requires_grad_(False)
        self.embed_scale = 1.0  # Gemma multiplies the embedding by sqrt(hidden)
        self.layers = nn.ModuleList()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else
                        nn.Linear(config.hidden_size, config.vocab_size, bias=False))
        if self.lm_head is not None:
            self.lm_head.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                batch: ForwardBatch, num_layers: int | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]. num_layers: the
        first N layers, then the final norm (an early-exit draft); None: all."""
        x, residual = self.embed(input_ids), None
        for layer in self.layers[:num_layers]:
            x, residual = layer(positions, x, residual, batch)
        x, _ = self.norm(x, residual)
        return x

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_scale == 1.0 else x * torch.tensor(self.embed_scale, dtype=x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            logits = hidden @ self.embed_tokens.weight.t()
        else:
            logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def process_weights_after_loading(self) -> None:
        """With a quantization method: every linear of the layers (attention, dense and
        shared MLPs) and every routed expert becomes the method's layer, and the LM head its
        head method's; the MoE routers stay float (a routing decision is a discrete choice,
        and they are a sliver of the weights)."""
        if self.quant is None:
            return
        from servelm.layers.moe import MoE

        if self.quant.name == "gguf" and not self._gguf_blocks:
            raise ValueError("quantization 'gguf' needs a GGUF file's quantized blocks; these "
                             "weights came as floats (use int8 or int4)")
        for i, layer in enumerate(self.layers):
            for path, parent in list(layer.named_modules(prefix=f"layers.{i}")):
                if hasattr(parent, "quantize_experts"):
                    parent.quantize_experts(self.quant, lambda e, w, p=path: self._blocks_of(
                        f"{p}.{w}", e, getattr(parent, w).shape[1]))
                for name, child in list(parent.named_children()):
                    if type(child) is not nn.Linear:
                        continue
                    if isinstance(parent, MoE) and name in ("gate", "shared_gate"):
                        continue
                    bias = None if child.bias is None else child.bias.data
                    blocks = self._blocks_of(f"{path}.{name}.weight", None, child.out_features)
                    setattr(parent, name, self.quant.from_float(child.weight.data, bias)
                            if blocks is None else self.quant.from_blocks(blocks, bias))
        self._gguf_blocks = {}
        head = self.quant.lm_head_method()
        if head is not None:
            source = self.embed_tokens if self.lm_head is None else self.lm_head
            self.lm_head = head.from_float(source.weight.data, None)

    def _blocks_of(self, target: str, expert: int | None, num_rows: int):
        """The GGUF blocks loaded for every row of `target` (one expert's slice of it),
        fused; None where rows came as floats or of mixed types (the layer is then built
        from the float values)."""
        from servelm.quant.staged_linear import fuse_row_blocks

        return fuse_row_blocks(self._gguf_blocks.get((target, expert), {}), num_rows)

    # -- weights ---------------------------------------------------------------------------

    def place(self, name: str) -> Placement | None:
        """The placement of HF tensor `name` ("model." removed); None: not a model weight."""
        for pattern, make in self.rules:
            m = re.fullmatch(pattern, name)
            if m:
                return make(m)
        return Placement(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        saved = set(self.state_dict())  # parameters and persistent buffers
        params = {n: t for n, t in [*self.named_buffers(), *self.named_parameters()]
                  if n in saved}
        filled = {n: 0 for n in params}
        seen: set[Placement] = set()
        for raw, tensor in weights:
            name = raw.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: some checkpoints store the copy anyway
            p = self.place(name)
            if p is None:
                continue
            if p.target not in params:
                raise ValueError(f"checkpoint tensor {raw!r} has no place in the "
                                 f"{self.family} model")
            if p in seen:
                raise ValueError(f"checkpoint tensor {raw!r} given twice")
            seen.add(p)
            dst = params[p.target].data
            if p.expert is not None:
                dst = dst[p.expert]
            if p.rows is not None:
                dst = dst.narrow(0, *p.rows)
            if not isinstance(tensor, torch.Tensor):  # GGUF blocks: kept, and their values
                start = 0 if p.rows is None else p.rows[0]
                self._gguf_blocks.setdefault((p.target, p.expert), {})[start] = tensor
                tensor = tensor.dequantize()
            if dst.shape != tensor.shape:
                raise ValueError(f"{raw}: checkpoint shape {tuple(tensor.shape)} != model "
                                 f"shape {tuple(dst.shape)} ({p.target})")
            dst.copy_(tensor)
            filled[p.target] += dst.numel()
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
        for name, buf in self.named_buffers():
            if name.endswith("num_routed_tokens"):  # built on the meta device: uninitialised
                buf.zero_()


def _alternatives(names) -> str:
    return "|".join(re.escape(n) for n in names)


def qkv_rule(config: ModelConfig, table: PackedModules) -> Rule:
    """The parts of the table's qkv_proj (q/k/v_proj) into its rows, in the table's order."""
    parts = table["qkv_proj"]
    offsets = dict(zip([p.name for p in parts], part_offsets(config, table, "qkv_proj")))
    return (rf"(.*)\.self_attn\.({_alternatives(offsets)})\.(weight|bias)",
            lambda m: Placement(f"{m[1]}.self_attn.qkv_proj.{m[3]}", offsets[m[2]]))


def gate_up_rule(table: PackedModules, prefix: str, intermediate: int,
                 target: str | None = None) -> Rule:
    """`{prefix}.gate_proj` / `.up_proj` (the table's gate_up_proj parts) into
    `{target}.gate_up_proj`, `intermediate` rows each (a shared expert's width may differ
    from the config's)."""
    target = target or prefix
    index = {p.name: i for i, p in enumerate(table["gate_up_proj"])}
    return (rf"(.*)\.{re.escape(prefix)}\.({_alternatives(index)})\.weight",
            lambda m: Placement(f"{m[1]}.{target}.gate_up_proj.weight",
                                (index[m[2]] * intermediate, intermediate)))


def expert_rules(table: PackedModules, intermediate: int) -> tuple[Rule, ...]:
    """Routed experts, in the stacked layout transformers 5 writes (experts.gate_up_proj
    [E, 2I, hidden], experts.down_proj [E, hidden, I]) or one tensor per expert (Mixtral's
    block_sparse_moe.experts.N.w1/w3/w2, Qwen-MoE's and DeepSeek's mlp.experts.N.*_proj):
    the table's w13 parts, or its gate_up_proj parts, in w13's rows."""
    index = {p.name: i for packed in ("w13", "gate_up_proj")
             for i, p in enumerate(table[packed])}
    return (
        (r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.gate_up_proj",
         lambda m: Placement(f"{m[1]}.mlp.experts.w13")),
        (r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.down_proj",
         lambda m: Placement(f"{m[1]}.mlp.experts.w2")),
        (rf"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.({_alternatives(index)})\.weight",
         lambda m: Placement(f"{m[1]}.mlp.experts.w13", (index[m[3]] * intermediate,
                                                           intermediate), int(m[2]))),
        (r"(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(?:w2|down_proj)\.weight",
         lambda m: Placement(f"{m[1]}.mlp.experts.w2", None, int(m[2]))),
        (r"(.*)\.block_sparse_moe\.gate\.weight",
         lambda m: Placement(f"{m[1]}.mlp.gate.weight")),
    )


def make_rotary(config: ModelConfig, local: bool = False) -> RotaryEmbedding:
    """The rotary table of global layers, or with local=True of sliding-window layers where
    those have their own base (Gemma 3: plain rope at rope_local_theta)."""
    rotary_dim = int(config.head_dim * config.partial_rotary_factor)
    if local and config.rope_local_theta:
        return RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                               config.rope_local_theta, None, rotary_dim)
    return RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                           config.rope_scaling, rotary_dim)


def _frozen_linear(n_in: int, n_out: int, bias: bool = False) -> nn.Linear:
    linear = nn.Linear(n_in, n_out, bias=bias)
    linear.requires_grad_(False)
    return linear


class Attention(nn.Module):
    """GQA attention with a fused qkv projection and the variants a config asks for: q/k
    norms, a sliding window on this layer, soft-capped scores, a query_pre_attn_scalar."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend,
                 norm: type[RMSNorm] = RMSNorm):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = _frozen_linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                       config.attention_bias)
        self.o_proj = _frozen_linear(self.q_size, config.hidden_size)
        self.q_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = norm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary
        self.backend = backend
        self.window = config.sliding_window if config.is_sliding_layer(layer) else 0
        self.softcap = config.attn_logit_softcapping
        # The backend scales scores by 1/sqrt(head_dim); a query_pre_attn_scalar s wants
        # 1/sqrt(s), so q takes the ratio.
        s = config.query_pre_attn_scalar
        self.q_mult = math.sqrt(config.head_dim / s) if s else 1.0

    def forward(self, positions: torch.Tensor, x: torch.Tensor, batch: ForwardBatch):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)  # q: [T, H, D]
        k = k.reshape(t, self.num_kv_heads, self.head_dim)  # k: [T, K, D]
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if self.q_mult != 1.0:
            q = q * self.q_mult
        out = self.backend.forward(self.layer, q, k, v, batch, **self._variants(batch))
        return self.o_proj(out.reshape(t, self.q_size))

    def _variants(self, batch: ForwardBatch) -> dict:
        extra = {}
        if self.window and batch.seq_lens and max(batch.seq_lens) > self.window:
            extra["window"] = self.window  # shorter contexts: the window changes nothing
        if self.softcap:
            extra["softcap"] = self.softcap
        if extra and not getattr(self.backend, "supports_variants", False):
            raise ValueError(f"attention backend {getattr(self.backend, 'name', '?')!r} "
                             f"implements neither sliding_window nor attn_logit_softcapping; "
                             "use attention_backend 'torch'")
        return extra


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        self.gate_up_proj = _frozen_linear(hidden_size, 2 * intermediate_size)
        self.down_proj = _frozen_linear(intermediate_size, hidden_size)
        self.act_and_mul = act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_and_mul is silu_and_mul:
            return self.down_proj(gate_up_silu(self.gate_up_proj, x))
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then + mlp(norm(.)); `mlp` is dense or MoE, `attn`
    GQA (built here when None) or another kind (MLA)."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, backend,
                 mlp: nn.Module, attn: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = attn if attn is not None else Attention(config, layer, rotary, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def forward(self, positions, x, residual, batch):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
