"""What the engine builder does differently on a rank of a model-parallel replica.

Owns: the hooks servelm/engine_builder.py calls with a ParallelGroup: the rank's local
config, its checkpoint slices, the expert-parallel layers swapped in before loading, the
tensor-parallel wrapper after it, the KV block count every rank agrees on, and rank 0's
ParallelRunner. Never: loads or runs anything itself.
"""

from __future__ import annotations

import torch
from torch import nn

from servelm.config import ModelConfig
from servelm.parallel.sharding import TensorParallelShard, select_all


def shard_for(group, config: ModelConfig) -> TensorParallelShard:
    """This rank's shard of `config` (kept on the group: every later hook reads it)."""
    group.shard = TensorParallelShard(config, group.rank, group.size,
                                      group.parallel.enable_expert_parallel, group.stage,
                                      group.num_stages)
    return group.shard


def local_config(group, config: ModelConfig) -> ModelConfig:
    return shard_for(group, config).local_config()


def select_weights(group, weights):
    """A whole-tensor iterator narrowed to this rank's slices."""
    return select_all(group.shard, weights)


def prepare_model(group, model: nn.Module) -> None:
    """On the meta model, before loading: expert parallelism swaps each MoE's experts for
    the rank's share of them (their tensors load under local indices)."""
    if not group.parallel.enable_expert_parallel:
        return
    from servelm.layers.moe import Experts
    from servelm.layers.parallel_moe import ExpertParallelExperts

    num_experts = group.shard.config.num_experts
    if not num_experts:
        raise ValueError("enable_expert_parallel needs a mixture-of-experts model; "
                         f"{group.shard.config.architecture} has no experts")
    for module in list(model.modules()):
        experts = getattr(module, "experts", None)
        if isinstance(experts, Experts):
            with torch.device("meta"):
                module.experts = ExpertParallelExperts(
                    num_experts, experts.w13.shape[2], experts.intermediate_size,
                    experts.act_and_mul, group)


def wrap_model(group, model: nn.Module) -> nn.Module:
    """After loading (and quantizing or packing): the reductions and the vocabulary-parallel
    embedding and head."""
    from servelm.layers.parallel_linear import TensorParallelModel

    pipeline = None
    if group.num_stages > 1:
        from servelm.parallel.pipeline import PipelineSchedule

        pipeline = PipelineSchedule(group)
    return TensorParallelModel(model, group.shard.config.vocab_size, group, pipeline)


def agree_num_blocks(group, num_blocks: int) -> int:
    """Every rank pages the same block ids: the fewest any rank can hold."""
    return group.all_min(num_blocks)


def attach_decode_stack(group, runner, mode: str) -> None:
    """On the CPU: the rank's all-decode steps through the C++ decode stack, with the
    tensor-parallel all-reduces inside it (servelm/parallel/decode_stack.py), where it
    applies; mode: the engine's `--cpu-kernels decode=` choice."""
    from servelm.parallel.decode_stack import TensorParallelDecodeStack

    runner.cpu_stack = TensorParallelDecodeStack.for_rank(group, runner.model, runner.kv_cache,
                                                          runner.backend, mode)


def wrap_runner(group, runner):
    """Rank 0: the ParallelRunner over its ModelRunner; the workers run theirs directly."""
    if group.global_rank != 0:
        return runner
    from servelm.parallel.runner import ParallelRunner

    return ParallelRunner(runner, group, group.workers)


def abandon(group) -> None:
    """Rank 0's build failed: stop the workers and leave the group (a later engine in this
    process may start its own)."""
    group.workers.terminate()
    group.leave()
