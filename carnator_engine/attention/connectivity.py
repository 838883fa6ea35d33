"""Records a full generation's block-level attention connectivity for later sparse reuse.

Sparse-attention masks of video DiTs are stable across the later denoising steps and across
similar inputs, so one recording, taken once the layout has settled, serves every step a hit resumes.
Stored as plain boolean tensors (safetensors), one table per transformer block.
"""
from __future__ import annotations

import torch

from .sparse import (BlockSparseAttention, num_blocks, pooled_block_attention, select_connectivity,
                     token_blocks_from_mask)

BLOCK_SIZE_KEY = "block_size"


class ConnectivityRecorder:
    def __init__(self, record_step: int, block_size: int, mass: float, max_density: float = 1.0):
        self.record_step = record_step
        self.block_size = block_size
        self.mass = mass
        self.max_density = max_density
        self.connectivity: dict = {}

    def self_attention(self, step: int, block_index: int, q, k) -> None:
        # tables stay on the model's device until tensors(): a copy per block would stall the GPU queue.
        # The first step from record_step on that runs the block: a step cache (EasyCache) may skip that very one
        if step >= self.record_step and block_index not in self.connectivity:
            pooled = pooled_block_attention(q, k, self.block_size)
            self.connectivity[block_index] = select_connectivity(pooled, mass=self.mass, max_density=self.max_density,
                                                                 check_values=False)

    def tensors(self) -> dict:
        if not self.connectivity:
            return {}
        order = sorted(self.connectivity)
        on_host = torch.stack([self.connectivity[index] for index in order]).cpu()   # one copy, not one per block
        tables = {str(index): table.clone() for index, table in zip(order, on_host.unbind(0))}   # own storage each
        return {**tables, BLOCK_SIZE_KEY: torch.tensor(self.block_size)}


def plan_from_tensors(tensors: dict, target_tokens: torch.Tensor) -> BlockSparseAttention:
    """The cached tables as an attention plan, dense for every block touching the target tokens."""
    block_size = int(tensors[BLOCK_SIZE_KEY])
    tables = {int(name): table.bool() for name, table in tensors.items() if name != BLOCK_SIZE_KEY}
    plan = BlockSparseAttention(tables, block_size=block_size, seq_len=int(target_tokens.numel()))
    dense = token_blocks_from_mask(target_tokens, block_size)
    plan.set_dense_blocks(dense, dense)
    return plan


def reached_key_rows(tensors: dict, target_tokens: torch.Tensor) -> dict:
    """{transformer block: the video key rows [R] (sorted, on the CPU) a region step's target queries attend to}: the
    key blocks that any query block holding a target token reaches in the cached table, and the target's own blocks
    (its keys are recomputed at every region step); None where the table reaches every key block. A block whose table
    does not fit these tokens is left out. Either way its target attends to the whole clip, as without the tables."""
    block_size = int(tensors[BLOCK_SIZE_KEY])
    length = int(target_tokens.numel())
    blocks = num_blocks(length, block_size)
    query_blocks = token_blocks_from_mask(target_tokens.bool().flatten(), block_size)
    rows = {}
    for name, table in tensors.items():
        if name == BLOCK_SIZE_KEY or tuple(table.shape) != (blocks, blocks):
            continue
        reached = table.bool()[query_blocks].any(0) | query_blocks
        rows[int(name)] = None if bool(reached.all()) else \
            reached.repeat_interleave(block_size)[:length].nonzero().flatten()
    return rows
