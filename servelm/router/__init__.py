"""Routing requests across replicas: policies by name over what is known of each replica.

    policies.py  ReplicaLoad (a replica's load, however it was learnt) and the policies that
                 pick a replica for a request: round_robin, least_loaded

Shared by the fleet simulator (servelm/sim), which feeds them the simulated replicas' state.
Never: runs model code.
"""
