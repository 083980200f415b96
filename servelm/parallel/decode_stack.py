"""The CPU decode stack on a tensor-parallel rank: all-decode steps in one C++ call, sharded.

Owns: whether a rank's model takes the stack (one pipeline stage, and the family's model
inside TensorParallelModel passing the stack's own checks, servelm/runner/cpu_decode.py: the
same fast-path spec, models/fast_path.py, over the rank's shard of each layer), the
torch.distributed group the stack all-reduces o_proj's and down_proj's outputs over
(DecodeStack.set_all_reduce in cpu_kernels/decode_stack.cpp: torch's functional collectives
called from C++, gloo on the CPU), and counting those all-reduces in the group's CommStats as
the eager hooks count theirs. Never: decides a step's shape (every rank gets the same step
and so takes the same path: the stack or the eager model), or runs the head: the
vocabulary-parallel embedding before the stack and the head's all-gather after it are
TensorParallelModel's, as on the eager path.

Why the results equal the eager TP path's: the stack runs the eager path's kernels in its
order, and sums the same partial products in the same all-reduce at the same two places per
layer (where servelm/layers/parallel_linear.py's hooks sum the attention and MLP outputs).
"""

from __future__ import annotations

import torch.distributed as dist

from servelm.runner.cpu_decode import CpuDecodeStack


class TensorParallelDecodeStack(CpuDecodeStack):
    """A CpuDecodeStack over one rank's shard whose C++ stack all-reduces over `group`."""

    row_split = False  # two slices' all-reduces would interleave on one group

    def __init__(self, model, kv_cache, backend, group):
        super().__init__(model, kv_cache, backend)
        self.group = group  # servelm.parallel.group.ParallelGroup
        tp = group.tp_group if group.tp_group is not None else dist.group.WORLD
        self.group_name = tp.group_name

    @classmethod
    def for_rank(cls, group, model, kv_cache, backend, mode: str
                 ) -> TensorParallelDecodeStack | None:
        """The stack for this rank's TensorParallelModel, or None where it does not apply:
        pipeline stages wait on the previous stage's hidden states between layers, so they
        run eagerly; so do mixtures of experts, latent attention and every model the plain
        stack refuses."""
        if group.num_stages > 1:
            return None
        spec = model.model.fast_path()
        if getattr(spec, "has_experts", False) or getattr(spec, "has_mla", False):
            # the experts' sums are the expert-parallel all-to-all's (layers/parallel_moe.py),
            # which the stack does not make; a rank's share of latent attention's heads is
            # not tested on the stack
            return None
        plain = CpuDecodeStack.for_model(model.model, kv_cache, backend, mode)
        if plain is None:
            return None
        return cls(model.model, plain.kv_cache, backend, group)

    def _new_stack(self, form="full"):
        stack = super()._new_stack(form)
        stack.set_all_reduce(self.group_name)
        return stack

    def maybe_run(self, fb, num_layers=None):
        hidden = super().maybe_run(fb, num_layers)
        if hidden is not None:  # two all-reduces of [rows, hidden] per layer run
            layers = len(self.model.layers) if num_layers is None else min(
                num_layers, len(self.model.layers))
            s = self.group.stats
            s.all_reduce_calls += 2 * layers
            s.all_reduce_bytes += 2 * layers * hidden.numel() * hidden.element_size()
            s.all_reduce_s += sum(st.take_reduce_seconds() for st in self._stacks.values())
        return hidden
