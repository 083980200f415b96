"""Loading a GGUF file: its metadata as a ModelConfig, its tensors as HF-named float32
weights, and its vocabulary as a Tokenizer.

Owns: the mapping from llama.cpp's names and conventions to the Hugging Face ones the models
use -- tensor names, undoing the converter's rotary row permutation, and rebuilding the HF
tokenizer (byte-level BPE with the original pre-tokenizer, or SentencePiece BPE; special
tokens; the BOS rule) from `tokenizer.ggml.*` metadata.

Never: runs quantized kernels (every tensor is dequantized to float32 with gguf-py's own
`dequantize`), or writes to the file (it is memory-mapped read-only).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import tokenizers
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from servelm.config import ModelConfig
from servelm.loader.hf_loader import _LLAMA_NAMED, hf_weight_names
from servelm.loader.tokenizer import Tokenizer, end_of_generation_ids

__all__ = [
    "iter_gguf_quantized_weights",
    "iter_gguf_weights",
    "load_gguf_config",
    "load_gguf_tokenizer",
    "unpermute_rotary",
]

logger = logging.getLogger(__name__)

_TOKEN_UNKNOWN = 2  # llama.cpp token types
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


@functools.lru_cache(maxsize=4)
def gguf_reader(path: Path) -> GGUFReader:
    """The file's reader, shared by everything that reads it in this process (config,
    weights, tokenizer, the dtype choice).

    Parsing the metadata (50k-entry vocab arrays) takes seconds: it is done once per file
    and kept under $SERVELM_HOME/index (servelm/loader/gguf_index.py), and every reader shares
    one memory-mapped view of it per process."""
    from servelm.loader.gguf_index import open_indexed

    return open_indexed(path)


def _get(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


# --- config -------------------------------------------------------------------------------


def load_gguf_config(path: Path, name: str) -> ModelConfig:
    """ModelConfig from `{arch}.*` metadata and the tensors present (ModelConfig's own GGUF
    reader), plus what only the loader reads: rope scaling, BOS and end-of-generation ids.
    An architecture no model family runs is refused when the model is built."""
    reader = gguf_reader(path)
    arch = _get(reader, "general.architecture")

    def meta(key: str, default: Any = None) -> Any:
        return _get(reader, f"{arch}.{key}", default)

    tokens = _get(reader, "tokenizer.ggml.tokens") or []
    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        return ModelConfig.from_gguf_metadata(
            functools.partial(_get, reader), {t.name: t.tensor_type.name for t in reader.tensors},
            name=name, source=str(path), rope_scaling=_rope_scaling(reader, meta),
            bos_token_id=_get(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=_gguf_eos_ids(reader, vocab.get))
    except ValueError as e:
        raise ValueError(f"{path.name}: {e}") from e


def _rope_scaling(reader: GGUFReader, meta) -> dict[str, Any] | None:
    """HF-style rope_scaling from `rope.scaling.*`, or the file's per-frequency factors."""
    kind = meta("rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {
            "rope_type": kind,
            "factor": float(meta("rope.scaling.factor", 1.0)),
        }
        if (orig := meta("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    # Phi-3 LongRoPE: per-frequency divisors below and beyond the original context as
    # tensors, the attention factor and that context as keys.
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if factors:
        missing = {"rope_factors_long.weight", "rope_factors_short.weight"} - set(factors)
        orig = meta("rope.scaling.original_context_length")
        if missing or orig is None:
            raise ValueError(f"LongRoPE factors without {sorted(missing) or ['rope.scaling.original_context_length']}")
        scaling = {"rope_type": "longrope", "original_max_position_embeddings": int(orig),
                   **{f"{k}_factor": [float(x) for x in np.asarray(
                       factors[f"rope_factors_{k}.weight"].data).ravel()]
                      for k in ("long", "short")}}
        if (attn := meta("rope.scaling.attn_factor")) is not None:
            scaling["attention_factor"] = float(attn)
        return scaling
    # Llama 3.x files carry no scaling keys: the converter bakes the llama3 rule into a
    # `rope_freqs` tensor (one divisor per rotary frequency), which llama.cpp applies as is.
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            return {
                "rope_type": "freq_factors",
                "freq_factors": [float(x) for x in np.asarray(tensor.data).ravel()],
            }
    return None


def _gguf_eos_ids(reader: GGUFReader, lookup) -> tuple[int, ...]:
    declared = [_get(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    return end_of_generation_ids(declared, lookup)


# --- weights ------------------------------------------------------------------------------

# llama.cpp tensor name (within blk.N.) -> HF name (within model.layers.N.)
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_qkv": "self_attn.qkv_proj",  # q/k/v kept whole (Phi-3)
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    # mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    # multi-head latent attention (DeepSeek-V2/V3)
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_ARCH_LAYER_TENSORS = {"gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS,
                       "deepseek2": {f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj"
                                     for p in ("gate", "up", "down")}}
# llama.cpp stores Gemma's (1 + w) RMSNorm weights as 1 + w (ggml multiplies by the weight);
# the model takes w, as the HF checkpoint has it.
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# Routed experts stacked in one tensor [experts, out, in]: one HF tensor per expert each.
_EXPERT_TENSORS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                   "ffn_down_exps": "down_proj"}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# carried in ModelConfig.rope_scaling instead
_SKIPPED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str, expert: int | None = None, arch: str = "",
            whole: dict[str, str] | None = None) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; a stacked expert
    tensor `blk.3.ffn_up_exps.weight` with expert=5 -> `model.layers.3.mlp.experts.5.up_proj
    .weight`; arch: the file's architecture, for its own names; whole: part -> packed
    parameter for those the model's checkpoints keep whole (packed_whole), which llama.cpp
    names by a part (Phi-3's gate_up_proj is its ffn_up)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is not None and match.group(2) in _EXPERT_TENSORS and expert is not None:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.mlp.experts.{expert}.{_EXPERT_TENSORS[kind]}.{suffix}"
    if match is not None and match.group(2) == "exp_probs_b":  # V3's routing bias
        return f"model.layers.{match.group(1)}.mlp.gate.e_score_correction_bias"
    table = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
    if match is None or match.group(2) not in table:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart here")
    layer, kind, suffix = match.groups()
    parent, _, leaf = table[kind].rpartition(".")
    leaf = (whole or {}).get(leaf, leaf)
    return f"model.layers.{layer}.{parent + '.' if parent else ''}{leaf}.{suffix}"


def packed_whole(config: ModelConfig) -> dict[str, str]:
    """Part -> packed parameter, for the packed parameters the model's checkpoints store
    whole (its class's checkpoint_packed; models/packed.py)."""
    from servelm.models import get_model_class

    model = get_model_class(config.architecture)
    return {p.name: packed for packed in model.checkpoint_packed
            for p in model.packed_modules[packed]}


def _is_expert_stack(gguf_name: str) -> bool:
    match = _LAYER_NAME.fullmatch(gguf_name)
    return match is not None and match.group(2) in _EXPERT_TENSORS


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's row permutation of a llama q/k projection (weight or bias).

    HF Llama rotates half-split pairs (i, i + D/2) of each head; llama.cpp rotates adjacent
    pairs (2i, 2i + 1), so its converter reorders each head's rows from
    [x0 .. x_{D/2-1}, y0 .. y_{D/2-1}] to [x0, y0, x1, y1, ...]. Viewing the rows as
    [heads, D/2, 2] and swapping the last two axes puts them back:

        gguf rows of one head:  x0 y0 x1 y1 ...   -> [D/2, 2] -> swap -> [2, D/2]
        hf rows of one head:    x0 x1 ... y0 y1 ...
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    w = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _model_tensors(path: Path, config: ModelConfig):
    """(HF name, GGUF tensor, heads of its rotary permutation or None, a constant to subtract
    from its values) for every tensor the model takes; raises at the end if the config needs
    one the file lacks."""
    reader = gguf_reader(path)
    arch = _get(reader, "general.architecture")
    permuted = arch == "llama"  # qwen2/qwen3/phi3 use neox rotary
    whole = packed_whole(config)
    seen: set[str] = set()
    split_kv_b: dict[str, dict[str, Any]] = {}
    have_kv_b = any(".attn_kv_b." in t.name for t in reader.tensors)
    for tensor in reader.tensors:
        if tensor.name in _SKIPPED_TENSORS:
            continue
        kb = re.fullmatch(r"blk\.(\d+)\.attn_([kv])_b\.weight", tensor.name)
        if kb is not None:  # newer converters split kv_b_proj into k_b (transposed) and v_b
            if have_kv_b:
                continue  # the file keeps kv_b too: read that
            layer = split_kv_b.setdefault(kb[1], {})
            layer[kb[2]] = tensor
            if len(layer) == 2:
                name = f"model.layers.{kb[1]}.self_attn.kv_b_proj.weight"
                seen.add(name)
                yield name, _joined_kv_b(layer["k"], layer["v"], config), None, 0.0
            continue
        if _is_expert_stack(tensor.name):  # the experts' names: hf_name(name, expert=e)
            seen.add(tensor.name)
            yield tensor.name, tensor, None, 0.0
            continue
        name = hf_name(tensor.name, arch=arch, whole=whole)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        heads = None
        if permuted and ".attn_q." in tensor.name:
            heads = config.num_heads
        elif permuted and ".attn_k." in tensor.name:
            heads = config.num_kv_heads
        seen.add(name)
        shift = 1.0 if arch in _NORM_PLUS_ONE and tensor.name.endswith("norm.weight") else 0.0
        yield name, tensor, heads, shift
    # The Llama-named families' full list; the other families' own load checks that every
    # parameter is filled.
    if config.architecture in _LLAMA_NAMED:
        missing = set(hf_weight_names(config)) - seen
        if missing:
            raise ValueError(f"{path.name} lacks weights the config needs, e.g. "
                             f"{sorted(missing)[:3]}")


class _Float32Tensor(NamedTuple):
    """A tensor made here from the file's (what the iterators read of a ReaderTensor)."""

    name: str
    data: np.ndarray
    tensor_type: Any
    shape: tuple[int, ...]


def _joined_kv_b(k_b, v_b, config: ModelConfig) -> _Float32Tensor:
    """kv_b_proj [H*(Dn+Dv), L] from llama.cpp's k_b [H, L, Dn] (per head, transposed) and
    v_b [H, Dv, L]."""
    from gguf import GGMLQuantizationType

    k = dequantize(k_b.data, k_b.tensor_type)  # [H, L, Dn]
    v = dequantize(v_b.data, v_b.tensor_type)  # [H, Dv, L]
    heads, rank = k.shape[0], k.shape[1]
    if v.shape != (heads, config.v_head_dim, rank) or k.shape[2] != config.qk_nope_head_dim:
        raise ValueError(f"{k_b.name} {k.shape} / {v_b.name} {v.shape} do not make a kv_b_proj "
                         f"of {heads} heads x ({config.qk_nope_head_dim} + "
                         f"{config.v_head_dim}) rows of {config.kv_lora_rank}")
    joined = np.concatenate([k.transpose(0, 2, 1), v], axis=1).reshape(-1, rank)
    return _Float32Tensor(k_b.name, np.ascontiguousarray(joined, dtype=np.float32),
                          GGMLQuantizationType.F32, tuple(joined.shape[::-1]))


def _per_expert(name: str, weights: np.ndarray):
    """A stacked [experts, out, in] array as (HF name, one expert's [out, in])."""
    for e in range(weights.shape[0]):
        yield hf_name(name, expert=e), weights[e]


class _SliceView:
    """A GGUF tensor read in parts (a model-parallel rank's `select`, servelm/parallel/
    sharding.py): only the rows asked for are dequantized, and of those only the column
    blocks asked for when the range falls on the type's block boundaries. Rotary-permuted
    q/k rows are undone per head, so a slice must take whole heads (the shard rules do)."""

    def __init__(self, tensor, heads: int | None, shift: float):
        self.tensor, self.heads, self.shift = tensor, heads, shift
        data = tensor.data
        self.shape = tuple(int(d) for d in tensor.shape[::-1]) if data.dtype == np.uint8 \
            else tuple(data.shape)

    def get_shape(self) -> tuple[int, ...]:
        return self.shape

    def __getitem__(self, index) -> torch.Tensor:
        index = index if isinstance(index, tuple) else (index,)
        rows = index[0].indices(self.shape[0])
        data = self.tensor.data[rows[0]:rows[1]]
        cols = index[1] if len(index) > 1 else slice(None)
        data, cols = self._column_blocks(data, cols)
        weight = dequantize(data, self.tensor.tensor_type)
        if self.heads is not None:
            per_head = self.shape[0] // self.heads
            weight = unpermute_rotary(weight, (rows[1] - rows[0]) // per_head)
        weight = weight[:, cols] if weight.ndim > 1 else weight
        if self.shift:
            weight = weight - self.shift
        return torch.from_numpy(np.array(weight, dtype=np.float32))

    def _column_blocks(self, data: np.ndarray, cols: slice):
        """Narrow quantized rows to the blocks of `cols` where they align; returns the data
        and the column slice still to apply after dequantizing."""
        if data.ndim < 2 or cols == slice(None):
            return data, cols
        from gguf import GGML_QUANT_SIZES

        start, stop, _ = cols.indices(self.shape[1])
        block, nbytes = GGML_QUANT_SIZES[self.tensor.tensor_type]
        if data.dtype != np.uint8:  # float types: one element is one "block"
            return data[:, start:stop], slice(None)
        if start % block or stop % block:
            return data, cols
        return data[:, start // block * nbytes:stop // block * nbytes], slice(None)


def iter_gguf_weights(path: Path, config: ModelConfig,
                      select=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 CPU tensor [out, in]) for every tensor in the file. select: a
    model-parallel rank's `(name, view) -> (name, tensor) | None`; a 2-D or 1-D tensor is
    then read only in the parts it asks for (an expert stack is read whole and split)."""
    for name, tensor, heads, shift in _model_tensors(path, config):
        if select is not None and not _is_expert_stack(name):
            picked = select(name, _SliceView(tensor, heads, shift))
            if picked is not None:
                yield picked
            continue
        # dequantize returns numpy shape order (ggml's ne reversed): [out, in] like torch.
        weight = dequantize(tensor.data, tensor.tensor_type)
        if heads is not None:
            weight = unpermute_rotary(weight, heads)
        if shift:
            weight = weight - shift
        parts = _per_expert(name, weight) if _is_expert_stack(name) else [(name, weight)]
        for part_name, part in parts:
            # F32 tensors come back as views of the read-only memory map: copy those only.
            part = torch.from_numpy(np.array(part, dtype=np.float32))
            if select is None:
                yield part_name, part
            elif (picked := select(part_name, part)) is not None:
                yield picked


class _BlocksView(_SliceView):
    """A 2-D tensor of a kept type read in parts as GGUFBlocks (kept quantized): rows, and
    columns in whole blocks (a column split inside a block cannot keep its bytes)."""

    def __getitem__(self, index):
        from servelm.quant.gguf_blocks import GGUFBlocks

        index = index if isinstance(index, tuple) else (index,)
        r0, r1, _ = index[0].indices(self.shape[0])
        data = np.asarray(self.tensor.data[r0:r1])
        cols = index[1] if len(index) > 1 else slice(None)
        data, rest = self._column_blocks(data, cols)
        if rest != slice(None):
            raise ValueError(f"{self.tensor.name}: columns {cols} of {self.shape} are not whole "
                             f"{self.tensor.tensor_type.name} blocks; this split of "
                             "tensor_parallel_size needs a float load (drop --quantization gguf)")
        c0, c1, _ = cols.indices(self.shape[1])
        if self.heads is not None:
            data = unpermute_rotary(data, (r1 - r0) // (self.shape[0] // self.heads))
        return GGUFBlocks(self.tensor.tensor_type.name,
                          torch.from_numpy(np.array(data, dtype=np.uint8)), (r1 - r0, c1 - c0))


def iter_gguf_quantized_weights(path: Path, config: ModelConfig,
                                select=None) -> Iterator[tuple[str, Any]]:
    """Like `iter_gguf_weights`, but 2-D tensors of the types servelm keeps quantized
    (Q8_0/Q4_0/Q4_1/Q5_0 and the K-quants Q4_K/Q5_K/Q6_K: `is_kept_type`) come as their raw
    blocks.
    select: a model-parallel rank's parts (see iter_gguf_weights), blocks kept quantized.

    Yields (HF name, `servelm.quant.gguf_blocks.GGUFBlocks` [out rows of block bytes]) for
    those, (HF name, float32 tensor) for the rest. llama's q/k row permutation is undone on the
    block rows: each row's blocks are self-contained, so moving rows moves no bits within one.
    """
    from servelm.quant.gguf_blocks import GGUFBlocks, is_kept_type

    for name, tensor, heads, shift in _model_tensors(path, config):
        is_blocks = is_kept_type(tensor.tensor_type.name) and len(tensor.shape) == 2
        if (select is None and _is_expert_stack(name) and len(tensor.shape) == 3
                and is_kept_type(tensor.tensor_type.name)):
            yield from _expert_blocks(name, tensor)  # each expert's rows kept quantized
            continue
        if select is not None and not _is_expert_stack(name):
            view = (_BlocksView if is_blocks else _SliceView)(tensor, heads, shift)
            if (picked := select(name, view)) is not None:
                yield picked
            continue
        # Blocks: [out, blocks_per_row * block_bytes] uint8; floats: [out, in] float32.
        data = np.asarray(tensor.data) if is_blocks else dequantize(tensor.data,
                                                                   tensor.tensor_type)
        if heads is not None:
            data = unpermute_rotary(data, heads)
        if shift:  # norms: floats, never blocks
            data = data - shift
        if is_blocks:
            shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # ggml's ne is [in, out]
            yield name, GGUFBlocks(tensor.tensor_type.name,
                                   torch.from_numpy(np.array(data, dtype=np.uint8)), shape)
        elif _is_expert_stack(name):  # 3-D: the experts' float values, one by one
            for part_name, part in _per_expert(name, data):
                part = torch.from_numpy(np.array(part, dtype=np.float32))
                if select is None:
                    yield part_name, part
                elif (picked := select(part_name, part)) is not None:
                    yield picked
        else:
            yield name, torch.from_numpy(np.array(data, dtype=np.float32))


def _expert_blocks(name: str, tensor) -> Iterator[tuple[str, Any]]:
    """A stacked [experts, out, in] tensor of a kept type as one GGUFBlocks per expert
    (rows of whole blocks: an expert's slice of the stack is its own bytes)."""
    from servelm.quant.gguf_blocks import GGUFBlocks

    data = np.asarray(tensor.data)  # [experts, out, bytes per row] uint8
    out, cols = int(tensor.shape[1]), int(tensor.shape[0])  # ggml's ne: [in, out, experts]
    for e in range(data.shape[0]):
        yield hf_name(name, expert=e), GGUFBlocks(
            tensor.tensor_type.name, torch.from_numpy(np.array(data[e], dtype=np.uint8)),
            (out, cols))


# --- tokenizer ----------------------------------------------------------------------------

# Split regexes of the original HF tokenizer.json files, by `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_split(split: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # ByteLevel's built-in regex is GPT-2's.
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_gpt2_pre() -> pre_tokenizers.PreTokenizer:
    # SmolLM / StarCoder: every digit is its own pre-token, then GPT-2's split.
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )


class _PreSpec:
    """How the original HF tokenizer of a `tokenizer.ggml.pre` family splits and merges."""

    def __init__(self, pre_tokenizer, normalizer=None, ignore_merges: bool = False):
        self.pre_tokenizer = pre_tokenizer  # factory: tokenizers objects are not shareable
        self.normalizer = normalizer
        self.ignore_merges = ignore_merges  # Llama 3: a word found whole in the vocab wins


_PRE_SPECS = {
    "gpt-2": _PreSpec(_gpt2_pre),
    "default": _PreSpec(_gpt2_pre),
    "smollm": _PreSpec(_digits_gpt2_pre),
    "starcoder": _PreSpec(_digits_gpt2_pre),
    "llama-bpe": _PreSpec(lambda: _byte_level_split(_LLAMA3_SPLIT), ignore_merges=True),
    "llama3": _PreSpec(lambda: _byte_level_split(_LLAMA3_SPLIT), ignore_merges=True),
    "llama-v3": _PreSpec(lambda: _byte_level_split(_LLAMA3_SPLIT), ignore_merges=True),
    # Qwen2's tokenizer.json normalizes to NFC before splitting.
    "qwen2": _PreSpec(lambda: _byte_level_split(_QWEN2_SPLIT), normalizers.NFC),
    "deepseek-r1-qwen": _PreSpec(lambda: _byte_level_split(_QWEN2_SPLIT), normalizers.NFC),
}


@functools.lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def load_gguf_tokenizer(path: Path) -> Tokenizer:
    """The original model's tokenizer, rebuilt from `tokenizer.ggml.*` metadata."""
    reader = gguf_reader(path)
    kind = _get(reader, "tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise ValueError(
            f"{path.name}: tokenizer.ggml.model {kind!r} is not supported (byte-level BPE "
            "'gpt2' and SentencePiece 'llama' are); use the model's Hugging Face directory "
            "with its tokenizer.json instead"
        )
    tokens: list[str] = _get(reader, "tokenizer.ggml.tokens")
    types = _get(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level_backend(reader, tokens, types)
    else:
        backend = _sentencepiece_backend(reader, tokens, types)
    bos_id = _get(reader, "tokenizer.ggml.bos_token_id")
    # BOS follows the file's add_bos_token flag, which llama.cpp's converter copies from the
    # original tokenizer; transformers' GGUF conversion reads the same flag. Without a flag:
    # SentencePiece vocabularies (Llama 2, Mistral) add BOS, byte-level ones (GPT-2, SmolLM,
    # Qwen) do not -- as llama.cpp and transformers assume. The default SmolLM2 file says False,
    # matching its HF tokenizer.json, whose post-processor adds nothing.
    add_bos = _get(reader, "tokenizer.ggml.add_bos_token", kind == "llama")
    if add_bos and bos_id is not None:
        bos = tokens[bos_id]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
    elif kind == "gpt2":
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    return Tokenizer(
        backend,
        bos_token_id=bos_id,
        eos_token_ids=_gguf_eos_ids(reader, vocab.get),
        chat_template=_get(reader, "tokenizer.chat_template"),
    )


def _add_special_tokens(backend, tokens: list[str], types: list[int], special: set[int]) -> None:
    """Types in `special` become special added tokens, user-defined ones plain added tokens.

    Both are matched whole in the text before the model splits it, as llama.cpp does.
    """
    pairs = list(zip(tokens, types, strict=True))
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in pairs if k in special]
    )
    backend.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in pairs
            if k == _TOKEN_USER_DEFINED
        ]
    )


def _byte_level_backend(
    reader: GGUFReader, tokens: list[str], types: list[int]
) -> tokenizers.Tokenizer:
    pre = _get(reader, "tokenizer.ggml.pre", "default")
    spec = _PRE_SPECS.get(pre)
    if spec is None:
        logger.warning(
            "GGUF pre-tokenizer %r is unknown; splitting text like GPT-2, which may "
            "tokenize differently from the original model",
            pre,
        )
        spec = _PRE_SPECS["default"]
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    # Normal tokens are stored in the byte alphabet already; respell any that are not so BPE
    # can reach them. Control/user-defined tokens stay raw: they are matched whole as added
    # tokens, before BPE runs.
    vocab = {}
    for i, (tok, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) or set(tok) <= spelled:
            vocab.setdefault(tok, i)
        else:
            vocab.setdefault("".join(alphabet[b] for b in tok.encode("utf-8")), i)
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=spec.ignore_merges))
    if spec.normalizer is not None:
        backend.normalizer = spec.normalizer()
    backend.pre_tokenizer = spec.pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, tokens, types, {_TOKEN_CONTROL})
    return backend


def _sentencepiece_backend(
    reader: GGUFReader, tokens: list[str], types: list[int]
) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral) as HF's fast LlamaTokenizer runs it.

    Spaces are spelled "▁" and one is prepended to the text (`add_space_prefix`); bytes missing
    from the vocabulary fall back to the `<0xNN>` tokens.
    """
    merges = [tuple(m.split(" ", 1)) for m in _get(reader, "tokenizer.ggml.merges") or []]
    if not merges:  # SentencePiece files carry scores, not merges
        merges = _merges_from_scores(tokens, _get(reader, "tokenizer.ggml.scores"))
    unk_id = _get(reader, "tokenizer.ggml.unknown_token_id", 0)
    vocab = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(tok, i)
    bpe = models.BPE(vocab, merges, unk_token=tokens[unk_id], fuse_unk=True, byte_fallback=True)
    backend = tokenizers.Tokenizer(bpe)
    add_prefix = bool(_get(reader, "tokenizer.ggml.add_space_prefix", True))
    # "first": the prefix space goes before the text only, not after each special token.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    _add_special_tokens(backend, tokens, types, {_TOKEN_UNKNOWN, _TOKEN_CONTROL})
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: a token that splits into two vocabulary
    tokens is a merge of them, ranked by its score (higher merges first).

    Equal scores are ordered as transformers orders them when it converts the same files
    (longer left, then longer right piece first; then vocabulary order), so both agree.
    """
    ids = {}
    for i, tok in enumerate(tokens):
        ids.setdefault(tok, i)
    candidates = []
    for tok, score in zip(tokens, scores, strict=True):
        splits = [
            (tok[:k], tok[k:]) for k in range(1, len(tok)) if tok[:k] in ids and tok[k:] in ids
        ]
        splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        candidates += [(left, right, score) for left, right in splits]
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]
