"""`servelm quantize MODEL --method METHOD --out DIR`: write a pre-quantized checkpoint.

Never: imports torch before the command runs (the CLI's --help stays fast).
"""

from __future__ import annotations

import sys


def add_parser(subparsers) -> None:
    from servelm.quant import quant_method_names

    p = subparsers.add_parser(
        "quantize", help="write a pre-quantized checkpoint (servelm serve DIR loads it)",
        description="Quantize MODEL's linear layers with METHOD and write DIR: safetensors "
                    "codes and scales, config.json with a quantization_config naming the "
                    "method, and the tokenizer (docs/quantization.md).")
    p.add_argument("model", help="cached model name, .gguf file, HF directory or Hugging Face "
                   "name ORG/NAME[:TAG][@REVISION]")
    p.add_argument("--method", required=True, choices=quant_method_names())
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    p.set_defaults(func=handler)


def handler(args) -> int:
    from servelm.quant_tools.quantize import quantize_checkpoint

    s = quantize_checkpoint(args.model, args.method, args.out, overwrite=args.overwrite)
    formats = ", ".join(f"{n} {k}" for k, n in sorted(s.formats.items()))
    print(f"[servelm] {args.model} -> {s.out_dir} ({s.method}: {formats} tensors; "
          f"{s.num_bytes / 2**20:.1f} MiB) in {s.seconds:.1f}s", file=sys.stderr)
    return 0
