"""Model parallelism of one replica: tensor-parallel ranks (and expert parallelism over
them) as worker processes joined in a torch.distributed group (docs/parallel.md).

    group.py     ParallelGroup: joining, the collectives the layers call, the step broadcast
    sharding.py  TensorParallelShard: a rank's local config and its checkpoint slices
    launcher.py  start_workers / WorkerSet: spawning, watching and stopping the workers
    worker.py    a worker's main: build its shard (with the build it is given), run every
                 broadcast step (its process entry: servelm/core_process/worker.py)
    runner.py    ParallelRunner: rank 0's Runner (broadcast, run, return its result)
    build.py     the hooks servelm/engine_builder.py calls on a rank

The layers themselves live in servelm/layers/parallel_linear.py and parallel_moe.py.
Never: scheduling (one scheduler per replica, on rank 0) or pickle on the wire.
"""
