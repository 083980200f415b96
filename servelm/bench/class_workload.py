"""Requests with SLO classes: the same workload for `servelm sim` and `servelm bench serve`.

Owns: `class_workload`, random-length requests (bench.workloads) each given a class by the
SLO mix (slo.assign_classes).
Never: judges goodput (slo.py does) or sends anything; bench/workloads.py stays loadable
without servelm, which is why this lives beside it rather than in it.
"""

from __future__ import annotations

from servelm.bench.workloads import random_lengths
from servelm.slo import assign_classes


def class_workload(num: int, mix: list[tuple[str, float]], lengths: dict[str, tuple[str, str]],
                   input_len: str, output_len: str, vocab_size: int, seed: int = 0):
    """`num` random-length requests (random_lengths), each with a class from the mix
    (slo.assign_classes); a class in `lengths` draws its own input/output lengths. Returns
    (requests, class names), in send order. The same flags give the same requests to
    `servelm sim` and `servelm bench serve`."""
    classes = assign_classes(num, mix, seed)
    pools = {}
    for i, (name, _) in enumerate(mix):
        count = classes.count(name)
        if count:
            inp, out = lengths.get(name, (input_len, output_len))
            pools[name] = iter(random_lengths(count, inp, out, vocab_size, seed + 7919 * i))
    return [next(pools[c]) for c in classes], classes
