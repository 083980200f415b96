"""Output parsers of chat completions: reasoning (thinking in tags) and tool calls, each
chosen by name from a registry; text in, parts out (servelm/server/formatting.py uses them)."""

from servelm.parsers.reasoning_parsers import (
                                               REASONING_PARSERS,
                                               ReasoningParser,
                                               ReasoningStream,
                                               get_reasoning_parser,
)
from servelm.parsers.tool_parsers import (
                                               TOOL_PARSERS,
                                               ToolCall,
                                               ToolCallStream,
                                               ToolParser,
                                               get_tool_parser,
)

__all__ = [
                                               "REASONING_PARSERS",
                                               "TOOL_PARSERS",
                                               "ReasoningParser",
                                               "ReasoningStream",
                                               "ToolCall",
                                               "ToolCallStream",
                                               "ToolParser",
                                               "get_reasoning_parser",
                                               "get_tool_parser",
]
