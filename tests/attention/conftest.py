"""Attention-backend tests run the Triton backend interpreted on the CPU when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported, hence here.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
