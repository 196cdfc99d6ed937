"""KV commit: move the accepted path's cache rows to contiguous positions in every layer, one launch.

The launch gets a table of data pointers (int64; tensors that share shape, strides and dtype: a device's
``KVBlock`` buffer, whose batch is every layer's keys and values, or layers' keys and values one by one) and one
program per (tensor, batch·head) copies that head's rows. Rows are copied as raw bits (int8/16/32 words), so
any cache dtype works.

The copy is in place, and it is safe because ``keep_positions`` ascends with ``keep[j] >= start + j``:
the row written for j is never the source of a later j, and every source row of a chunk is read (then a
barrier) before any row of that chunk is written. Chunks run in order inside one program.

Layers that differ in shape (e.g. sliding-window caches) fall back to the per-layer torch reference,
``lm.gather_rows``. The pointer table works under ``TRITON_INTERPRET=1`` with CPU tensors (tested).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..lm import gather_rows as gather_rows_reference
from ..lm import on_device

WORDS = {1: tl.int8, 2: tl.int16, 4: tl.int32, 8: tl.int64}
BLOCK_ROWS = 16


@triton.jit
def _gather_rows_kernel(
    pointers_ptr,  # [tensors] int64 data pointers, each tensor [batch, heads, seq, head_dim]
    keep_ptr,  # [m] int64 ascending source rows
    m,
    start,
    heads,
    stride_b,
    stride_h,
    stride_s,
    head_dim,
    WORD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tensor = tl.program_id(0)
    bh = tl.program_id(1)
    base = tl.load(pointers_ptr + tensor).to(tl.pointer_type(WORD))
    base += (bh // heads).to(tl.int64) * stride_b + (bh % heads).to(tl.int64) * stride_h
    dims = tl.arange(0, BLOCK_D)
    for j0 in range(0, m, BLOCK_ROWS):
        j = j0 + tl.arange(0, BLOCK_ROWS)
        ok = (j < m)[:, None] & (dims < head_dim)[None, :]
        source = tl.load(keep_ptr + j, mask=j < m, other=0)
        rows = tl.load(base + source[:, None] * stride_s + dims[None, :], mask=ok)
        tl.debug_barrier()  # every source row of this chunk is read before any of its rows is written
        tl.store(base + (start + j).to(tl.int64)[:, None] * stride_s + dims[None, :], rows, mask=ok)


def _uniform(tensors: Sequence[torch.Tensor]) -> bool:
    first = tensors[0]
    return first.dim() == 4 and first.stride(-1) == 1 and first.element_size() in WORDS and all(
        t.shape == first.shape and t.stride() == first.stride() and t.dtype == first.dtype for t in tensors
    )


def gather_rows(
    tensors: Sequence[torch.Tensor],  # each [batch, heads, seq, head_dim]: keys and values of every layer
    keep_positions: torch.Tensor,  # [m] ascending cache rows to keep
    start: int,
) -> None:
    """In place: row ``keep_positions[j]`` moves to ``start + j`` in every tensor."""
    m = keep_positions.numel()
    if not tensors or m == 0:
        return
    if not _uniform(tensors):
        gather_rows_reference(tensors, keep_positions, start)
        return
    first = tensors[0]
    batch, heads, _, head_dim = first.shape
    # one int64 per tensor: a ``KVBlock`` buffer is one tensor for all of a device's layers (it moves when it grows).
    # Uploaded without blocking: a blocking upload from pageable memory waits for the stream (a synchronisation per
    # commit); a non-blocking one is staged before the call returns, so the host list may go
    pointers = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64).to(first.device, non_blocking=True)
    with on_device(first.device):
        _gather_rows_kernel[(len(tensors), batch * heads)](
            pointers,
            keep_positions.contiguous().long(),
            m,
            start,
            heads,
            first.stride(0),
            first.stride(1),
            first.stride(2),
            head_dim,
            WORD=WORDS[first.element_size()],
            BLOCK_ROWS=BLOCK_ROWS,
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
