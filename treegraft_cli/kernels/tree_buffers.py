"""Tree buffers: ancestor mask and depths from parent indices, one program per sequence.

Every row climbs from its node to the root through ``parents`` (gathers, vectorised over a block of
rows) and marks each node it passes. Unlike a row-from-parent sweep this needs no parents-before-
children order, matching the reference (``verify.tree_buffers``, pointer doubling) on any forest.
Position ids of the verification forward are ``prefix_length + depths``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lm import on_device

BLOCK_ROWS = 16  # rows climbed together; the mask tile is [BLOCK_ROWS, BLOCK_N]


@triton.jit
def _tree_buffers_kernel(
    parents_ptr,  # [batch, n] int64, -1 for the root
    mask_ptr,  # [batch, n, n] bool out
    depths_ptr,  # [batch, n] int64 out
    n,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    parents_row = parents_ptr + seq * n
    cols = tl.arange(0, BLOCK_N)
    for row0 in range(0, n, BLOCK_ROWS):
        rows = row0 + tl.arange(0, BLOCK_ROWS)
        valid = rows < n
        seen = (cols[None, :] == rows[:, None]) & valid[:, None]
        depth = tl.zeros([BLOCK_ROWS], dtype=tl.int64)
        cur = tl.load(parents_row + rows, mask=valid, other=-1)
        # a forest has depth < n: the step bound only guards against malformed (cyclic) input
        steps = 0
        climbing = (tl.max(cur, axis=0) >= 0) & (steps < n)
        while climbing:
            live = cur >= 0
            seen = seen | ((cols[None, :] == cur[:, None]) & live[:, None])
            depth += live.to(tl.int64)
            cur = tl.load(parents_row + cur, mask=live, other=-1)
            steps += 1
            climbing = (tl.max(cur, axis=0) >= 0) & (steps < n)
        offsets = seq * n * n + rows[:, None].to(tl.int64) * n + cols[None, :]
        tl.store(mask_ptr + offsets, seen, mask=valid[:, None] & (cols[None, :] < n))
        tl.store(depths_ptr + seq * n + rows, depth, mask=valid)


def tree_buffers(
    parents: torch.Tensor,  # [batch, nodes] int64, -1 for the root (node 0)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestor mask ``[batch, nodes, nodes]`` (bool, i sees j iff j is i or its ancestor) and depths ``[batch, nodes]``."""
    batch, n = parents.shape
    parents = parents.contiguous().long()
    mask = torch.empty(batch, n, n, dtype=torch.bool, device=parents.device)
    depths = torch.empty(batch, n, dtype=torch.long, device=parents.device)
    block_n = triton.next_power_of_2(n)
    with on_device(parents.device):
        _tree_buffers_kernel[(batch,)](parents, mask, depths, n, BLOCK_ROWS=min(BLOCK_ROWS, block_n), BLOCK_N=block_n)
    return mask, depths
