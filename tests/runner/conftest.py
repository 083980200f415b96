"""Runner tests that choose the triton backend run it interpreted on the CPU without a GPU.

TRITON_INTERPRET must be set before triton is first imported (transformers and torch may
import it), hence here, at collection.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
