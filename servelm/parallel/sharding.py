"""TensorParallelShard: which part of the model one tensor-parallel rank holds.

Owns: a rank's local ModelConfig (its heads, its MLP width, its experts: the shapes the
family builds), the divisibility checks (errors name tensor_parallel_size), and the slice of
each checkpoint tensor, by Hugging Face name, that the rank reads. Never: reads a file itself
(the loaders call `select` with a lazy view: safetensors' slice reads only the rows asked
for), or builds a layer.

    k_proj, v_proj               rows by KV heads: rank r holds KV heads [K*r//n, K*(r+1)//n)
                                 (uneven when n does not divide K: SmolLM2's 3 over 2 ranks
                                 give 1 and 2); with fewer KV heads than ranks, rank r reads
                                 KV head r*K/n (the one its query heads attend)
    q_proj, q_b_proj (MLA)       rows by query heads: the query heads of the rank's KV heads
                                 (H/K per KV head), or [r*H/n, (r+1)*H/n) when KV heads are
                                 replicated and for MLA
    qkv_proj (packed, Phi-3)     each of q, k, v as above, concatenated (any packed parameter
                                 a checkpoint stores whole: its parts, by the model's
                                 packed_modules, each as that part alone)
    kv_b_proj (MLA)              rows by heads (the latent cache is replicated)
    o_proj                       columns by heads; a bias on rank 0 only
    gate/up_proj, w1/w3          rows by MLP width (fused gate_up: each half)
    down_proj, w2                columns by MLP width
    experts (tensor-parallel)    every expert's width, as the MLP
    experts (expert-parallel)    whole experts [r*E/n, (r+1)*E/n), renumbered from 0
    shared experts               as the MLP; replicated under expert parallelism
    embed_tokens, lm_head        rows by vocabulary, padded to n equal parts
    norms, routers, the rest     replicated
    layers (pipeline stage s)    only layers [first, end) of the stage, renumbered from 0; the
                                 embedding, final norm and head on every stage
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from servelm.config import ModelConfig
from servelm.layers.parallel_linear import vocab_shard
from servelm.models.packed import PackedModules, packed_modules_for
from servelm.protocol import InvalidParameterError


class ShardingError(InvalidParameterError):
    """The model does not split over this many ranks (the message says which shape)."""

    def __init__(self, message: str):
        super().__init__(message, param="tensor_parallel_size")


_ATTN = r"(.*)\.self_attn\."
_EXPERT = r"(.*)\.(mlp|block_sparse_moe)\.experts\."
_SHARED = r".*\.mlp\.shared_experts?\."


@dataclass(frozen=True)
class TensorParallelShard:
    config: ModelConfig  # the whole model's
    rank: int
    size: int
    expert_parallel: bool = False
    stage: int = 0
    num_stages: int = 1

    def __post_init__(self) -> None:
        c, n = self.config, self.size
        if (c.is_mla or c.num_kv_heads < n) and c.num_heads % n:
            raise ShardingError(f"{c.num_heads} attention heads do not split over "
                                f"tensor_parallel_size {n}")
        if not c.is_mla and c.num_kv_heads < n and n % c.num_kv_heads:
            raise ShardingError(f"{c.num_kv_heads} KV heads do not replicate evenly to "
                                f"tensor_parallel_size {n}")
        widths = {"intermediate_size": c.intermediate_size,
                  "shared_expert_intermediate_size": c.shared_expert_intermediate_size}
        if c.is_moe and not self.expert_parallel:
            widths["moe_intermediate_size"] = c.moe_intermediate_size
        for name, width in widths.items():
            if width % n:
                raise ShardingError(f"{name} {width} does not split over "
                                    f"tensor_parallel_size {n}")
        if self.num_stages > c.num_layers:
            raise ShardingError(f"{c.num_layers} layers do not make "
                                f"pipeline_parallel_size {self.num_stages} stages")
        if self.expert_parallel and c.is_moe and c.num_experts % n:
            raise ShardingError(f"{c.num_experts} experts do not split over "
                                f"tensor_parallel_size {n} (enable_expert_parallel)")

    # -- shapes -----------------------------------------------------------------------------

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[first, end) of the KV heads this rank holds (one, shared, when replicated)."""
        c, r, n = self.config, self.rank, self.size
        if c.num_kv_heads < n:
            head = r * c.num_kv_heads // n
            return head, head + 1
        return c.num_kv_heads * r // n, c.num_kv_heads * (r + 1) // n

    @property
    def q_heads(self) -> tuple[int, int]:
        """[first, end) of the query heads this rank computes."""
        c, r, n = self.config, self.rank, self.size
        if c.is_mla or c.num_kv_heads < n:
            return r * c.num_heads // n, (r + 1) * c.num_heads // n
        group = c.num_heads // c.num_kv_heads
        first, end = self.kv_heads
        return first * group, end * group

    @property
    def layers(self) -> tuple[int, int]:
        """[first, end) of the layers of this rank's pipeline stage."""
        n, s = self.config.num_layers, self.stage
        return n * s // self.num_stages, n * (s + 1) // self.num_stages

    @property
    def packed_modules(self) -> PackedModules:
        """The model's packed parameters: a checkpoint that stores one whole is split by it."""
        return packed_modules_for(self.config)

    @property
    def vocab(self) -> tuple[int, int]:
        return vocab_shard(self.config.vocab_size, self.rank, self.size)

    def local_config(self) -> ModelConfig:
        """The shapes this rank builds: the model's config with its share of heads and widths
        (and of the vocabulary, padded); everything else the same."""
        c, n = self.config, self.size
        q0, q1 = self.q_heads
        k0, k1 = self.kv_heads
        changes = {"num_heads": q1 - q0, "num_kv_heads": k1 - k0,
                   "intermediate_size": c.intermediate_size // n, "vocab_size": self.vocab[1]}
        if c.is_mla:  # the latent cache is one entry whatever the heads
            changes["num_kv_heads"] = max(1, c.num_kv_heads // n)
        if self.num_stages > 1:  # a shallower model: the stage's layers, renumbered
            first, end = self.layers
            changes.update(num_layers=end - first,
                           layer_types=tuple(c.layer_types[first:end]),
                           num_leading_dense_layers=max(0, min(end, c.num_leading_dense_layers)
                                                        - first))
        if c.shared_expert_intermediate_size and not self.expert_parallel:
            changes["shared_expert_intermediate_size"] = c.shared_expert_intermediate_size // n
        if c.is_moe and not self.expert_parallel:
            changes["moe_intermediate_size"] = c.moe_intermediate_size // n
        return c.replace(**changes)

    # -- checkpoint slices ------------------------------------------------------------------

    def select(self, name: str, view) -> tuple[str, torch.Tensor] | None:
        """(name, this rank's part) of checkpoint tensor `name`, read through `view` (a
        tensor, or a safetensors slice: anything with a shape that takes [slices]); None
        when this rank holds none of it (another rank's experts)."""
        r, n = self.rank, self.size
        if self.num_stages > 1:
            name = self._stage_name(name)
            if name is None:
                return None
        short = name.removeprefix("model.")
        if re.fullmatch(_EXPERT + r".*", short):
            return self._select_expert(name, view)
        if re.fullmatch(r"(embed_tokens|lm_head)\.weight", short):
            return name, self._vocab_rows(view)
        m = re.fullmatch(_ATTN + r"(\w+)\.(weight|bias)", short)
        if m:
            return name, self._select_packed(m[2], m[3], view, self._select_attention)
        if re.fullmatch(_SHARED + r".*", short) and self.expert_parallel:
            return name, _full(view)
        m = re.fullmatch(r".*\.mlp\.(?:shared_experts?\.)?(\w+)\.(weight|bias)", short)
        if m:
            return name, self._select_packed(m[1], m[2], view, self._select_mlp)
        return name, _full(view)

    def _select_packed(self, proj: str, kind: str, view, select) -> torch.Tensor:
        """A checkpoint that stores a packed parameter whole (Phi-3's qkv_proj, gate_up_proj;
        the model's packed_modules): each part's rows selected as that part alone, then
        stacked; any other projection: select(proj, kind, view)."""
        parts = self.packed_modules.get(proj)
        if parts is None:
            return select(proj, kind, view)
        rows = _shape(view)[0]
        sizes = [getattr(self.config, p.rows) for p in parts]
        if sum(sizes) != rows and len({p.rows for p in parts}) == 1:  # a shared expert's width
            sizes = [rows // len(parts)] * len(parts)
        if sum(sizes) != rows:
            raise ValueError(f"{proj}: a checkpoint tensor of {rows} rows, its parts need {sizes}")
        starts = [sum(sizes[:i]) for i in range(len(parts))]
        return _cat_rows([select(p.name, kind, _RowBlock(view, start, size))
                          for p, start, size in zip(parts, starts, sizes)])

    def _select_mlp(self, proj: str, kind: str, view) -> torch.Tensor:
        if proj in ("gate_proj", "up_proj"):
            return _chunk(view, 0, self.rank, self.size)
        if proj == "down_proj":
            return self._row_parallel(view, kind)
        return _full(view)

    def _stage_name(self, name: str) -> str | None:
        """layers.i -> layers.(i - first) inside the stage; None outside it."""
        m = re.match(r"((?:model\.)?layers\.)(\d+)\.", name)
        if m is None:
            return name
        first, end = self.layers
        i = int(m[2])
        if not first <= i < end:
            return None
        return f"{m[1]}{i - first}.{name[m.end():]}"

    def _select_attention(self, proj: str, kind: str, view) -> torch.Tensor:
        c = self.config
        if proj in ("q_proj", "q_b_proj", "kv_b_proj"):
            return self._head_rows(view, 0, self.q_heads, c.num_heads)
        if proj in ("k_proj", "v_proj"):
            return self._head_rows(view, 0, self.kv_heads, c.num_kv_heads)
        if proj == "o_proj":
            return self._row_parallel(view, kind, self.q_heads, c.num_heads)
        return _full(view)  # q_a_proj, kv_a_proj_with_mqa, the norms: replicated

    @staticmethod
    def _head_rows(view, offset: int, heads: tuple[int, int], num_heads: int,
                   rows: int | None = None) -> torch.Tensor:
        """Rows of heads [first, end) in a block of `rows` rows (the tensor's, by default)
        that holds num_heads heads of equal size, from row `offset`."""
        per = (rows if rows is not None else _shape(view)[0]) // num_heads
        return _slice(view, 0, offset + heads[0] * per, (heads[1] - heads[0]) * per)

    def _row_parallel(self, view, kind: str, heads: tuple[int, int] | None = None,
                      num_heads: int = 0) -> torch.Tensor:
        """Input columns: the rank's heads (o_proj) or its equal share (down_proj)."""
        if kind == "bias":  # added once: by rank 0
            full = _full(view)
            return full if self.rank == 0 else torch.zeros_like(full)
        if heads is None:
            return _chunk(view, 1, self.rank, self.size)
        per = _shape(view)[1] // num_heads
        return _slice(view, 1, heads[0] * per, (heads[1] - heads[0]) * per)

    def _vocab_rows(self, view) -> torch.Tensor:
        start, per = self.vocab
        total = _shape(view)[0]
        part = _slice(view, 0, min(start, total), max(0, min(per, total - start)))
        if part.shape[0] == per:
            return part
        if not isinstance(part, torch.Tensor):  # GGUF blocks: zero bytes decode to zeros
            from servelm.quant.gguf_blocks import GGUFBlocks

            pad = GGUFBlocks(part.type_name, part.data.new_zeros(
                (per - part.shape[0], part.data.shape[1])), (per - part.shape[0], part.shape[1]))
            return _cat_rows([part, pad])
        pad = torch.zeros((per - part.shape[0], *part.shape[1:]), dtype=part.dtype)
        return torch.cat([part, pad])

    def _select_expert(self, name: str, view) -> tuple[str, torch.Tensor] | None:
        r, n = self.rank, self.size
        short = name.removeprefix("model.")
        m = re.fullmatch(_EXPERT + r"(\d+)\.(\w+)\.weight", short)
        if m:  # one tensor per expert
            if self.expert_parallel:
                per = self.config.num_experts // n
                e = int(m[3])
                if not r * per <= e < (r + 1) * per:
                    return None
                prefix = "model." if name.startswith("model.") else ""
                return (f"{prefix}{m[1]}.{m[2]}.experts.{e - r * per}.{m[4]}.weight",
                        _full(view))
            dim = 1 if m[4] in ("w2", "down_proj") else 0
            return name, _chunk(view, dim, r, n)
        # stacked: gate_up_proj [E, 2I, hidden], down_proj [E, hidden, I]
        if self.expert_parallel:
            return name, _chunk(view, 0, r, n)
        if short.endswith("gate_up_proj"):
            half = _shape(view)[1] // 2
            full = _full(view)
            return name, torch.cat([full[:, i * half:(i + 1) * half].chunk(n, dim=1)[r]
                                    for i in (0, 1)], dim=1).contiguous()
        return name, _chunk(view, 2, r, n)


def _cat_rows(parts: list):
    """Stack row blocks: float tensors, or GGUF blocks kept quantized."""
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(parts)
    from servelm.quant.gguf_blocks import cat_rows

    return cat_rows(parts)


def _shape(view) -> tuple[int, ...]:
    return tuple(view.get_shape()) if hasattr(view, "get_shape") else tuple(view.shape)


class _RowBlock:
    """Rows [start, start+size) of a view, itself a view: a part of a packed tensor that the
    part's own rule then slices (safetensors still reads only the rows asked for)."""

    def __init__(self, view, start: int, size: int):
        self.view, self.start, self.size = view, start, size

    def get_shape(self) -> tuple[int, ...]:
        return (self.size, *_shape(self.view)[1:])

    def __getitem__(self, index):
        index = list(index) if isinstance(index, tuple) else [index]
        index += [slice(None)] * (len(_shape(self.view)) - len(index))
        first, end, step = index[0].indices(self.size)
        if step != 1:
            raise ValueError("a packed part is read in whole rows")
        index[0] = slice(self.start + first, self.start + end)
        return self.view[tuple(index)]


def _full(view) -> torch.Tensor:
    return view[:] if hasattr(view, "get_shape") else view


def _slice(view, dim: int, start: int, length: int) -> torch.Tensor:
    index = [slice(None)] * len(_shape(view))
    index[dim] = slice(start, start + length)
    out = view[tuple(index)]
    return out.contiguous() if isinstance(out, torch.Tensor) else out


def _chunk(view, dim: int, r: int, n: int) -> torch.Tensor:
    size = _shape(view)[dim]
    return _slice(view, dim, r * size // n, size // n)


def select_all(shard: TensorParallelShard, weights):
    """A whole-tensor weights iterator narrowed to the rank's parts (checkpoints that cannot
    be read in slices: GGUF's dequantized tensors, in-memory test checkpoints)."""
    for name, tensor in weights:
        picked = shard.select(name, tensor)
        if picked is not None:
            yield picked
