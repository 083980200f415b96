"""EAGLE-3 drafting: a one-layer head that reads the target's own hidden states and proposes
a chain of k tokens.

    target step (eager)  ->  hidden after layers (lo, mid, hi)  ->  fc: [3 Ht] -> [H]
    drafter position i:      input  = (fc(h_i), embed(x_{i+1}))
                             layer  = attention over the drafter's KV + MLP  ->  out_i
                             logits = lm_head(norm(out_i)) over the draft vocabulary,
                                      mapped to target ids by d2t (id = d + d2t[d])
    chain step j > 0:        input  = (out of the step before, embed(draft j))

Owns: the drafter (Eagle3Drafter), its configuration read from a checkpoint (two published
layouts, others refused by name) and its weights. The proposer, the per-sequence features
and drafter KV, and the chain are servelm/spec/chain.py's (shared with MTP).
Never: the target's forward (the runner calls it with `aux_layers` and hands the features
to `observe`), verification, or the block manager.

Choices, and why:
- Chain drafting here; tree drafting (several candidates per depth, EAGLE-2's dynamic tree)
  is servelm/spec/tree.py's, over the same drafter (`step` takes a tree mask).
- Aux layer i means the hidden state after layer i (the EAGLE-3 trainer's choice: its
  hidden_states[3], [L//2 + 1], [-3] are after layers 2, L//2, L - 3; the default here).
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from servelm.spec.chain import ChainProposer, SeqKV, causal_mask

logger = logging.getLogger(__name__)

LAYOUTS = ("eagle3", "speculators")


class UnsupportedDrafterError(ValueError):
    """A checkpoint servelm cannot draft with, named."""


@dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False, compare=False)
    head_dim: int = 0
    norm_before_residual: bool = False
    layout: str = "eagle3"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if len(self.aux_layers) != 3:
            raise UnsupportedDrafterError(f"EAGLE-3 fuses 3 target layers, got aux layers "
                                          f"{self.aux_layers}")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise UnsupportedDrafterError(f"draft_vocab_size {self.draft_vocab_size} must be "
                                          f"in 1..{self.vocab_size}")

    def to_hf(self) -> dict:
        """config.json of the original EAGLE-3 layout (what the trainer writes)."""
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                "hidden_size": self.hidden_size, "num_attention_heads": self.num_heads,
                "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size,
                "target_hidden_size": self.target_hidden_size, "num_hidden_layers": 1,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
                "rope_scaling": self.rope_scaling, "hidden_act": "silu",
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers)}}


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    n = num_target_layers
    return (min(2, n - 1), n // 2, max(0, n - 3))


def read_config(path: str, target_num_layers: int, target_vocab: int,
                target_hidden: int) -> Eagle3Config:
    """The drafter's configuration from `path`/config.json, in either layout."""
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise UnsupportedDrafterError(f"speculative_model {path!r}: no config.json")
    with open(file) as f:
        raw = json.load(f)
    if "speculators_config" in raw:
        algo = raw["speculators_config"].get("algorithm", raw.get("speculators_model_type"))
        if algo != "eagle3":
            raise UnsupportedDrafterError(f"speculative_model {path!r}: speculators algorithm "
                                          f"{algo!r} is not supported (eagle3 is)")
        layer = raw.get("transformer_layer_config") or {}
        return _config(raw, layer, "speculators", target_num_layers, target_vocab,
                       target_hidden)
    arch = (raw.get("architectures") or ["?"])[0]
    if "draft_vocab_size" not in raw:
        raise UnsupportedDrafterError(
            f"speculative_model {path!r}: layout {arch!r} without draft_vocab_size is not an "
            "EAGLE-3 checkpoint (EAGLE-1/2 and Medusa heads are not supported; the original "
            "EAGLE-3 layout and the vLLM speculators eagle3 layout are)")
    return _config(raw, raw, "eagle3", target_num_layers, target_vocab, target_hidden)


def _config(raw: dict, layer: dict, layout: str, target_num_layers: int, target_vocab: int,
            target_hidden: int) -> Eagle3Config:
    vocab = layer.get("vocab_size", raw.get("vocab_size", target_vocab))
    if vocab != target_vocab:
        raise UnsupportedDrafterError(f"the drafter's vocabulary has {vocab} tokens, the "
                                      f"target {target_vocab}: it was trained for another model")
    eagle = raw.get("eagle_config") or {}
    aux = (eagle.get("eagle_aux_hidden_state_layer_ids")
           or raw.get("eagle_aux_hidden_state_layer_ids")
           or default_aux_layers(target_num_layers))
    if max(aux) >= target_num_layers:
        raise UnsupportedDrafterError(f"aux layers {list(aux)} exceed the target's "
                                      f"{target_num_layers} layers")
    hidden = layer["hidden_size"]
    return Eagle3Config(
        hidden_size=hidden, num_heads=layer["num_attention_heads"],
        num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
        intermediate_size=layer["intermediate_size"], vocab_size=vocab,
        draft_vocab_size=raw.get("draft_vocab_size") or vocab,
        target_hidden_size=raw.get("target_hidden_size") or target_hidden,
        aux_layers=tuple(int(i) for i in aux), rms_norm_eps=layer.get("rms_norm_eps", 1e-6),
        rope_theta=layer.get("rope_theta", 10000.0), rope_scaling=layer.get("rope_scaling"),
        head_dim=layer.get("head_dim") or 0,
        norm_before_residual=bool(raw.get("norm_before_residual", False)), layout=layout)


class _Norm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


def _linear(i: int, o: int) -> nn.Linear:
    return nn.Linear(i, o, bias=False)


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 head: fc, one decoder layer whose attention reads [embed; hidden] (2 H
    wide), the final norm and a head over the draft vocabulary. Plain torch modules, float32,
    so that the trainer runs the same module with gradients."""

    def __init__(self, cfg: Eagle3Config, embed: torch.Tensor):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.cfg = cfg
        self.register_buffer("embed", embed, persistent=False)  # the target's, frozen
        self.fc = _linear(3 * cfg.target_hidden_size, h)
        self.hidden_norm = _Norm(h, cfg.rms_norm_eps)
        self.input_layernorm = _Norm(h, cfg.rms_norm_eps)
        self.q_proj = _linear(2 * h, cfg.num_heads * d)
        self.k_proj = _linear(2 * h, cfg.num_kv_heads * d)
        self.v_proj = _linear(2 * h, cfg.num_kv_heads * d)
        self.o_proj = _linear(cfg.num_heads * d, h)
        self.post_attention_layernorm = _Norm(h, cfg.rms_norm_eps)
        self.gate_proj = _linear(h, cfg.intermediate_size)
        self.up_proj = _linear(h, cfg.intermediate_size)
        self.down_proj = _linear(cfg.intermediate_size, h)
        self.norm = _Norm(h, cfg.rms_norm_eps)
        self.lm_head = _linear(h, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        from servelm.layers.rotary import _inv_freq

        self.register_buffer("inv_freq", _inv_freq(d, cfg.rope_theta, cfg.rope_scaling).float(),
                             persistent=False)

    # -- the layer, split where the trainer needs its parts -------------------------------

    def qkv(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor):
        """hidden [T, H] (fc'd or a chain output), tokens [T] -> (q [T,H,D], k, v [T,K,D],
        residual [T, H])."""
        c = self.cfg
        if c.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            residual = hidden
        else:
            residual, hidden = hidden, self.hidden_norm(hidden)
        x = torch.cat((self.input_layernorm(self.embed[tokens].float()), hidden), dim=-1)
        t = x.shape[0]
        q = self.q_proj(x).view(t, c.num_heads, c.head_dim)
        k = self.k_proj(x).view(t, c.num_kv_heads, c.head_dim)
        v = self.v_proj(x).view(t, c.num_kv_heads, c.head_dim)
        return _rope(q, positions, self.inv_freq), _rope(k, positions, self.inv_freq), v, \
            residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn [T, H, D] -> the layer's output [T, hidden] (the next chain step's input)."""
        x = residual + self.o_proj(attn.flatten(1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(out))  # [T, draft_vocab]

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    # -- the chain proposer's drafter (servelm/spec/chain.py) ------------------------------

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.cfg.aux_layers

    def features(self, aux: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(aux, dim=-1).float())  # [T, H]

    def new_cache(self, start: int) -> SeqKV:
        return SeqKV(start, self.cfg.num_kv_heads, self.cfg.head_dim)

    def next_tokens(self, out: torch.Tensor) -> torch.Tensor:
        return self.to_target(self.logits(out).argmax(-1))

    def step(self, hidden, tokens, positions, cache: SeqKV,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Run positions (consecutive, after the cache's) through the layer, appending their
        K/V to `cache`: -> outputs [T, hidden]. mask: [T, cached + T] keys each row sees
        (tree drafting: its context and its ancestors); None: causal."""
        q, k, v, residual = self.qkv(hidden, tokens, positions)
        cache.append(k, v)
        keys, values = cache.k, cache.v
        rep = self.cfg.num_heads // self.cfg.num_kv_heads
        if mask is None:
            mask = causal_mask(q.shape[0], keys.shape[0])
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.repeat_interleave(rep, 1).transpose(0, 1),
            values.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask)
        return self.finish(attn.transpose(0, 1), residual)


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Neox-style rotary (Llama's), x [T, heads, D]."""
    ang = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


# -- weights ------------------------------------------------------------------------------

# checkpoint name (after "model." is dropped) -> the drafter's; the original repository's
# midlayer.* and the speculators layout's layers.0.* are the same layer
_LAYER_NAMES = {"hidden_norm.weight": "hidden_norm.weight",
                "input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                "self_attn.q_proj.weight": "q_proj.weight",
                "self_attn.k_proj.weight": "k_proj.weight",
                "self_attn.v_proj.weight": "v_proj.weight",
                "self_attn.o_proj.weight": "o_proj.weight",
                "mlp.gate_proj.weight": "gate_proj.weight", "mlp.up_proj.weight": "up_proj.weight",
                "mlp.down_proj.weight": "down_proj.weight"}
_TOP_NAMES = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def drafter_name(name: str) -> str | None:
    """The drafter's parameter for checkpoint tensor `name`; None: not one of its tensors
    (embed_tokens: the drafter reads the target's embedding)."""
    name = name.removeprefix("model.")
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return _LAYER_NAMES.get(name[len(prefix):], "?" + name)
    if name in _TOP_NAMES:
        return name
    if name == "embed_tokens.weight":
        return None
    return "?" + name


def checkpoint_names(layout: str) -> dict[str, str]:
    """The drafter's parameter -> its name in `layout` (what the trainer writes)."""
    prefix = "midlayer." if layout == "eagle3" else "layers.0."
    out = {ours: prefix + theirs for theirs, ours in _LAYER_NAMES.items()}
    out.update({n: n for n in _TOP_NAMES})
    return out


def load_drafter(path: str, target_config, embed: torch.Tensor) -> Eagle3Drafter:
    """The drafter in `path` (either layout) for a target with `target_config`; `embed`:
    the target's token embedding [V, hidden]."""
    cfg = read_config(path, target_config.num_layers, target_config.vocab_size,
                      target_config.hidden_size)
    drafter = Eagle3Drafter(cfg, embed)
    own = drafter.state_dict()
    seen = set()
    for name, tensor in _iter_tensors(path):
        ours = drafter_name(name)
        if ours is None:
            continue
        if ours.startswith("?"):
            raise UnsupportedDrafterError(f"checkpoint tensor {name!r} has no place in an "
                                          f"EAGLE-3 drafter ({cfg.layout} layout)")
        if tuple(tensor.shape) != tuple(own[ours].shape):
            raise UnsupportedDrafterError(f"{name}: shape {tuple(tensor.shape)} != "
                                          f"{tuple(own[ours].shape)}")
        own[ours].copy_(tensor)
        seen.add(ours)
    missing = sorted(set(own) - seen - {"d2t", "t2d"})
    if missing:
        raise UnsupportedDrafterError(f"speculative_model {path!r} lacks {missing}")
    if cfg.draft_vocab_size < cfg.vocab_size and "d2t" not in seen:
        raise UnsupportedDrafterError(f"speculative_model {path!r}: a draft vocabulary of "
                                      f"{cfg.draft_vocab_size} needs its d2t map")
    return drafter.eval().requires_grad_(False)


def _iter_tensors(path: str):
    from safetensors.torch import load_file

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if files:
        for f in files:
            yield from load_file(os.path.join(path, f)).items()
        return
    bins = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
    if not bins:
        raise UnsupportedDrafterError(f"speculative_model {path!r}: no .safetensors or .bin "
                                      "weights")
    for f in bins:
        yield from torch.load(os.path.join(path, f), map_location="cpu",
                              weights_only=True).items()


def save_drafter(drafter: Eagle3Drafter, path: str, layout: str = "eagle3") -> None:
    """`drafter` in the original EAGLE-3 layout (config.json + model.safetensors), or the
    speculators layout: what load_drafter reads."""
    from safetensors.torch import save_file

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    os.makedirs(path, exist_ok=True)
    names = checkpoint_names(layout)
    state = {names[n]: t.detach().contiguous() for n, t in drafter.state_dict().items()
             if n in names}
    save_file(state, os.path.join(path, "model.safetensors"))
    cfg = drafter.cfg.to_hf()
    if layout == "speculators":
        layer = {k: cfg.pop(k) for k in ("hidden_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim",
                                         "intermediate_size", "vocab_size", "rms_norm_eps",
                                         "rope_theta", "rope_scaling", "hidden_act")}
        cfg = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
               "transformer_layer_config": dict(layer, model_type="llama"),
               "draft_vocab_size": cfg["draft_vocab_size"],
               "target_hidden_size": cfg["target_hidden_size"],
               "eagle_aux_hidden_state_layer_ids": list(drafter.cfg.aux_layers),
               "norm_before_residual": drafter.cfg.norm_before_residual,
               "speculators_config": {"algorithm": "eagle3",
                                      "default_proposal_method": "greedy"}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


# -- the proposer -------------------------------------------------------------------------

class Eagle3Proposer(ChainProposer):
    name = "eagle3"


def build_eagle3_proposer(path: str, target_model, target_config) -> Eagle3Proposer:
    embed = target_model.embed_tokens.weight.data
    drafter = load_drafter(path, target_config, embed)
    logger.info("eagle3 drafter %s (%s layout): 1 layer, hidden %d, draft vocabulary %d, "
                "target layers %s", path, drafter.cfg.layout, drafter.cfg.hidden_size,
                drafter.cfg.draft_vocab_size, list(drafter.cfg.aux_layers))
    return Eagle3Proposer(drafter)


def random_drafter(cfg: Eagle3Config, embed: torch.Tensor, seed: int = 0) -> Eagle3Drafter:
    """A freshly initialised drafter (the trainer's start; tests' checkpoints)."""
    torch.manual_seed(seed)
    drafter = Eagle3Drafter(cfg, embed)
    for m in drafter.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, 0.0, 1.0 / math.sqrt(m.in_features))
    return drafter
