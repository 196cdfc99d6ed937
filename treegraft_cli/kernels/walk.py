"""Acceptance walk: the target's choice at every node → accepted path, accepted length, bonus token.

A node is accepted iff every edge on its root path is *matched* (the child's token equals the target's
choice at the parent). Each node climbs to the root checking its edges (gathers over a [sequences,
nodes] tile); the deepest accepted node is unique because siblings are distinct, and the path is
written by climbing back from it. Same result as ``verify.accept``, without the [nodes, nodes] mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..lm import on_device
from ..verify import Verdict
from ._launch import sequences_per_program


@triton.jit
def _any(x):
    return tl.max(tl.max(x.to(tl.int32), axis=1), axis=0) > 0


@triton.jit
def _accept_kernel(
    tokens_ptr,  # [batch, n] int64
    parents_ptr,  # [batch, n] int64
    choices_ptr,  # [batch, n] int64: the target's token after each node
    path_ptr,  # [batch, n] int64 out
    num_accepted_ptr,  # [batch] int64 out
    bonus_ptr,  # [batch] int64 out
    batch,
    n,
    SEQS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seqs = tl.program_id(0) * SEQS + tl.arange(0, SEQS)
    nodes = tl.arange(0, BLOCK_N)
    seq_ok = seqs < batch
    row = seqs.to(tl.int64)[:, None] * n  # [SEQS, 1] offset of each sequence's row
    valid = seq_ok[:, None] & (nodes[None, :] < n)

    # climb from every node, checking each edge; node 0 is the root and is always accepted
    cur = tl.where(valid, nodes[None, :], 0).to(tl.int64)
    accepted = valid
    depth = tl.zeros([SEQS, BLOCK_N], dtype=tl.int64)
    live = valid & (cur > 0)
    while _any(live):
        parent = tl.load(parents_ptr + row + cur, mask=live, other=0)
        token = tl.load(tokens_ptr + row + cur, mask=live, other=0)
        choice = tl.load(choices_ptr + row + tl.maximum(parent, 0), mask=live, other=0)
        accepted = accepted & (~live | (token == choice))
        depth += live.to(tl.int64)
        cur = tl.where(live, parent, cur)
        live = live & (cur > 0)

    score = tl.where(accepted, depth, -1)
    deepest = tl.argmax(score, axis=1)  # [SEQS]; the accepted set is a chain, so this is unique
    num_accepted = tl.max(score, axis=1)
    tl.store(num_accepted_ptr + seqs, num_accepted, mask=seq_ok)
    bonus = tl.load(choices_ptr + seqs.to(tl.int64) * n + deepest, mask=seq_ok, other=0)
    tl.store(bonus_ptr + seqs, bonus, mask=seq_ok)

    # path: -1 past the accepted length, then node ids climbing back from the deepest node
    # (the two stores touch disjoint slots, so no barrier is needed between them)
    beyond = valid & (nodes[None, :] > num_accepted[:, None])
    tl.store(path_ptr + row + nodes[None, :], tl.full([SEQS, BLOCK_N], -1, tl.int64), mask=beyond)
    slot = num_accepted
    node = deepest.to(tl.int64)
    flat = seqs.to(tl.int64) * n
    while tl.max(tl.where(seq_ok, slot, -1), axis=0) >= 0:
        writing = seq_ok & (slot >= 0)
        tl.store(path_ptr + flat + slot, node, mask=writing)
        node = tl.load(parents_ptr + flat + node, mask=writing & (slot > 0), other=0)
        slot -= 1


def accept(
    tokens: torch.Tensor,  # [batch, nodes]
    parents: torch.Tensor,  # [batch, nodes]
    choices: torch.Tensor,  # [batch, nodes] the target's token after each node
) -> Verdict:
    """Walk the tree along the target's choices (see the module docstring)."""
    batch, n = tokens.shape
    device = tokens.device
    path = torch.empty(batch, n, dtype=torch.long, device=device)
    num_accepted = torch.empty(batch, dtype=torch.long, device=device)
    bonus = torch.empty(batch, dtype=torch.long, device=device)
    block_n = triton.next_power_of_2(n)
    seqs = sequences_per_program(batch, block_n)
    with on_device(device):
        _accept_kernel[(triton.cdiv(batch, seqs),)](
            tokens.contiguous().long(),
            parents.contiguous().long(),
            choices.contiguous().long(),
            path,
            num_accepted,
            bonus,
            batch,
            n,
            SEQS=seqs,
            BLOCK_N=block_n,
        )
    return Verdict(path=path, num_accepted=num_accepted, bonus=bonus)
