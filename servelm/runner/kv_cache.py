"""KV cache tensors: one K and one V pool per layer, indexed by slot.

    k[layer]: [num_blocks * block_size, K, D]    slot = block * block_size + offset
"""

from __future__ import annotations

import torch

from servelm.config import ModelConfig


class KVCache:
    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (config.num_layers, num_blocks * block_size, config.num_kv_heads, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size
