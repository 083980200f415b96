"""servelm: an LLM inference serving system (paged KV cache, continuous batching, OpenAI API)."""

import time as _time

IMPORTS_STARTED = _time.time()  # servelm/startup.py: where a process's `imports` stage begins

# Importing servelm writes nothing to the environment: the `servelm` command applies its
# environment defaults (servelm/own_env.py) when it starts.
from servelm.protocol import InvalidParameterError, RequestOutput, SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "InvalidParameterError", "__version__"]


def __getattr__(name):
    # LLM pulls in torch; keep `import servelm` light for the planner and the bench client.
    if name == "LLM":
        from servelm.llm import LLM

        return LLM
    raise AttributeError(name)
