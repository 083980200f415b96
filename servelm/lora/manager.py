"""LoraManager: the runner's side of LoRA: adapters in host memory, slot buffers, and the
forward pass of a step whose batch has adapter rows.

Owns: the host copies of registered adapters (read once from their safetensors file, scaling
folded into B), the `max_loras` slot buffers of every adapted projection (an adapter is
copied into a slot when the engine's LoraSlots says so, through StepDescription.lora), the
per-step LoraBatch (which rows use which slot) and the forward pass with LoRA applied: forward
hooks on the base projections add each group's low-rank product (servelm/lora/segmented.py)
to the base output, so every base linear kind (float, oneDNN-packed, int8/int4, GGUF
blocks) keeps its own kernel and LoRA rides on top of it.
Never: decides residency or eviction (the engine does), or changes a step without adapter
rows: such a step runs exactly the runner's usual path (CUDA graphs, the C++ CPU decode
stack), because the hooks are attached only for the forward of a step that has them.

Slot buffers of one projection (qkv_proj: 3 slices q, k, v; R = max_lora_rank):

    a:     [S, 3 * R, hidden]   slice j's A in rows j*R .. j*R + rank (zero beyond)
    bs[j]: [S, size_j, R]       slice j's B * scaling in columns 0 .. rank
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from servelm.core.contract import LoraDeltas
from servelm.lora.adapter import LINEAR_PARENT, PACKED, read_adapter, target_shapes
from servelm.lora.segmented import LoraBatch, add_lora, build_lora_batch

logger = logging.getLogger(__name__)

# slices of each adapted linear: a packed one's parts, else one
_SLICES = {name: len(PACKED[name]) if name in PACKED else 1 for name in LINEAR_PARENT}


@dataclass
class HostAdapter:
    lora_id: int
    name: str
    rank: int
    # (layer, linear, slice) -> (A [r, in], B * scaling [out_slice, r]), host memory
    weights: dict[tuple[int, str, int], tuple[torch.Tensor, torch.Tensor]]

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size()
                   for a, b in self.weights.values())


class _LoraLinear:
    """One adapted projection's slot buffers."""

    def __init__(self, parent: nn.Module, name: str, sizes: list[tuple[int, int]],
                 num_slots: int, max_rank: int, dtype, device):
        # The projection is looked up when hooked, not kept: a later pass may replace the
        # module (quantized or batch-invariant linears) and the adapter rides on the new one.
        self.parent, self.name = parent, name
        n_in = sizes[0][0]
        self.offsets = [sum(s for _, s in sizes[:j]) for j in range(len(sizes))]
        self.a = torch.zeros((num_slots, len(sizes) * max_rank, n_in), dtype=dtype,
                             device=device)
        self.bs = [torch.zeros((num_slots, size, max_rank), dtype=dtype, device=device)
                   for _, size in sizes]
        self.present = [[False] * len(sizes) for _ in range(num_slots)]

    @property
    def module(self) -> nn.Module:
        return getattr(self.parent, self.name)

    @property
    def num_bytes_per_slot(self) -> int:
        per = self.a[0].numel() * self.a.element_size()
        return per + sum(b[0].numel() * b.element_size() for b in self.bs)


class LoraManager:
    def __init__(self, model: nn.Module, model_config, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype):
        self.model_config = model_config
        self.max_loras, self.max_rank = max_loras, max_rank
        self.device, self.dtype = device, dtype
        for name, parts in PACKED.items():  # the adapter checks mapped PEFT names by these
            if model.packed_modules.get(name) != parts:
                raise ValueError(f"LoRA: {model_config.architecture} packs {name} otherwise "
                                 "than the adapter checks assume (servelm/models/packed.py)")
        shapes = target_shapes(model_config)
        self.linears: dict[tuple[int, str], _LoraLinear] = {}
        for i, layer in enumerate(model.layers):
            for name, n_slices in _SLICES.items():
                parent = getattr(layer, LINEAR_PARENT[name], None)
                module = getattr(parent, name, None)
                if module is None:
                    raise ValueError(f"LoRA: layer {i} of {model_config.architecture} has no "
                                     f"{LINEAR_PARENT[name]}.{name} to adapt")
                sizes = [shapes[(name, j)] for j in range(n_slices)]
                self.linears[(i, name)] = _LoraLinear(parent, name, sizes, max_loras,
                                                      max_rank, dtype, device)
        self.host: dict[int, HostAdapter] = {}
        self.slot_of: dict[int, int] = {}  # lora_id -> slot
        self.slot_ranks = [0] * max_loras
        self.num_lora_steps = 0  # forwards run with adapter rows (tests, metrics)
        self.num_rows = 0  # adapter rows computed so far
        self.num_gathered_steps = 0  # of the LoRA forwards, those on the CPU's gathered path

    @property
    def slot_bytes(self) -> int:
        return sum(lin.num_bytes_per_slot for lin in self.linears.values())

    # -- step deltas -----------------------------------------------------------------------

    def apply(self, deltas: LoraDeltas | None) -> None:
        if deltas is None:
            return
        for ref in deltas.added:
            self.host[ref.lora_id] = self._read(ref.lora_id, ref.name, ref.path)
        for lora_id in deltas.removed:
            self.host.pop(lora_id, None)
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.slot_ranks[slot] = 0
        for slot, lora_id in deltas.slots.items():
            self._load_slot(slot, self.host[lora_id])

    def _read(self, lora_id: int, name: str, path: str) -> HostAdapter:
        from safetensors.torch import load_file

        spec = read_adapter(path, self.model_config, self.max_rank)
        tensors = load_file(f"{spec.path}/adapter_model.safetensors")
        pin = self.device.type == "cuda"
        weights = {}
        for key, (a_name, b_name) in spec.targets.items():
            a = tensors[a_name].to(self.dtype)
            b = (tensors[b_name].float() * spec.scaling).to(self.dtype)
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            weights[key] = (a, b)
        adapter = HostAdapter(lora_id, name, spec.rank, weights)
        logger.info("LoRA adapter %r (rank %d, %s) read into host memory: %.1f MB", name,
                    spec.rank, ",".join(spec.target_modules), adapter.num_bytes / 1e6)
        return adapter

    def _load_slot(self, slot: int, adapter: HostAdapter) -> None:
        for lora_id, s in list(self.slot_of.items()):
            if s == slot:
                del self.slot_of[lora_id]
        r, big = adapter.rank, self.max_rank
        for (layer, name), lin in self.linears.items():
            lin.a[slot].zero_()
            for j, b in enumerate(lin.bs):
                b[slot].zero_()
                w = adapter.weights.get((layer, name, j))
                lin.present[slot][j] = w is not None
                if w is not None:
                    lin.a[slot, j * big:j * big + r].copy_(w[0], non_blocking=True)
                    b[slot, :, :r].copy_(w[1], non_blocking=True)
        self.slot_of[adapter.lora_id] = slot
        self.slot_ranks[slot] = r

    # -- a step's forward ------------------------------------------------------------------

    def batch_for(self, works: list, query_start_loc: list[int]) -> LoraBatch | None:
        """The step's row groups (works in flat-batch order, each with .seq.lora_id), or
        None when no row uses an adapter."""
        rows = []
        for i, w in enumerate(works):
            lora_id = w.seq.lora_id
            slot = None
            if lora_id is not None:
                slot = self.slot_of.get(lora_id)
                if slot is None:
                    raise RuntimeError(f"sequence {w.seq.seq_id} runs with adapter {lora_id}, "
                                       "which no slot holds (the engine must load it first)")
            rows.append((query_start_loc[i], query_start_loc[i + 1] - query_start_loc[i],
                         slot))
        return build_lora_batch(rows, self.slot_ranks, self.device)

    def forward(self, model: nn.Module, backend, fb) -> torch.Tensor:
        """The eager forward with every adapted projection's LoRA added (fb.lora set)."""
        fb.attn_metadata = backend.build_metadata(fb)
        with self._hooks(fb.lora):
            hidden = model(fb.input_ids, fb.positions, fb)
        self.num_lora_steps += 1
        self.num_rows += fb.lora.num_rows
        self.num_gathered_steps += fb.lora.row_slots is not None
        return hidden

    @contextmanager
    def _hooks(self, batch: LoraBatch):
        handles = []
        try:
            for lin in self.linears.values():
                if any(any(lin.present[g.slot]) for g in batch.groups):
                    handles.append(lin.module.register_forward_hook(self._hook(lin, batch)))
            yield
        finally:
            for h in handles:
                h.remove()

    def _hook(self, lin: _LoraLinear, batch: LoraBatch):
        max_rank = self.max_rank

        def hook(module, args, out):
            x = args[0]
            flat = out.reshape(-1, out.shape[-1])  # out itself when contiguous, else a copy
            add_lora(x.reshape(-1, x.shape[-1]), flat, batch, lin.a, lin.bs, lin.offsets,
                     lin.present, max_rank)
            return flat.view(out.shape)

        return hook


def lora_flops_per_token(model_config, rank: int, target_modules: list[str]) -> int:
    """Extra multiply-adds x2 per token for one adapter of `rank` on these PEFT modules."""
    from servelm.lora.adapter import TARGETS

    shapes = target_shapes(model_config)
    per_layer = sum(rank * sum(shapes[TARGETS[t]]) for t in target_modules)
    return 2 * per_layer * model_config.num_layers


def lora_params(model_config, rank: int, target_modules: list[str]) -> int:
    return lora_flops_per_token(model_config, rank, target_modules) // 2


__all__ = ["HostAdapter", "LoraManager", "lora_flops_per_token", "lora_params"]
