"""Expert parallelism: a MoE layer's routed experts placed across ranks, whole.

Owns: `ExpertParallelExperts`, the drop-in for `Experts` (servelm/layers/moe.py) on one rank:
it holds experts [first, first + num_local) of the layer's E and moves tokens to them and
back with two all-to-alls. Never: routes (the router is replicated and runs before it) or
touches the shared experts (replicated: every rank runs them on every token).

Every rank enters with the same T tokens (attention is tensor-parallel, its output
all-reduced), so each takes a contiguous slice of them, sends each (token, expert) assignment
to the expert's owner, gets the expert outputs back, weights and sums them per token, and an
all-gather of the slices puts all T rows back on every rank:

    rank r: tokens [r*P, (r+1)*P)   P = ceil(T / ranks)
      assignments sorted by expert id  ->  split by owner (expert // num_local)
      all_to_all(rows, expert ids)     ->  owner runs each local expert over its rows
      all_to_all(outputs) back         ->  * routing weight, index_add per token
    all_gather(slices) -> [T, hidden] on every rank

The per-token sum runs in ascending expert order as the single-rank layer's does; what can
differ from one rank's layer in the last bits is each expert's GEMM over fewer rows.
"""

from __future__ import annotations

import torch

from servelm.layers.moe import Experts


class ExpertParallelExperts(Experts):
    """`num_experts` global experts, of which this rank stores `num_local` (w13/w2 stacks of
    num_local, loaded under local indices by servelm/parallel/sharding.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act_and_mul, comm):
        if num_experts % comm.size:
            raise ValueError(f"expert parallelism: {num_experts} experts do not split over "
                             f"tensor_parallel_size {comm.size}")
        num_local = num_experts // comm.size
        super().__init__(num_local, hidden_size, intermediate_size, act_and_mul)
        self.num_global, self.num_local = num_experts, num_local
        self.first = comm.rank * num_local
        self.comm = comm
        # The load metric counts every routed token per global expert, as one rank would.
        self.register_buffer("num_routed_tokens", torch.zeros(num_experts, dtype=torch.long),
                             persistent=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] (the same on every rank); weights, ids: [T, k] -> [T, hidden]."""
        t, k = ids.shape
        self.num_routed_tokens += torch.bincount(ids.reshape(-1), minlength=self.num_global)
        size, rank = self.comm.size, self.comm.rank
        per = -(-t // size)
        lo, hi = min(t, rank * per), min(t, (rank + 1) * per)
        flat = ids[lo:hi].reshape(-1)
        order = flat.argsort(stable=True)  # by expert id, hence by owner
        token_of = order // k
        sorted_ids = flat[order]
        owner = sorted_ids // self.num_local
        send = torch.bincount(owner, minlength=size)
        recv = self.comm.all_to_all(send, [1] * size, [1] * size)
        send_sizes, recv_sizes = send.tolist(), recv.tolist()
        rows = self.comm.all_to_all(x[lo:hi].index_select(0, token_of), send_sizes, recv_sizes)
        experts = self.comm.all_to_all(sorted_ids - owner * self.num_local, send_sizes,
                                       recv_sizes)
        out = self.comm.all_to_all(self._run_local(rows, experts), recv_sizes, send_sizes)
        out = out * weights[lo:hi].reshape(-1)[order].unsqueeze(1).to(out.dtype)
        mine = torch.zeros(per, x.shape[1], dtype=x.dtype, device=x.device)
        mine[:hi - lo].index_add_(0, token_of, out)
        return self.comm.all_gather(mine, dim=0)[:t]

    def _run_local(self, rows: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [N, hidden] with local expert ids [N] -> each row through its expert."""
        order = experts.argsort(stable=True)
        counts = torch.bincount(experts, minlength=self.num_experts).tolist()
        out = torch.empty_like(rows)
        sorted_rows = rows.index_select(0, order)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[order[start:start + n]] = self._expert(e, sorted_rows[start:start + n])
                start += n
        return out
