"""Helpers shared by the bfloat16 linear tests (AMX tiles, avx512_bf16 dot products): a tiny
model with a tied head, an engine built with its start-up log's kernel paths, and the check
that a layer takes strided rows and 3-d input."""

import logging

import torch
from torch import nn


class TiedTiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(50, 32).bfloat16()
        self.proj = nn.Linear(32, 64).bfloat16()
        self.lm_head = None  # tied to the embedding


def bf16_engine(tiny_hf, tiny_engine, caplog, option):
    """(HF llama, its bfloat16 engine built with --cpu-kernels `option`, the start-up log's
    "cpu kernels ..." line)."""
    hf = tiny_hf("llama")
    with caplog.at_level(logging.INFO, logger="servelm.engine_builder"):
        engine = tiny_engine(hf, dtype="bfloat16", cpu_kernels=option)
    paths = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cpu kernels")]
    caplog.clear()
    return hf, engine, paths[0]


def check_strided_rows_and_3d_input(layer_cls):
    w = torch.randn(64, 96).bfloat16()
    layer = layer_cls(w, None)
    big = torch.randn(3, 7, 200).bfloat16()
    x = big[..., 10:106]  # rows 200 apart
    want = (x.float() @ w.float().t()).bfloat16()
    got = layer(x)
    assert got.shape == (3, 7, 64)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all()
