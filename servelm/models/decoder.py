"""DecoderLM: the one decoder frame every family configures (embedding, layers of Attention
and a GatedMLP or MoE, the final norm, the head), its one forward, and its weight loading
from Hugging Face names.

A family is configuration plus weight-name rules: class attributes (its norm, sandwich norms,
the quantization methods it takes, its packed modules) and, where it differs, one of the
build hooks (`make_rotaries`, `make_attention`, `make_mlp`, `weight_rules`). Llama, Qwen2 and
Qwen3 set nothing; Gemma sets its norm; Mixtral its MLP; DeepSeek its attention (MLA).

    forward(input_ids[T], positions[T], batch, layers=slice(None), embeds=None,
            hidden_in=None, final_norm=True, aux_layers=())

is the only loop over decoder layers: the runner runs all of them, an early-exit draft the
first N (`layers=N`), a pipeline stage its own (`hidden_in` from the previous stage,
`final_norm=False` before the last), a vision-language model's text rows with image rows
in `embeds`, an EAGLE-3 drafter's target with the hidden states after `aux_layers` as
well. The model also describes its C++ decode-stack form (`fast_path`,
servelm/models/fast_path.py): the runner never looks at its types.

Never: knows about requests, CUDA graphs or which kernels a runner picks for its linears.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch
from torch import nn

from servelm.attention import AttentionBackend
from servelm.attention.forward_batch import ForwardBatch
from servelm.config import ModelConfig
from servelm.layers.activation import act_and_mul, gate_up_silu, silu_and_mul
from servelm.layers.norm import RMSNorm
from servelm.layers.rotary import RotaryEmbedding
from servelm.models.packed import PACKED_MODULES, PackedModules, part_offsets
from servelm.quant import finalize_linears, make_linear


class Placement(NamedTuple):
    """Where one checkpoint tensor goes: rows [start, start+len) of `target` (the whole
    tensor when rows is None), inside expert `expert` of a stacked expert tensor."""

    target: str
    rows: tuple[int, int] | None = None
    expert: int | None = None


Rule = tuple[str, Callable[[re.Match], Placement | None]]


class HiddenState(NamedTuple):
    """The stream between two layers: the hidden state is x + residual (x alone before
    the first layer, residual None)."""

    x: torch.Tensor
    residual: torch.Tensor | None


class WithAux(NamedTuple):
    """A forward's output and the hidden states after its `aux_layers`, each [T, hidden]."""

    out: torch.Tensor | HiddenState
    aux: list[torch.Tensor]


# weight-only methods built from float weights, per linear (servelm/quant/methods.py),
# 'gguf': a GGUF file's blocks kept as they are (float values elsewhere), and the community
# checkpoints' codes kept exactly (servelm/quant/codes_method.py)
WEIGHT_ONLY_METHODS = ("int8", "int4", "int4-g32", "int4-g64", "int4-g128", "int4-g256",
                       "gguf", "gptq", "awq", "compressed-tensors")


class DecoderLM(nn.Module):
    family = ""  # the registry name, for messages
    # quantization methods (servelm/quant) the family takes; None: every method
    quant_methods: tuple[str, ...] | None = ()
    # checkpoint projections stacked into one parameter (packed.py): the rules read it
    packed_modules: PackedModules = PACKED_MODULES
    # the packed parameters its checkpoints store whole, under the packed name (Phi-3's)
    checkpoint_packed: tuple[str, ...] = ()
    norm_class: type[RMSNorm] = RMSNorm  # Gemma's scales by (1 + w)
    sandwich_norms = False  # Gemma: a norm after attention and after the MLP as well
    scales_embedding = False  # Gemma: the embedding times sqrt(hidden)

    def __init__(self, config: ModelConfig, backend: AttentionBackend | None = None,
                 quant=None):
        """backend: the attention backend (bound later when None: servelm/engine_builder.py);
        quant: a `servelm.quant` method, its layers quantized after loading."""
        super().__init__()
        self._check_quant(config, quant)
        self.config = config
        self.quant = quant
        # (param name, expert or None) -> {first row: GGUF blocks} of the layers not built
        # staged (routed experts, MLA's projections), quantized after loading
        self._gguf_blocks: dict[tuple[str, int | None], dict[int, object]] = {}
        # An explicit (empty) weight: nn.Embedding would otherwise draw normal_ init, which
        # on the meta device imports torch._dynamo (1.5 s of every start-up).
        self.embed_tokens = nn.Embedding(
            config.vocab_size, config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.embed_tokens.requires_grad_(False)
        self.embed_scale = config.hidden_size ** 0.5 if self.scales_embedding else 1.0
        rotaries = self.make_rotaries(config)
        self.layers = nn.ModuleList(self.make_layer(config, i, rotaries[i], backend, quant)
                                    for i in range(config.num_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps)
        self.lm_head = (None if config.tie_word_embeddings else
                        make_linear(config.hidden_size, config.vocab_size, False, quant,
                                    is_lm_head=True))
        self.rules = self.weight_rules(config)

    def _check_quant(self, config: ModelConfig, quant) -> None:
        if quant is None or self.quant_methods is None or quant.name in self.quant_methods:
            return
        some = f"; {', '.join(self.quant_methods)} quantize it" if self.quant_methods else ""
        raise ValueError(f"quantization {getattr(quant, 'name', quant)!r} is not supported "
                         f"for the {self.family or config.architecture} family (float "
                         f"only{some})")

    # -- the family's build hooks ----------------------------------------------------------

    def make_rotaries(self, config: ModelConfig) -> list[nn.Module]:
        """The rotary embedding of each layer (shared objects)."""
        return [make_rotary(config)] * config.num_layers

    def make_layer(self, config: ModelConfig, layer: int, rotary, backend, quant
                   ) -> DecoderLayer:
        return DecoderLayer(config, self.make_attention(config, layer, rotary, backend, quant),
                            self.make_mlp(config, layer, quant), self.norm_class,
                            self.sandwich_norms)

    def make_attention(self, config: ModelConfig, layer: int, rotary, backend, quant
                       ) -> nn.Module:
        return Attention(config, layer, rotary, backend, self.norm_class, quant)

    def make_mlp(self, config: ModelConfig, layer: int, quant) -> nn.Module:
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act, quant)

    def weight_rules(self, config: ModelConfig) -> tuple[Rule, ...]:
        """Checkpoint names -> placements: the dense layer's packed parts, unless its
        checkpoints store the packed tensor whole."""
        rules = []
        if "qkv_proj" not in self.checkpoint_packed:
            rules.append(qkv_rule(config, self.packed_modules))
        if "gate_up_proj" not in self.checkpoint_packed:
            rules.append(gate_up_rule(self.packed_modules, "mlp", config.intermediate_size))
        return tuple(rules)

    # -- the forward -----------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch,
                *, layers: int | slice | None = None, embeds: torch.Tensor | None = None,
                hidden_in: HiddenState | None = None, final_norm: bool = True,
                aux_layers: tuple[int, ...] = ()
                ) -> torch.Tensor | HiddenState | WithAux:
        """input_ids, positions: [T] -> final hidden states [T, hidden].

        layers: which layers run (N: the first N, an early-exit draft; a slice; None: all).
        embeds: the input rows [T, hidden] in place of the token embeddings (image rows).
        hidden_in: the stream from the layer before (a pipeline stage after the first).
        final_norm: False returns the stream after the last layer run (a HiddenState).
        aux_layers: also return the hidden state (x + residual) after each of these layers,
        in this order (an EAGLE-3 drafter's features): a WithAux(out, aux)."""
        if hidden_in is not None:
            x, residual = hidden_in
        else:
            x, residual = (self.embed(input_ids) if embeds is None else embeds), None
        span = self.layer_slice(layers)
        aux: dict[int, torch.Tensor] | None = {} if aux_layers else None
        i = span.start or 0  # the index of the layer about to run
        for layer in self.layers[span]:
            x, residual = layer(positions, x, residual, batch)
            if aux is not None and i in aux_layers:
                aux[i] = x if residual is None else x + residual
            i += 1
        if not final_norm:
            out = HiddenState(x, residual)
        else:
            out = self.norm(x) if residual is None else self.norm(x, residual)[0]
        if aux is None:
            return out
        missing = [i for i in aux_layers if i not in aux]
        if missing:
            raise ValueError(f"aux_layers {missing}: not among the layers run")
        return WithAux(out, [aux[i] for i in aux_layers])

    def layer_slice(self, layers: int | slice | None) -> slice:
        if layers is None:
            return slice(None)
        if isinstance(layers, slice):
            return layers
        if not 0 < layers <= len(self.layers):
            raise ValueError(f"layers={layers}: the model has {len(self.layers)} layers; "
                             "run 1 to all of them")
        return slice(0, layers)

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

    def fast_path(self):
        """The C++ decode stack's form of this model, or the reason it has none
        (servelm/models/fast_path.py)."""
        from servelm.models.fast_path import describe

        return describe(self)

    # -- weights ---------------------------------------------------------------------------

    def process_weights_after_loading(self) -> None:
        """With a quantization method: the staged linears (attention, dense and shared MLPs,
        the head) become the method's layers, as do the plain linears of other attention
        kinds (MLA) and every routed expert; the MoE routers stay float (a routing decision
        is a discrete choice, and they are a sliver of the weights); a tied head gets the
        head method's copy of the embedding."""
        if self.quant is None:
            return
        from servelm.quant.staged_linear import StagedLinear

        if self.quant.name == "gguf" and not self._gguf_blocks and not any(
                isinstance(m, StagedLinear) and m._blocks for m in self.modules()):
            raise ValueError("quantization 'gguf' needs a GGUF file's quantized blocks; these "
                             "weights came as floats (use int8 or int4)")
        finalize_linears(self)
        self._quantize_plain_linears()
        self._gguf_blocks = {}
        head = self.quant.lm_head_method()
        if self.lm_head is None and head is not None:
            self.lm_head = head.from_float(self.embed_tokens.weight.data, None)

    def _quantize_plain_linears(self) -> None:
        from servelm.layers.moe import MoE

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

    def _blocks_of(self, target: str, expert: int | None, num_rows: int):
        """The GGUF blocks loaded for every row of `target` (one expert's slice of it),
        fused; None where rows came as floats or of mixed types (the layer is then built
        from the float values)."""
        from servelm.quant.staged_linear import fuse_row_blocks

        return fuse_row_blocks(self._gguf_blocks.get((target, expert), {}), num_rows)

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
            self._copy(p, raw, params[p.target], tensor)
            filled[p.target] += math.prod(tuple(tensor.shape))
        missing = [n for n, p in params.items() if filled[n] != p.numel()]
        if missing:
            raise ValueError(f"checkpoint lacks tensors: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
        for name, buf in self.named_buffers():
            if name.endswith("num_routed_tokens"):  # built on the meta device: uninitialised
                buf.zero_()

    def _copy(self, p: Placement, raw: str, param: torch.Tensor, tensor) -> None:
        """One checkpoint tensor into its place. GGUF blocks or a quantized checkpoint's
        codes go whole to a staged linear (`load_blocks`), else are kept for the layer's
        quantization after loading and their values copied."""
        dst = param.data if p.expert is None else param.data[p.expert]
        if p.rows is not None:
            dst = dst.narrow(0, *p.rows)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise ValueError(f"{raw}: checkpoint shape {tuple(tensor.shape)} != model "
                             f"shape {tuple(dst.shape)} ({p.target})")
        if not isinstance(tensor, torch.Tensor):
            start = 0 if p.rows is None else p.rows[0]
            owner = self.get_submodule(p.target.rpartition(".")[0])
            if p.expert is None and hasattr(owner, "load_blocks"):
                owner.load_blocks(tensor, start)
                return
            self._gguf_blocks.setdefault((p.target, p.expert), {})[start] = tensor
            tensor = tensor.dequantize()
        dst.copy_(tensor)


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


class Attention(nn.Module):
    """GQA attention with a fused qkv projection and the variants a config asks for: q/k
    norms, a sliding window on this layer, soft-capped scores, a query_pre_attn_scalar."""

    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding,
                 backend: AttentionBackend | None, norm: type[RMSNorm] = RMSNorm, quant=None):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                    config.attention_bias, quant)
        self.o_proj = make_linear(self.q_size, config.hidden_size, False, quant)
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
        if self.window or self.softcap:
            out = self.backend.forward(self.layer, q, k, v, batch, **self._variants(batch))
        else:
            out = self.backend.forward(self.layer, q, k, v, batch)  # [T, H, D]
        return self.o_proj(out.reshape(t, self.q_size))

    def _variants(self, batch: ForwardBatch) -> dict:
        extra = {}
        if self.window and batch.seq_lens and max(batch.seq_lens) > self.window:
            extra["window"] = self.window  # shorter contexts: the window changes nothing
        if self.softcap:
            extra["softcap"] = self.softcap
        if extra and not self.backend.supports_variants:
            raise ValueError(f"attention backend {self.backend.name!r} "
                             f"implements neither sliding_window nor attn_logit_softcapping; "
                             "use attention_backend 'torch'")
        return extra


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 quant=None):
        super().__init__()
        self.gate_up_proj = make_linear(hidden_size, 2 * intermediate_size, False, quant)
        self.down_proj = make_linear(intermediate_size, hidden_size, False, quant)
        self.act_and_mul = act_and_mul(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_and_mul is silu_and_mul:
            return self.down_proj(gate_up_silu(self.gate_up_proj, x))
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm layer: x + attn(norm(x)), then + mlp(norm(.)); `mlp` dense or MoE, `attn`
    GQA or another kind (MLA). With sandwich norms (Gemma): x + post_attn_norm(attn(norm(x))),
    then + post_ff_norm(mlp(pre_ff_norm(.)))."""

    def __init__(self, config: ModelConfig, attn: nn.Module, mlp: nn.Module,
                 norm: type[RMSNorm] = RMSNorm, sandwich: bool = False):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.sandwich = sandwich
        self.input_layernorm = norm(h, eps)
        self.self_attn = attn
        self.post_attention_layernorm = norm(h, eps)
        if sandwich:
            self.pre_feedforward_layernorm = norm(h, eps)
        self.mlp = mlp
        if sandwich:
            self.post_feedforward_layernorm = norm(h, eps)

    def forward(self, positions, x, residual, batch):
        """The hidden state is x + residual (x alone before the first layer)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, batch)
        if self.sandwich:
            x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x),
                                                         residual)
            return self.post_feedforward_layernorm(self.mlp(x)), residual
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
