"""The fleet simulator: servelm's own scheduler, block manager and prefix cache, driven in
virtual time by a runner whose step time comes from a fitted cost model (the StepCostModel in
servelm/engine/step_cost_model.py, which the serving engine's SLO policy and KV tiers use too,
so production code never imports the simulator).

    runner.py      SimRunner: the Runner protocol without a model (synthetic tokens)
    fleet.py       the discrete-event simulation of N replicas behind a routing policy
    cli.py         `servelm sim`

Never: re-implements a policy: the Engine, Scheduler, BlockManager and PrefixCache here are
the ones `servelm serve` runs.
"""
