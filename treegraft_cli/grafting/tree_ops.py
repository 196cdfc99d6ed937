"""Vectorised tree operations of the TreeGraft layer loop: capped scores, grafting positions, final cut."""

from __future__ import annotations

import torch

from ..tree import DraftTree


def monotone_scores(tree: DraftTree) -> torch.Tensor:
    """[num_nodes] each score capped by its ancestors' (unscored chain tokens and merges can break the order):
    the minimum over the node's ancestor-mask row."""
    capped = torch.where(tree.ancestor_mask(), tree.scores[None, :], float("inf"))
    return capped.min(dim=1).values


def graft_window(tree: DraftTree, layer: int, lookback: int, max_depth: int, expanded: torch.Tensor) -> torch.Tensor:
    """[num_nodes] bool: nodes a strong call at ``layer`` may graft on.

    Depths ``max(0, layer − lookback) .. layer − 1`` (layer ℓ builds depth ℓ, so its parents sit at ℓ − 1
    and the lookback reaches shallower), not already expanded by the strong drafter, room for a child.
    """
    depths = tree.depths
    lowest, highest = max(0, layer - lookback), min(layer - 1, max_depth - 1)
    return (depths >= lowest) & (depths <= highest) & ~expanded


def cut_to_budget(tree: DraftTree, budget: int) -> DraftTree:
    """The ``budget`` best non-root nodes by (ancestor-capped) score, ancestors kept.

    Capped scores never exceed a parent's and a stable sort puts the lower-indexed parent first on ties,
    so the top set is already prefix-closed; closing over ancestors then checks it against the budget.
    """
    if tree.size <= budget:
        return tree
    if tree.host:
        return tree.select_nodes(_top_closed_on_host(tree, budget))
    scores = monotone_scores(tree)
    order = torch.sort(scores[1:], descending=True, stable=True).indices + 1
    keep = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
    keep.index_fill_(0, order[:budget], True)
    return tree.keep(tree.close_over_ancestors(keep, limit=budget))


def _top_closed_on_host(tree: DraftTree, budget: int) -> list[int]:
    """``cut_to_budget``'s kept nodes (ascending, root first) for a host tree, in Python: the same capped scores
    (a running minimum down each path is the minimum over the ancestor row), the same stable order."""
    parents, scores = tree.listed("parents"), tree.score_list()
    capped = list(scores)
    for i in range(1, len(capped)):  # parents first
        capped[i] = min(capped[parents[i]], scores[i])
    keep = set(sorted(range(1, len(capped)), key=capped.__getitem__, reverse=True)[:budget])
    for node in list(keep):  # close over ancestors (a no-op unless the order is broken)
        node = parents[node]
        while node > 0 and node not in keep:
            keep.add(node)
            node = parents[node]
    if len(keep) > budget:
        raise ValueError(f"closing over ancestors grew the tree past its budget {budget}")
    return [0, *sorted(keep)]
