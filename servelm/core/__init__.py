"""The engine core: the step contract, its codec, and the core process behind a front end.

    contract.py  StepDescription / StepResult / StepReport and the Runner protocol (torch-free)
    codec.py     the one wire format (typed msgpack via msgspec, versioned; never pickle)
    process.py   the engine core process: scheduler + runner behind a local socket
    client.py    the front end's side: an AsyncEngine-shaped client of a core process
"""
