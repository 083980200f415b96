"""Capacity planner: `servelm plan`, serving arithmetic that shows its work.

Owns: the model catalog (read into servelm.config.ModelConfig; costs from servelm.cost),
accelerator/link/tier catalogs, one pure
formula module per question (kv, weights, capacity, decode, prefill, speculative, disagg,
offload, coldstart, fleet, batch), rendering of the formula chain, and the CLI.
Never: imports torch or touches a GPU. Everything here is arithmetic over catalog numbers,
so it runs on a laptop before anyone buys hardware.
"""
