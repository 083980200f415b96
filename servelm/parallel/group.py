"""ParallelGroup: one rank's process group and the collectives the parallel layers call.

Owns: joining torch.distributed (gloo for CPU tensors, NCCL for CUDA ones: one group with the
backend per device, `cpu:gloo,cuda:nccl`), the rank's coordinates (global rank = stage x
tensor-parallel size + tensor-parallel rank; one tensor-parallel subgroup per pipeline
stage), the step broadcast's byte transport, the point-to-point sends between stages, and a count of what every collective moved (the
parallel benchmark reads it against the planner's formula). Never: decides what a message
means (servelm/parallel/runner.py and worker.py speak the codec), or starts processes.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from servelm.config import ParallelConfig


@dataclass
class CommStats:
    """Collectives since start-up (or the last reset): calls, payload bytes, wall seconds."""

    all_reduce_calls: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    other_calls: int = 0
    other_bytes: int = 0
    by_op: dict[str, int] = field(default_factory=dict)

    def reset(self) -> None:
        self.__init__()


class ParallelGroup:
    """This process's place in a replica: `rank` / `size` are its tensor-parallel coordinates
    (what the layers split by), `global_rank` its place among all the replica's processes,
    `stage` / `num_stages` its pipeline stage."""

    def __init__(self, global_rank: int, parallel: ParallelConfig, device: torch.device,
                 tp_group=None):
        self.global_rank = global_rank
        self.parallel = parallel
        self.size = parallel.tensor_parallel_size
        self.rank = global_rank % self.size
        self.stage, self.num_stages = global_rank // self.size, parallel.pipeline_parallel_size
        self.device = device
        self.tp_group = tp_group  # None: the whole world is one tensor-parallel group
        self.stats = CommStats()

    # -- joining ----------------------------------------------------------------------------

    @classmethod
    def join(cls, rank: int, parallel: ParallelConfig, device: torch.device,
             master_addr: str, master_port: int, timeout_s: float) -> ParallelGroup:
        """Join the replica's group (blocks until every rank has joined). timeout_s bounds
        every collective afterwards too: a rank that hangs fails the others, never stalls
        them for ever."""
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                rank=rank, world_size=parallel.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        tp_group, tp = None, parallel.tensor_parallel_size
        if parallel.pipeline_parallel_size > 1:  # every rank creates every subgroup, in order
            for stage in range(parallel.pipeline_parallel_size):
                g = dist.new_group(list(range(stage * tp, (stage + 1) * tp)))
                if stage == rank // tp:
                    tp_group = g
        return cls(rank, parallel, device, tp_group)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives for the layers ---------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t is the block's fresh output)."""
        start = time.perf_counter()
        dist.all_reduce(t, group=self.tp_group)
        s = self.stats
        s.all_reduce_s += time.perf_counter() - start
        s.all_reduce_calls += 1
        s.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's t (equal shapes) concatenated along dim, rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.tp_group)
        self._count("all_gather", t)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, send_sizes: list[int],
                   recv_sizes: list[int]) -> torch.Tensor:
        """Rows [sum(send_sizes), ...] split to the ranks in order; returns the rows every
        rank sent here, [sum(recv_sizes), ...] in rank order."""
        out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_sizes, send_sizes,
                               group=self.tp_group)
        self._count("all_to_all", t)
        return out

    def _count(self, op: str, t: torch.Tensor) -> None:
        self.stats.other_calls += 1
        self.stats.other_bytes += t.numel() * t.element_size()
        self.stats.by_op[op] = self.stats.by_op.get(op, 0) + 1

    def all_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV blocks all ranks can hold)."""
        t = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    # -- between pipeline stages (the same tensor-parallel rank of the next / previous) -----

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.num_stages - 1

    def send_next(self, t: torch.Tensor):
        """Start sending t to the next stage; returns the request to wait on."""
        self._count("send", t)
        return dist.isend(t.contiguous(), self.global_rank + self.size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(t, self.global_rank - self.size)
        return t

    def broadcast_from_last_stage(self, t: torch.Tensor) -> torch.Tensor:
        """The last stage's t (its tensor-parallel rank 0's), on every rank, in place."""
        dist.broadcast(t, (self.num_stages - 1) * self.size)
        self._count("broadcast", t)
        return t

    # -- the step broadcast (CPU tensors: gloo in both set-ups) -----------------------------

    def broadcast_bytes(self, kind: int, payload: bytes = b"") -> None:
        """Rank 0: send (kind, payload) to every rank."""
        header = torch.tensor([kind, len(payload)], dtype=torch.long)
        dist.broadcast(header, 0)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)

    def receive_bytes(self) -> tuple[int, bytes]:
        """Any other rank: the next (kind, payload) rank 0 sent."""
        header = torch.empty(2, dtype=torch.long)
        dist.broadcast(header, 0)
        kind, n = (int(v) for v in header.tolist())
        if not n:
            return kind, b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, 0)
        return kind, buf.numpy().tobytes()
