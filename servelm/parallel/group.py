"""ParallelGroup: one rank's process group and the collectives the parallel layers call.

Owns: joining torch.distributed (gloo for CPU tensors, NCCL for CUDA ones: one group with the
backend per device, `cpu:gloo,cuda:nccl`), the rank's coordinates (tensor-parallel rank and
size), the step broadcast's byte transport, and a count of what every collective moved (the
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
    """This process's place in a replica's group of tensor-parallel ranks."""

    def __init__(self, rank: int, parallel: ParallelConfig, device: torch.device):
        self.rank = rank
        self.parallel = parallel
        self.size = parallel.tensor_parallel_size
        self.device = device
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
        return cls(rank, parallel, device)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- collectives for the layers ---------------------------------------------------------

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place (t is the block's fresh output)."""
        start = time.perf_counter()
        dist.all_reduce(t)
        s = self.stats
        s.all_reduce_s += time.perf_counter() - start
        s.all_reduce_calls += 1
        s.all_reduce_bytes += t.numel() * t.element_size()
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's t (equal shapes) concatenated along dim, rank order."""
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t)
        self._count("all_gather", t)
        return torch.cat(parts, dim=dim)

    def all_to_all(self, t: torch.Tensor, send_sizes: list[int],
                   recv_sizes: list[int]) -> torch.Tensor:
        """Rows [sum(send_sizes), ...] split to the ranks in order; returns the rows every
        rank sent here, [sum(recv_sizes), ...] in rank order."""
        out = t.new_empty((sum(recv_sizes), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv_sizes, send_sizes)
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
