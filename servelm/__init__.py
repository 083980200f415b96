"""servelm: an LLM inference serving system (paged KV cache, continuous batching, OpenAI API)."""

import os

# torch's CPU kernels run in OpenMP (libgomp) thread teams. By default a waiting thread spins
# for a long time; when another process holds a core, a team of 2 then stalls at every
# barrier. Measured on the 2-core CI machine (32 requests x 32 tokens): quiet, 115 -> 121
# tok/s; beside one busy process, 31 -> 70 tok/s. Set before torch loads; the user's own
# setting wins.
OWN_ENV = {} if "GOMP_SPINCOUNT" in os.environ else {"GOMP_SPINCOUNT": "1000"}
os.environ.update(OWN_ENV)

from servelm.protocol import InvalidParameterError, RequestOutput, SamplingParams  # noqa: E402

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "InvalidParameterError", "__version__"]


def __getattr__(name):
    # LLM pulls in torch; keep `import servelm` light for the planner and the bench client.
    if name == "LLM":
        from servelm.llm import LLM

        return LLM
    raise AttributeError(name)
