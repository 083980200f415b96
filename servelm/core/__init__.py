"""The step contract between the engine and its runners, and the one wire format.

    contract.py         StepDescription / StepResult / StepReport and the Runner protocol
    sequence_tokens.py  the token layout the engine's and the runners' sequences share
    runner_state.py     a runner's own view of each sequence, built from step deltas
    codec.py            the one wire format (typed msgpack via msgspec, versioned; never pickle)
    kv_event_log.py     the front end's bounded log of its engine's prefix-cache events

Sits below the engine: both the engine and every runner build on it. The engine core
process that carries the contract over a socket is core_process/, above the engine.
Never: imports torch, the engine or a runner.
"""
