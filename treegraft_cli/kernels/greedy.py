"""Fused greedy verification: argmax of the target logits at every node row, then the acceptance walk.

Two launches back to back on the same stream, no host round trip and no [batch, nodes, vocab]
intermediate: the argmax kernel streams each row's logits once (grid over rows, so a 152k vocabulary is
read by many SMs, not one per sequence), the walk kernel (``walk.py``) turns the choices into a Verdict.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lm import on_device
from ..verify import Verdict
from ._launch import vocab_tiling
from .walk import accept


@triton.jit
def _argmax_kernel(
    logits_ptr,  # [rows, vocab] any float dtype, rows = batch * nodes
    choices_ptr,  # [rows] int64 out
    rows,
    vocab,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    base = row.to(tl.int64)[:, None] * vocab
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_index = tl.zeros([ROWS], dtype=tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        ok = row_ok[:, None] & (cols[None, :] < vocab)
        x = tl.load(logits_ptr + base + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32)
        block_best = tl.max(x, axis=1)
        block_index = tl.argmax(x, axis=1, tie_break_left=True).to(tl.int64) + v0
        # strictly greater: an equal value in a later block loses, so the first maximum wins (as torch)
        better = block_best > best
        best = tl.where(better, block_best, best)
        best_index = tl.where(better, block_index, best_index)
    tl.store(choices_ptr + row, best_index, mask=row_ok)


def argmax_choices(
    logits: torch.Tensor,  # [batch, nodes, vocab]
) -> torch.Tensor:  # [batch, nodes]
    """The greedy choice at every node: the first index of the largest logit."""
    batch, n, vocab = logits.shape
    logits = logits.contiguous()
    choices = torch.empty(batch, n, dtype=torch.long, device=logits.device)
    rows_per_program, block_v = vocab_tiling(batch * n, vocab)
    grid = (triton.cdiv(batch * n, rows_per_program),)
    with on_device(logits.device):  # triton launches on the current GPU, which need not hold the logits
        _argmax_kernel[grid](logits, choices, batch * n, vocab, ROWS=rows_per_program, BLOCK_V=block_v)
    return choices


def verify_greedy(
    logits: torch.Tensor,  # [batch, nodes, vocab] target logits at every node
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
) -> Verdict:
    """Greedy acceptance: the target's choice at every node is its argmax."""
    return accept(tokens, parents, argmax_choices(logits))
