"""Benchmarks: seeded workloads, the offline harness, peer systems side by side, plots.

Owns: measuring. Never: changes engine behaviour to look faster.
"""
