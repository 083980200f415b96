"""The engine core process, the front end's client of it, and a model-parallel rank's process.

    process.py  the engine core process: scheduler + runner behind a local socket
    client.py   the front end's side: an AsyncEngine-shaped client of a core process
    worker.py   a model-parallel rank's process (`python -m servelm.core_process.worker`)

Owns: running an engine (or a rank's shard of one) in a process of its own. It sits above
the engine and its assembly (the process builds the engine it hosts) and below the server
(which talks to the client); the step contract and the wire format both sides speak stay
below the engine in core/.
Never: imports torch in the client, or defines a message of its own (core/codec.py does).
"""
