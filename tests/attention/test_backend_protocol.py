"""Both attention backends implement every member of the AttentionBackend protocol that
models, runner and the CUDA-graph runner use; only the Triton backend is a
GraphAttentionBackend (decode metadata over a graph's static buffers)."""

from __future__ import annotations

import pytest
import torch

from servelm.attention import AttentionBackend, GraphAttentionBackend


def _members(protocol) -> set[str]:
    return {n for c in protocol.__mro__ if c not in (object,) and c.__name__ != "Protocol"
            and c.__name__ != "Generic"
            for n in [*vars(c), *getattr(c, "__annotations__", {})]
            if not n.startswith("_")}


@pytest.fixture(scope="module")
def backends():
    from servelm.attention.triton_backend import TritonAttentionBackend
    from tiny_models import make_tiny_engine, make_tiny_hf_model

    runner = make_tiny_engine(make_tiny_hf_model("llama")).runner
    torch_backend = runner.backend
    triton_backend = TritonAttentionBackend(runner.kv_cache, torch_backend.num_heads,
                                            torch_backend.scale)
    return torch_backend, triton_backend


def test_the_protocol_declares_what_its_callers_use():
    assert {"name", "kv_cache", "scale", "supports_variants", "supports_cuda_graphs",
            "decode_kernel", "deterministic", "set_deterministic", "build_metadata", "forward",
            "forward_mla"} <= _members(AttentionBackend)
    assert {"num_kv_splits", "decode_metadata"} <= _members(GraphAttentionBackend)


def test_both_backends_implement_every_member(backends):
    for backend in backends:
        assert isinstance(backend, AttentionBackend)
        missing = [m for m in _members(AttentionBackend) if not hasattr(backend, m)]
        assert not missing, f"{backend.name}: {missing}"
    torch_backend, triton_backend = backends
    assert isinstance(triton_backend, GraphAttentionBackend) and \
        triton_backend.supports_cuda_graphs
    assert not isinstance(torch_backend, GraphAttentionBackend)
    assert not torch_backend.supports_cuda_graphs
    # the variants: the torch backend's forward takes them, the Triton one refuses by name
    assert torch_backend.supports_variants and not triton_backend.supports_variants
    q = torch.zeros(1, 4, 16)
    with pytest.raises(ValueError, match="sliding_window"):
        triton_backend.forward(0, q, q[:, :2], q[:, :2], None, window=8)
