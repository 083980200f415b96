"""The engine core process and the front end's client of it.

    process.py  the engine core process: scheduler + runner behind a local socket
    client.py   the front end's side: an AsyncEngine-shaped client of a core process

Owns: running an engine in a process of its own. It sits above the engine and its assembly
(the process builds the engine it hosts) and below the server (which talks to the client);
the step contract and the wire format both sides speak stay below the engine in core/.
Never: imports torch in the client, or defines a message of its own (core/codec.py does).
"""
