"""Attention backends, registered by name and imported only when chosen.

A backend owns the attention computation over the paged KV cache and the per-step metadata
it needs; models call `backend.forward(layer, q, k, v, batch)` and know nothing else.
"""

from __future__ import annotations

import importlib

_BACKENDS = {
    "torch": "servelm.attention.torch_backend:TorchAttentionBackend",
    "triton": "servelm.attention.triton_backend:TritonAttentionBackend",  # imports triton
}


def get_backend_class(name: str):
    try:
        target = _BACKENDS[name]
    except KeyError:
        raise ValueError(f"attention_backend {name!r} is unknown; choose from "
                         f"{sorted(_BACKENDS)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)
