"""Graft candidates: a rank template grown from a tree's root through the adjacency table, resolved against the
tree's nodes, in one program; and the kept ones laid out as the nodes the graft appends, in another.

The reference (``drafters.adjacency.graft_candidates``) runs a handful of gathers, compares and scatters per
depth; on a GPU each is a launch, and their host time outweighs the work (about a millisecond a step at 16
nodes on an H200). Here one program holds every candidate and every tree node in registers and walks the
depths: a candidate reads its parent's token, node and score through a one-hot match over the candidates (or
the tree's nodes, for a merged parent), looks up its token in the table, and merges into the existing child
with that token. Scores are the same float32 sums as the reference's, so the outputs are equal exactly.
Once the count of kept candidates is read, ``appended_nodes`` places each kept one at its rank by (depth,
priority) and writes its parent's index in the grown tree and the ancestry among the new nodes, where the
reference (``drafters.adjacency.appended_nodes``) sorts and gathers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..drafters.rank_template import RankTemplate
from ..lm import on_device


@triton.jit
def _graft_candidates_kernel(
    successors_ptr,  # [vocab + 2, k] int64
    tree_tokens_ptr,  # [n] int64
    tree_parents_ptr,  # [n] int64, -1 for the root
    tree_scores_ptr,  # [n] float32
    parent_slots_ptr,  # [S] int64: 0 the root, c + 1 candidate c
    ranks_ptr,  # [S] int64
    priors_ptr,  # [S] float32
    depths_ptr,  # [S] int64, 1 for the root's children
    tokens_ptr,  # [S + 1] int64 out, slot 0 the root
    node_ptr,  # [S + 1] int64 out
    scores_ptr,  # [n + S] float32 out
    kept_ptr,  # [S] bool out
    count_ptr,  # [] float32 out
    n,
    size,
    k,
    sentinel,  # the sentinel token (vocab + 1): its row holds sentinels
    levels,  # the template's deepest depth
    tree_depth,  # no node of the tree is deeper: candidates below it cannot merge
    slots,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    candidates = tl.arange(0, BLOCK_S)
    in_template = candidates < size
    nodes = tl.arange(0, BLOCK_N)
    in_tree = nodes < n
    # tokens and node indices fit 32 bits: the [S, S] and [S, N] selections hold half the registers of 64-bit ones
    existing_tokens = tl.load(tree_tokens_ptr + nodes, mask=in_tree, other=-1).to(tl.int32)
    existing_parents = tl.load(tree_parents_ptr + nodes, mask=in_tree, other=-2).to(tl.int32)
    existing_scores = tl.load(tree_scores_ptr + nodes, mask=in_tree, other=float("-inf"))
    root_token = tl.load(tree_tokens_ptr).to(tl.int32)
    parent_candidate = tl.load(parent_slots_ptr + candidates, mask=in_template, other=0).to(tl.int32) - 1  # -1: the root
    ranks = tl.load(ranks_ptr + candidates, mask=in_template, other=0)
    priors = tl.load(priors_ptr + candidates, mask=in_template, other=0.0)
    depths = tl.load(depths_ptr + candidates, mask=in_template, other=0).to(tl.int32)
    fresh = candidates + n
    token = tl.zeros([BLOCK_S], dtype=tl.int32)
    node = fresh
    score = tl.zeros([BLOCK_S], dtype=tl.float32)
    # [S, S]: candidate c's parent is candidate c'. Selections below take a max over one match, never a sum, so
    # every value is copied exactly
    parent_is = parent_candidate[:, None] == candidates[None, :]
    from_root = parent_candidate < 0
    for depth in range(1, levels + 1):
        here = (depths == depth) & in_template
        parent_token = tl.where(from_root, root_token, tl.max(tl.where(parent_is, token[None, :], -1), axis=1))
        parent_node = tl.where(from_root, 0, tl.max(tl.where(parent_is, node[None, :], -1), axis=1))
        # a parent's score is its node's: an existing node's (raised by the merges above) or a new candidate's own
        node_is = parent_node[:, None] == nodes[None, :]  # [S, N]
        existing_score = tl.max(tl.where(node_is, existing_scores[None, :], float("-inf")), axis=1)
        new_score = tl.max(tl.where(parent_is, score[None, :], float("-inf")), axis=1)
        parent_score = tl.where(parent_node < n, existing_score, new_score)
        found = tl.load(successors_ptr + parent_token.to(tl.int64) * k + ranks, mask=here, other=sentinel).to(tl.int32)
        this_score = parent_score + priors
        # the existing child of the parent's node with this token, the lowest when several; sentinels match nothing
        same = (found[:, None] == existing_tokens[None, :]) & (parent_node[:, None] == existing_parents[None, :])
        same = same & in_tree[None, :] & (depth <= tree_depth)
        match = tl.min(tl.where(same, nodes[None, :], BLOCK_N), axis=1)
        merged = here & (match < BLOCK_N)
        this_node = tl.where(merged, match, fresh)
        raised = (this_node[:, None] == nodes[None, :]) & merged[:, None]  # [S, N]
        existing_scores = tl.maximum(existing_scores, tl.max(tl.where(raised, this_score[:, None], float("-inf")), axis=0))
        token = tl.where(here, found, token)
        node = tl.where(here, this_node, node)
        score = tl.where(here, this_score, score)
    is_new = in_template & (token != sentinel) & (node >= n)
    kept = is_new & (tl.cumsum(is_new.to(tl.int32), axis=0) <= slots)
    tl.store(tokens_ptr, root_token.to(tl.int64))
    tl.store(node_ptr, tl.zeros([], dtype=tl.int64))
    tl.store(tokens_ptr + 1 + candidates, token.to(tl.int64), mask=in_template)
    tl.store(node_ptr + 1 + candidates, node.to(tl.int64), mask=in_template)
    tl.store(scores_ptr + nodes, existing_scores, mask=in_tree)
    tl.store(scores_ptr + n + candidates, score, mask=in_template)
    tl.store(kept_ptr + candidates, kept, mask=in_template)
    tl.store(count_ptr, tl.sum(kept.to(tl.float32), axis=0))


def graft_candidates(
    successors: torch.Tensor,  # [vocab + 2, k]
    tree_tokens: torch.Tensor,  # [n]
    tree_parents: torch.Tensor,  # [n] -1 for the root
    tree_scores: torch.Tensor,  # [n] float32
    template: RankTemplate,
    slots: int,
    tree_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``drafters.adjacency.graft_candidates`` in one launch: ``(tokens [S + 1], node [S + 1], scores [n + S],
    kept [S], count [])``."""
    n, size, device = tree_tokens.shape[0], template.size, tree_tokens.device
    tokens = torch.empty(size + 1, dtype=torch.long, device=device)
    node = torch.empty(size + 1, dtype=torch.long, device=device)
    scores = torch.empty(n + size, dtype=torch.float32, device=device)
    kept = torch.empty(size, dtype=torch.bool, device=device)
    count = torch.empty((), dtype=torch.float32, device=device)
    columns = template.kernel_columns(device)
    block_s, block_n = triton.next_power_of_2(size), triton.next_power_of_2(n)  # warps grow with the [S, S] tiles
    with on_device(device):  # the drafter's GPU, which need not be the current one
        _graft_candidates_kernel[(1,)](
            successors, tree_tokens, tree_parents, tree_scores, *columns, tokens, node, scores, kept, count,
            n, size, successors.shape[1], successors.shape[0] - 1, len(template.levels), tree_depth, slots,
            BLOCK_S=block_s, BLOCK_N=block_n, num_warps=max(4, min(16, block_s * max(block_s, block_n) // 1024)),
        )
    return tokens, node, scores, kept, count


@triton.jit
def _appended_nodes_kernel(
    tokens_ptr,  # [S + 1] int64, slot 0 the root
    node_ptr,  # [S + 1] int64
    scores_ptr,  # [n + S] float32
    kept_ptr,  # [S] bool
    parent_slots_ptr,  # [S] int64
    depths_ptr,  # [S] int64
    ancestry_ptr,  # [S, S] uint8
    parents_out_ptr,  # [count] int64 out
    tokens_out_ptr,  # [count] int64 out
    scores_out_ptr,  # [count] float32 out
    depths_out_ptr,  # [count] int64 out
    inside_ptr,  # [count, count] uint8 out
    n,
    size,
    count,
    BLOCK_S: tl.constexpr,
):
    candidates = tl.arange(0, BLOCK_S)
    in_template = candidates < size
    kept = tl.load(kept_ptr + candidates, mask=in_template, other=0) != 0
    depths = tl.load(depths_ptr + candidates, mask=in_template, other=0).to(tl.int32)
    # each kept candidate's place: the kept ones shallower, or as deep and earlier in priority order
    before = (depths[None, :] < depths[:, None]) | ((depths[None, :] == depths[:, None]) & (candidates[None, :] < candidates[:, None]))
    place = tl.sum((before & kept[None, :]).to(tl.int32), axis=1)
    parent_slot = tl.load(parent_slots_ptr + candidates, mask=in_template, other=0)
    parent_node = tl.load(node_ptr + parent_slot, mask=in_template, other=0)
    # a parent that is no existing node is a kept candidate (the one in the parent slot): its place, after the tree
    parent_is = (parent_slot[:, None] - 1) == candidates[None, :]
    parent_place = tl.max(tl.where(parent_is, place[None, :], -1), axis=1)
    parents = tl.where(parent_node < n, parent_node, n + parent_place.to(tl.int64))
    tl.store(parents_out_ptr + place, parents, mask=kept)
    tl.store(tokens_out_ptr + place, tl.load(tokens_ptr + 1 + candidates, mask=kept, other=0), mask=kept)
    tl.store(scores_out_ptr + place, tl.load(scores_ptr + n + candidates, mask=kept, other=0.0), mask=kept)
    tl.store(depths_out_ptr + place, depths.to(tl.int64), mask=kept)
    pair = kept[:, None] & kept[None, :]
    ancestry = tl.load(ancestry_ptr + candidates[:, None] * size + candidates[None, :], mask=pair, other=0)
    tl.store(inside_ptr + place[:, None] * count + place[None, :], ancestry, mask=pair)


def appended_nodes(
    tokens: torch.Tensor,  # [S + 1]
    node: torch.Tensor,  # [S + 1]
    scores: torch.Tensor,  # [n + S] float32
    kept: torch.Tensor,  # [S] bool
    template: RankTemplate,
    count: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``drafters.adjacency.appended_nodes`` in one launch: ``(parents, tokens, scores, depths)``, each
    ``[count]``, and ``inside [count, count]``."""
    size, device = template.size, tokens.device
    n = scores.shape[0] - size
    parents = torch.empty(count, dtype=torch.long, device=device)
    new_tokens = torch.empty(count, dtype=torch.long, device=device)
    new_scores = torch.empty(count, dtype=torch.float32, device=device)
    depths = torch.empty(count, dtype=torch.long, device=device)
    inside = torch.empty(count, count, dtype=torch.uint8, device=device)
    parent_slots, _, _, template_depths = template.kernel_columns(device)
    block_s = triton.next_power_of_2(size)
    with on_device(device):
        _appended_nodes_kernel[(1,)](
            tokens, node, scores, kept, parent_slots, template_depths, template.ancestry_on(device),
            parents, new_tokens, new_scores, depths, inside, n, size, count,
            BLOCK_S=block_s, num_warps=max(4, min(16, block_s * block_s // 1024)),
        )
    return parents, new_tokens, new_scores, depths, inside
