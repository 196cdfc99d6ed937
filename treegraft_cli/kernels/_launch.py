"""Launch-size helpers shared by the kernel modules."""

from __future__ import annotations

import triton

from . import interpreting

# Elements one program holds per tile. Small vocabularies pack many rows into a tile, which on GPU fills
# the warps. The interpreter runs programs one after another and pays per operation, not per element, so
# it gets much bigger tiles.
TILE_ELEMENTS = 65536 if interpreting() else 4096


def vocab_tiling(rows: int, vocab: int) -> tuple[int, int]:
    """(rows per program, vocab block) for the per-row vocabulary kernels."""
    block_v = min(triton.next_power_of_2(vocab), TILE_ELEMENTS)
    rows_per_program = max(1, min(triton.next_power_of_2(rows), TILE_ELEMENTS // block_v))
    return rows_per_program, block_v


def sequences_per_program(batch: int, block_n: int) -> int:
    """One sequence per program on GPU (the issue's layout); batched under the interpreter."""
    if not interpreting():
        return 1
    return max(1, min(triton.next_power_of_2(batch), TILE_ELEMENTS // block_n))
