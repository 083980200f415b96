"""Regenerates servelm_arith_{train,test}.jsonl (committed; run once, kept for the record).

Two-digit addition and subtraction (non-negative results) and one-digit multiplication, in
the question style of lm-eval's `arithmetic` tasks, drawn from a fixed seed.
"""

import json
import random


def items(rng: random.Random, num_add: int, num_sub: int, num_mul: int) -> list[dict]:
    out = []
    for _ in range(num_add):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append({"question": f"What is {a} plus {b}?", "answer": str(a + b), "op": "add"})
    for _ in range(num_sub):
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        out.append({"question": f"What is {a} minus {b}?", "answer": str(a - b), "op": "sub"})
    for _ in range(num_mul):
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        out.append({"question": f"What is {a} times {b}?", "answer": str(a * b), "op": "mul"})
    return out


if __name__ == "__main__":
    rng = random.Random(20261130)
    splits = {"train": items(rng, 2, 2, 2), "test": items(rng, 40, 30, 30)}
    for name, rows in splits.items():
        with open(f"servelm_arith_{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
