"""Exact tree rejection sampling for deterministic drafts: one sampled choice per node row, then the walk.

Per row (a tile of rows per program), streaming the vocabulary in blocks:
1. max of ``logits / temperature``;
2. top-k: the k-th largest value, found by bisection on the float's order-preserving integer key
   (32 counting passes; no sort, so a 152k vocabulary stays in registers block by block);
3. top-p: the smallest kept value whose strictly-larger mass is below ``top_p``, by the same bisection
   over the kept mass (33 passes);
4. inverse CDF: the first token whose running mass exceeds ``u * total``.
Filters left off (``top_k == 0``, ``top_p == 1``) compile out. With the reference (``verify.sample_choices``)
this agrees token for token except when ``u * total`` or ``top_p`` lands within float rounding of a
cumulative-mass boundary, and, for top-p, on exactly tied logits at the cut (the reference keeps part of
a tie group in sort order, the kernel keeps all of it).
Why the acceptance is lossless is in ``verify.py``'s docstring; drafter scores never enter.
The Triton backend calls it only for plain temperature sampling: with a filter on, the reference's one sort is
faster on a GPU (``backends.TritonBackend.verify_sampling``).
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
def _key(x):
    """An int64 key per fp32 value with the same order (larger float ⇒ larger key)."""
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 == 0.0 as floats; give both one key
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _scaled_block(logits_ptr, base, cols, ok, temperature):
    """``logits / temperature`` in fp32 (-inf outside the row) and each value's key."""
    x = tl.load(logits_ptr + base + cols[None, :], mask=ok, other=float("-inf")).to(tl.float32) / temperature
    return x, _key(x)


@triton.jit
def _sample_kernel(
    logits_ptr,  # [rows, vocab] any float dtype, rows = batch * nodes
    uniforms_ptr,  # [rows] fp32 in [0, 1)
    choices_ptr,  # [rows] int64 out
    rows,
    vocab,
    temperature,
    top_k,
    top_p,
    TOP_K: tl.constexpr,
    TOP_P: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row < rows
    base = row.to(tl.int64)[:, None] * vocab

    peak = tl.full([ROWS], float("-inf"), tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x, key = _scaled_block(logits_ptr, base, cols, row_ok[:, None] & (cols[None, :] < vocab), temperature)
        peak = tl.maximum(peak, tl.max(x, axis=1))
    peak = tl.where(row_ok, peak, 0.0)  # padding rows: keep exp(x - peak) free of inf - inf
    peak_key = _key(peak)

    # keep key >= floor_key; with no top-k everything real is kept (INT32_MIN is below every key)
    floor_key = tl.full([ROWS], -2147483648, tl.int64)
    if TOP_K:
        # largest key with at least top_k values at or above it: the k-th largest value's key
        high = peak_key + 1
        for _ in range(32):
            mid = floor_key + (high - floor_key) // 2
            count = tl.zeros([ROWS], dtype=tl.int64)
            for v0 in range(0, vocab, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                ok = row_ok[:, None] & (cols[None, :] < vocab)
                x, key = _scaled_block(logits_ptr, base, cols, ok, temperature)
                count += tl.sum((ok & (key >= mid[:, None])).to(tl.int64), axis=1)
            enough = count >= top_k
            floor_key = tl.where(enough, mid, floor_key)
            high = tl.where(enough, high, mid)

    if TOP_P:
        total = tl.zeros([ROWS], dtype=tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V)
            x, key = _scaled_block(logits_ptr, base, cols, row_ok[:, None] & (cols[None, :] < vocab), temperature)
            total += tl.sum(tl.where(key >= floor_key[:, None], tl.exp(x - peak[:, None]), 0.0), axis=1)
        # smallest key whose strictly-larger kept mass is below top_p * total
        low = floor_key - 1
        high = peak_key
        for _ in range(33):
            mid = low + (high - low) // 2
            above = tl.zeros([ROWS], dtype=tl.float32)
            for v0 in range(0, vocab, BLOCK_V):
                cols = v0 + tl.arange(0, BLOCK_V)
                x, key = _scaled_block(logits_ptr, base, cols, row_ok[:, None] & (cols[None, :] < vocab), temperature)
                kept_above = (key >= floor_key[:, None]) & (key > mid[:, None])
                above += tl.sum(tl.where(kept_above, tl.exp(x - peak[:, None]), 0.0), axis=1)
            small = above < top_p * total
            high = tl.where(small, mid, high)
            low = tl.where(small, low, mid)
        floor_key = tl.maximum(floor_key, high)

    mass = tl.zeros([ROWS], dtype=tl.float32)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x, key = _scaled_block(logits_ptr, base, cols, row_ok[:, None] & (cols[None, :] < vocab), temperature)
        mass += tl.sum(tl.where(key >= floor_key[:, None], tl.exp(x - peak[:, None]), 0.0), axis=1)

    target = tl.load(uniforms_ptr + row, mask=row_ok, other=0.0) * mass
    running = tl.zeros([ROWS], dtype=tl.float32)
    first = tl.full([ROWS], 2147483647, tl.int64)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        x, key = _scaled_block(logits_ptr, base, cols, row_ok[:, None] & (cols[None, :] < vocab), temperature)
        weight = tl.where(key >= floor_key[:, None], tl.exp(x - peak[:, None]), 0.0)
        past = (running[:, None] + tl.cumsum(weight, axis=1)) > target[:, None]
        first = tl.minimum(first, tl.min(tl.where(past, cols[None, :].to(tl.int64), 2147483647), axis=1))
        running += tl.sum(weight, axis=1)
    # rounding can leave u * total above the last cumulative value; the reference then clamps too
    choice = tl.minimum(first, vocab - 1)
    tl.store(choices_ptr + row, choice, mask=row_ok)


def sample_choices(
    logits: torch.Tensor,  # [batch, nodes, vocab]
    uniforms: torch.Tensor,  # [batch, nodes] in [0, 1)
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:  # [batch, nodes]
    """The sampled choice at every node: inverse CDF of the processed target distribution at ``u``."""
    batch, n, vocab = logits.shape
    rows = batch * n
    choices = torch.empty(batch, n, dtype=torch.long, device=logits.device)
    rows_per_program, block_v = vocab_tiling(rows, vocab)
    with on_device(logits.device):
        _sample_kernel[(triton.cdiv(rows, rows_per_program),)](
            logits.contiguous(),
            uniforms.contiguous().float(),
            choices,
            rows,
            vocab,
            float(temperature),
            int(top_k),
            float(top_p),
            TOP_K=0 < top_k < vocab,
            TOP_P=top_p < 1.0,
            ROWS=rows_per_program,
            BLOCK_V=block_v,
        )
    return choices


def verify_sampling(
    logits: torch.Tensor,  # [batch, nodes, vocab]
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    uniforms: torch.Tensor,  # [batch, nodes] one uniform in [0, 1) per node
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Verdict:
    """Exact tree rejection sampling for deterministic drafts (see ``verify.py``)."""
    return accept(tokens, parents, sample_choices(logits, uniforms, temperature, top_k, top_p))
