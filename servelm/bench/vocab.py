"""The vocabulary a synthetic workload draws its prompt token ids from: the served model's.

Owns: `workload_vocab_size`, what every benchmark command that draws token ids (`bench
offline`, `bench serve`, `bench multiturn`) uses for them: --vocab-size when given, else the
model's own (its ModelConfig, `servelm.loader.model_vocab_size`), so that a workload fits a
model of any vocabulary.
Never: assumes the default model's vocabulary; a model whose config it cannot read is an
error that names the flag to pass instead.
"""

from __future__ import annotations

from servelm.bench.workloads import RangeError, check_vocab_size


def workload_vocab_size(model: str, given: int | None, flag: str = "--vocab-size") -> int:
    """`given` (checked) if not None, else the vocabulary size of `model` (a registry name,
    .gguf file or HF directory). Raises RangeError naming `flag`."""
    if given is not None:
        check_vocab_size(given, flag)
        return given
    try:
        from servelm.loader import model_vocab_size
    except ImportError as e:  # a peer-only environment without the engine's dependencies
        raise RangeError(f"cannot read {model!r}'s vocabulary here ({e}); pass {flag} N",
                         flag) from None
    try:
        vocab_size = model_vocab_size(model)
    except (ValueError, OSError) as e:  # ModelNotFoundError, an unreadable config
        raise RangeError(f"cannot read the vocabulary of {model!r} (the token ids are drawn "
                         f"below it): {e} Or pass {flag} N.", flag) from None
    check_vocab_size(vocab_size, flag)
    return vocab_size
