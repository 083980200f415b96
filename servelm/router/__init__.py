"""Routing requests across replicas: policies by name over what is known of each replica.

    policies.py  ReplicaLoad (a replica's load, however it was learnt), the registry of the
                 policies that pick a replica (or a disaggregation worker) for a request,
                 and the one default every command's policy option reads

Shared by the fleet simulator (servelm/sim), which feeds them the simulated replicas' state.
Never: runs model code.
"""
