"""Prefill/decode disaggregation (docs/disaggregation.md).

Owns: the roles a worker's engine takes (`roles.py`: PrefillRole, DecodeRole), the transfer
state machine with its leases and counters (`transfer.py`), the messages of a transfer
(`messages.py`) and the KV transports by name (`transport.py`: tcp, shm, inproc).
Never: trusts a peer (every frame is checked), imports torch, or touches KV memory except
through the engine's step contract (kv_saves / kv_loads).
"""
