"""Structured outputs: the output follows a JSON schema, a regex, a choice list or a grammar.

A `StructuredOutput` (servelm.protocol) is compiled once per (kind, spec) by `GrammarCompiler`
(llguidance; see docs/structured_outputs.md for why that library) and enforced by
`GrammarMasks`, which keeps one matcher per sequence on the runner side and computes each
step's allowed-token masks while the model runs.
"""

from servelm.structured.grammar_compiler import GrammarCompiler, compiler_for
from servelm.structured.grammar_masks import GrammarMasks

__all__ = ["GrammarCompiler", "GrammarMasks", "compiler_for"]
