"""CpuDecodeStack: a decode step of a model in one C++ call, on the CPU, built from the
model's description of its layers (`model.fast_path()`, servelm/models/fast_path.py).

At one token a step a decoder layer's kernels take ~100 us on this machine and the Python
around them (module calls, views, the attention backend, a dispatcher round trip per op)
about as much again. For a step in which every sequence decodes one token, the runner hands
the embedded tokens to `torch.classes.servelm_cpu.DecodeStack` (cpu_kernels/decode_stack.cpp),
which runs the same kernels in the same order as the eager path and returns the final hidden
states. It holds the modules' tensors (shared, not copied) and the KV cache's layers.
Speculative verifications (a few query tokens after a context) ride along as one decode row
per token (see `maybe_run`); a draft model's steps (servelm/spec/draft.py) take a stack of
their own, early-exit drafts the target's first N layers. An EAGLE-3 drafter's features (the
hidden states after some layers) come back from the same call (`maybe_run(aux_layers=...)`).

In deterministic mode (the backend's `deterministic`, set by the runner for --deterministic)
the stack takes every step, prefill chunks included, as one row per token (the verification
form above at any length): prefill, decode, verification and recompute then run one per-row
algorithm, the linears are batch-invariant (float32: DetLinear; bfloat16: DotLinear, or
AmxLinear at every row count where AMX runs: servelm/layers/det_linear.py) and a row's bits
do not depend on the batch it came in. An all-decode step may still run in slices of rows
(row_parts): every kernel computes a row the same way in a slice as in the whole step.

Applies when: the model describes itself to the stack (`model.fast_path()`, a
DecodeStackSpec: servelm/models/fast_path.py; a family whose layers the stack cannot take
gives the reason instead, and it is logged at start-up with the layer), on the CPU in float32
or bfloat16, with a KV cache in the model's dtype or fp8 read by the C++ decode kernel
(TorchAttentionBackend; a latent-attention model's cache by the latent kernel, outside
deterministic mode, which MLA does not support), and every linear of the layers has a stack
form (quant/decode_entry.py): an nn.Linear, a PackedLinear (oneDNN) or, in float32, a quantized
layer on servelm's C++ kernels (Int4Linear / Int8Linear with kernel "cpu", also behind a
PermutedLinear's gather) or a DetLinear, in bfloat16 a DotLinear (an AmxLinear alone in
deterministic mode); in either a GGUF K-quant matrix (KQuantLinear) and a fused layer of
row parts (RowPartsLinear) whose parts all have a form the model's rows take. Steps with a prefill chunk
and models without the stack run eagerly; `CpuDecodeStack.steps` counts the steps it ran.

The engine option `--cpu-kernels decode=MODE` (servelm/config/cpu_kernel_choice.py; the runner is
given it as `cpu_decode`) chooses:

    auto    the stack where it applies and the kernels build (default)
    kernel  the same, but a failed build is an error
    torch   never
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from servelm import cpu_kernels
from servelm.attention import AttentionBackend
from servelm.attention.forward_batch import ForwardBatch
from servelm.attention.kv_cache import KVCache
from servelm.quant.decode_entry import (BF16_ROW_KINDS, KIND_AMX, KIND_DOT, decode_entry,
                                        forms, is_mixed)

logger = logging.getLogger(__name__)

PART = "decode"  # of CpuKernelChoice
# A plain decode step of many rows on a bfloat16 model's DotLinears runs as two slices of
# rows, a thread each (DecodeStack.run_parts): each core takes its rows through every layer,
# meeting the other once a step instead of at every kernel (~240 barriers). Record
# decode-row-split-20261206T135528Z (benchmarks/cpu/decode_row_split.py; AMD EPYC, Zen 5,
# 2 threads, the default model; one step whole against in slices, medians of 40): 48 rows
# 19.22 -> 17.63 ms, 64 rows 25.09 -> 24.66, 128 rows 48.44 -> 44.57; but 40 rows 16.64 ->
# 16.63 and 32 rows 14.01 -> 17.67 (a slice streams all the weights: few rows pay memory for
# little work). Not split: float32 linears (oneDNN's and the panel GEMM; 64 rows 60.6 -> 62.5
# ms, measured ad hoc) and more threads (each further slice streams the weights once more;
# not measured).
ROW_PART_MIN_ROWS = 24  # rows each slice must keep
ROW_PART_THREADS = 2  # the intra-op thread count it is measured at: two slices
# A row's linears cost about what attention over this many context positions does (the
# default model at 64 rows, ~206 positions each: linears ~17 ms a step, attention ~7 ms)
ROW_COST_POSITIONS = 512
# The linears take rows in blocks of this many (dot_gemm.cpp's kMaxRows): a slice costs its
# blocks, whole. One step of 64 rows, the cut at row 30, 32 or 33 (medians of 40, ad hoc):
# 26.3, 25.1 and 27.2 ms.
GEMM_ROW_BLOCK = 8
MAX_VERIFY_ROWS = 9  # query tokens of a sequence the stack takes: 1 + up to 8 drafts


class CpuDecodeStack:
    def __init__(self, model, kv_cache: KVCache, backend: AttentionBackend):
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self._stacks = {}  # form -> the C++ stack ("small": MixedLinears' few-row form)
        self._built_for = None  # (K cache pointer, number of layers) the stacks were built on
        spec = model.fast_path()
        linears = spec.linears
        self._small_rows = min((m.max_rows for m in linears if is_mixed(m)), default=0)
        self.steps = 0  # steps run through the stack
        self.verify_steps = 0  # of which with speculative verifications
        self.split_steps = 0  # of which in slices of rows (row_parts)
        # not with experts: both slices would add to the experts' routed-token counts at
        # once, and each would stream every expert its rows touch (not measured)
        self._row_split = self.row_split and not spec.has_experts and all(
            decode_entry(forms(m)["full"]).kind == KIND_DOT for m in linears)

    # whether plain decode steps may run in slices of rows (row_parts); a tensor-parallel
    # stack's all-reduces cannot (servelm/parallel/decode_stack.py)
    row_split = True

    @classmethod
    def build(cls, model, kv_cache, backend, mode: str | None = None
              ) -> tuple[CpuDecodeStack | None, str | None]:
        """(the stack for this model, None), or (None, why not) where it does not apply
        (see the module doc); the reason a model or its layers cannot take it is logged, as
        a warning on the CPU.
        kv_cache None: the backend's. mode: 'auto' | 'kernel' | 'torch'; None: the
        process's choice."""
        mode = cpu_kernels.mode(PART) if mode is None else mode
        if mode not in cpu_kernels.MODES:
            raise ValueError(f"cpu_kernels: {PART}={mode!r}: choose one of {cpu_kernels.MODES}")
        kv_cache = kv_cache if kv_cache is not None else backend.kv_cache
        if mode == "torch":
            return None, f"--cpu-kernels {PART}=torch"
        if kv_cache is None:
            return None, "no KV cache"
        why = refusal(model, kv_cache, backend)
        if why is not None:
            # a warning on the CPU, where the stack is the fast path (shown by default);
            # elsewhere the stack is not expected
            level = logging.WARNING if kv_cache.k.device.type == "cpu" else logging.INFO
            logger.log(level, "decode stack: %s; decode steps run eagerly", why)
            return None, why
        if cpu_kernels.ops_for_mode(PART, mode) is None:  # a failed build in mode 'auto'
            return None, "the C++ kernels did not build"
        return cls(model, kv_cache, backend), None

    @classmethod
    def for_model(cls, model, kv_cache, backend, mode: str | None = None
                  ) -> CpuDecodeStack | None:
        """The stack for this model, or None where it does not apply (`build`)."""
        return cls.build(model, kv_cache, backend, mode)[0]

    def maybe_run(self, fb: ForwardBatch, num_layers: int | None = None,
                  aux_layers: tuple[int, ...] = ()):
        """Final hidden states [T, hidden] for a batch of decodes and speculative
        verifications, else None. num_layers: the first N layers, then the final norm (an
        early-exit draft); None: all. aux_layers: also the hidden state after each of these
        layers (an EAGLE-3 drafter's features, as DecoderLM.forward's): (out, [aux...]).

        A verification (a sequence with context whose few query tokens are the last token
        and its drafts) runs as one decode row per token: every row's K/V is stored before
        attention, and row t attends positions 0..positions[t], which is causal attention
        over the chunk. Fresh prompts and longer chunks (prefill) run eagerly."""
        if not fb.num_seqs:
            return None
        if self.backend.deterministic:  # every step, every token one row
            qsl = fb.query_start_loc
            lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(fb.num_seqs)])
            tables = fb.block_tables[:fb.num_seqs].repeat_interleave(lens, dim=0)
            seq_lens = fb.positions + 1
        elif fb.num_decodes == fb.num_seqs:
            tables, seq_lens = fb.block_tables, torch.tensor(fb.seq_lens, dtype=torch.long)
        else:
            qsl, ctx = fb.query_start_loc, fb.context_lens
            lens = [qsl[i + 1] - qsl[i] for i in range(fb.num_seqs)]
            if any(n > MAX_VERIFY_ROWS or (n > 1 and c == 0) for n, c in zip(lens, ctx)):
                return None
            tables = fb.block_tables.repeat_interleave(torch.tensor(lens), dim=0)
            seq_lens = fb.positions + 1
            self.verify_steps += 1
        key = (self.kv_cache.k.data_ptr(), len(self.model.layers))
        if self._built_for != key:
            self._stacks = {}
            self._built_for = key
        # MixedLinear layers: their few-row form for a step of at most that many rows
        form = "small" if fb.input_ids.numel() <= self._small_rows else "full"
        stack = self._stacks.get(form)
        if stack is None:
            stack = self._stacks[form] = self._new_stack(form)
        x = self.model.embed(fb.input_ids)
        self.steps += 1
        if aux_layers:
            out, *aux = stack.run_aux(x, fb.positions, fb.slot_mapping, tables, seq_lens,
                                      list(aux_layers))
            return out, aux
        layers = -1 if num_layers is None else num_layers
        # one row a sequence (deterministic mode too: its rows are then the plain form's, and
        # no sequence's rows can land in two slices)
        plain = fb.num_decodes == fb.num_seqs
        if plain and self._row_split and form == "full":
            bounds = row_parts(list(fb.seq_lens), torch.get_num_threads())
            if len(bounds) > 2:
                self.split_steps += 1
                return stack.run_parts(x, fb.positions, fb.slot_mapping, tables, seq_lens,
                                       layers, True, bounds)
        return stack.run(x, fb.positions, fb.slot_mapping, tables, seq_lens, layers, True)

    def _new_stack(self, form: str = "full"):
        """The C++ stack over the model's current tensors, each MixedLinear in `form`
        (servelm/parallel/decode_stack.py adds its tensor-parallel all-reduces here)."""
        return _build(self.model, self.kv_cache, self.backend, form)


def row_parts(seq_lens: list[int], threads: int, min_rows: int = ROW_PART_MIN_ROWS
              ) -> list[int]:
    """Where a plain decode step's rows split into slices, a thread each: [0, cut, B], or
    [0, B] for no split. Two slices, only at two threads (ROW_PART_THREADS) and with at
    least `min_rows` rows each. The cut makes the costlier slice as cheap as it can be: a
    slice costs its linears' row blocks (GEMM_ROW_BLOCK rows each, ROW_COST_POSITIONS a
    row) and its attention (its sequences' contexts, seq_lens); the first such cut wins."""
    rows = len(seq_lens)
    min_rows = max(1, min_rows)
    if threads != ROW_PART_THREADS or rows < 2 * min_rows:
        return [0, rows]

    def linears(n: int) -> int:
        return -(-n // GEMM_ROW_BLOCK) * GEMM_ROW_BLOCK * ROW_COST_POSITIONS

    before = [0]  # before[i]: the context of rows 0 .. i-1
    for n in seq_lens:
        before.append(before[-1] + n)
    cut = min(range(min_rows, rows - min_rows + 1),
              key=lambda c: max(linears(c) + before[c],
                                linears(rows - c) + before[rows] - before[c]))
    return [0, cut, rows]


def refusal(model, kv_cache, backend) -> str | None:
    """Why the stack cannot run this model's decode steps over this KV cache and backend,
    or None: the model's own reason (models/fast_path.py), then the runner's (device,
    dtype, cache, backend, each linear's form)."""
    from servelm.attention.torch_backend import TorchAttentionBackend

    describe = getattr(model, "fast_path", None)
    spec = describe() if describe is not None else f"{type(model).__name__} has no fast path"
    if not hasattr(spec, "layers"):
        return str(spec)
    if not isinstance(backend, TorchAttentionBackend):
        return f"attention backend {backend.name!r} (the stack reads the torch backend's cache)"
    embed = model.embed_tokens.weight
    if embed.device.type != "cpu" or embed.dtype not in (torch.float32, torch.bfloat16):
        return f"a {embed.dtype} model on {embed.device.type} (float32 or bfloat16 CPU only)"
    if kv_cache.k.dtype != embed.dtype and not kv_cache.is_fp8:
        return f"a {kv_cache.k.dtype} KV cache for a {embed.dtype} model"
    if backend.kv_cache is not kv_cache:
        return "the attention backend reads another KV cache"
    if spec.has_mla:
        if backend.mla_decode_kernel is None:
            return "the attention backend has no C++ latent-attention decode kernel"
        if backend.deterministic:  # as the eager path (TorchAttentionBackend.forward_mla)
            return "deterministic mode does not support multi-head latent attention"
    elif backend.decode_kernel is None:
        return "the attention backend has no C++ decode kernel over this cache"
    for i, layer in enumerate(spec.layers):
        for name, m in layer.named_linears():
            why = _linear_refusal(m, embed.dtype, backend.deterministic)
            if why is not None:
                return f"layer {i}: {name}: {why}"
    return None


def _linear_refusal(m: nn.Module, dtype: torch.dtype, deterministic: bool) -> str | None:
    """Why the stack cannot take linear `m` (each of a MixedLinear's forms) in a model of
    `dtype`, or None."""
    entries = {f: decode_entry(layer) for f, layer in forms(m).items()}
    for f, entry in entries.items():
        if entry is None:
            return f"{type(forms(m)[f]).__name__} has no decode-stack form"
    if dtype == torch.float32:
        return None
    # bfloat16 rows: oneDNN's linears and the int8-activation kernels; the other quantized
    # kernels take float32 rows, which the stack widens to only for a MixedLinear's few-row
    # form (its eager forward does the same)
    allowed = set(BF16_ROW_KINDS) | ({KIND_AMX} if deterministic else set())
    if is_mixed(m):
        allowed |= entries["small"].kernel_kinds
    if not entries["full"].kernel_kinds <= allowed:
        return f"{type(forms(m)['full']).__name__} takes float32 rows; the model is {dtype}"
    return None


def _build(model, kv_cache, backend, form: str = "full"):
    """The C++ stack over the model's current tensors (its spec now: the runner may have
    replaced linears since), each MixedLinear in `form`. The flat lists' order is the one
    DecodeStack's constructor reads (cpu_kernels/decode_stack.cpp): a header, then per layer
    its flags and tensors, its attention (GQA or latent) and its MLP."""
    cpu_kernels.load()
    spec = model.fast_path()
    ints = [len(spec.layers), spec.num_heads, spec.num_kv_heads, spec.head_dim,
            kv_cache.block_size]
    floats = [spec.norm_eps, float(backend.scale)]
    tensors = [spec.final_norm]
    out = (tensors, ints, floats)
    for layer in spec.layers:
        k_cache, v_cache = kv_cache.layer(layer.kv_layer)
        ints += [int(layer.sandwich), int(layer.has_experts), int(layer.is_mla)]
        tensors += [_or_none(t) for t in (
            layer.input_norm, layer.post_attention_norm, layer.pre_feedforward_norm,
            layer.post_feedforward_norm, k_cache, v_cache)]
        if layer.is_mla:
            _add_mla(out, layer.attention, form)
        else:
            _add_attention(out, layer.attention, kv_cache.layer_scales(layer.kv_layer), form)
        if layer.has_experts:
            _add_moe(out, layer.mlp, form)
        else:
            _add_mlp(out, layer.mlp, form)
    return torch.classes.servelm_cpu.DecodeStack(tensors, ints, floats)


_NONE = torch.empty(0)


def _or_none(t: torch.Tensor | None) -> torch.Tensor:
    return _NONE if t is None else t


def _add_linear(out, m, form: str) -> None:
    entry = decode_entry(forms(m)[form])
    out[0].extend(entry.tensors)
    out[1].extend(entry.ints)


def _add_attention(out, attn, scales, form: str) -> None:
    """GQA: its flags, rotary table, q/k norms, an fp8 cache's scales (else empty), qkv, o."""
    tensors, ints, floats = out
    ints.append(attn.window)
    floats += [attn.softcap, attn.q_mult]
    tensors += [_or_none(t) for t in (attn.cos, attn.sin, attn.q_norm, attn.k_norm, *scales)]
    _add_linear(out, attn.qkv_proj, form)
    _add_linear(out, attn.o_proj, form)


def _add_mla(out, mla, form: str) -> None:
    """Latent attention: its shape, scale, rope table, norms, kv_b, rope order, linears."""
    tensors, ints, floats = out
    low_rank = mla.q_proj is None
    ints += [mla.num_heads, mla.nope, mla.rope, mla.v_dim, mla.latent, int(low_rank)]
    floats.append(mla.scale)
    tensors += [mla.cos, mla.sin, _or_none(mla.q_a_norm), mla.kv_a_norm, mla.kv_b_weight,
                mla.rope_perm]
    for m in ((mla.q_a_proj, mla.q_b_proj) if low_rank else (mla.q_proj,)):
        _add_linear(out, m, form)
    _add_linear(out, mla.kv_a_proj, form)
    _add_linear(out, mla.o_proj, form)


def _add_mlp(out, mlp, form: str) -> None:
    out[1].append(mlp.activation)
    _add_linear(out, mlp.gate_up_proj, form)
    _add_linear(out, mlp.down_proj, form)


def _add_moe(out, moe, form: str) -> None:
    tensors, ints, floats = out
    r = moe.routing
    ints += [len(moe.experts), r.top_k, int(r.renormalize), int(r.scoring == "sigmoid"),
             r.num_groups, r.topk_groups, int(r.group_score == "top2"),
             int(moe.shared is not None), int(moe.shared_gate is not None)]
    floats.append(float(r.scaling))
    tensors += [_or_none(moe.score_bias), moe.routed_tokens]
    _add_linear(out, moe.router, form)
    for expert in moe.experts:
        _add_mlp(out, expert, form)
    if moe.shared is not None:
        _add_mlp(out, moe.shared, form)
    if moe.shared_gate is not None:
        _add_linear(out, moe.shared_gate, form)
