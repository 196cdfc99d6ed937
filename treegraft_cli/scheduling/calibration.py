"""Measured acceptance: what a node's score is worth, read off the verified trees.

A node's *local probability* is exp(s(node) − s(parent)), capped at 1: its drafter's belief that it
follows its parent (for an n-gram node, the target's log-prob where the n-gram matched). Read as the
chance that the target accepts the node once its parent is accepted, it is off in both directions: a
well-aligned small drafter's top child is right more often than its probability says, and a match's past
log-prob overstates how often the text repeats. ``AcceptanceCalibration`` counts, per origin and per bin
of local probability, how many nodes whose parent was accepted were accepted themselves (judged against the
committed tokens, so nodes a trim kept out of verification count too), and maps a local probability to that
measured rate. A prior of ``prior_weight`` pseudo-observations at the
bin's own centre makes an unseen bin read as the score says.

A node's *reach* is the product of the measured rates along its root path: the calibrated probability
that verification accepts it. The expected accepted length of a tree is 1 + Σ reach.

The step rule reads these at every step, on trees of a few dozen nodes: the counts are Python lists and
every per-node pass is a loop over host lists (parents come before their children), which costs less than
the dozen small tensor ops per pass it replaces. ``reach`` wraps ``reach_list`` in a tensor.
"""

from __future__ import annotations

import math

import torch

from ..hostlists import floats
from ..syncs import fetch, host_only
from ..tree import ORIGIN_NAMES, DraftTree, float32


def host_columns(tree: DraftTree, *names: str) -> list[list]:
    """Columns of ``tree`` as host lists, in the order named: a host tree's kept structure lists (``listed``) and
    fresh reads of its scores and origins (they change without new nodes); one counted read for a device tree."""
    if tree.host:
        return [tree.host_list(name) if name in ("scores", "origins") else tree.listed(name) for name in names]
    copies = fetch(*(getattr(tree, name) for name in names))
    with host_only():
        return [copy.tolist() for copy in copies]


class AcceptanceCalibration:
    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.bins = bins
        centres = [(b + 0.5) / bins for b in range(bins)]
        self.seen = [[prior_weight] * bins for _ in ORIGIN_NAMES]  # [origins][bins]
        self.accepted = [[c * prior_weight for c in centres] for _ in ORIGIN_NAMES]  # [origins][bins]

    def observe(self, tree: DraftTree, committed: torch.Tensor) -> None:  # committed: [τ] the step's new tokens
        """Count every node of ``tree`` whose parent lies on the committed path, and whether it does itself.

        ``tree`` is the step's tree before any trim, ``committed`` the tokens the step committed (the accepted
        nodes' and the bonus): the node at depth d on the committed path holds ``committed[d − 1]``. A node whose
        parent is on that path and whose depth is at most τ is accepted by greedy verification iff it holds the
        committed token at its depth, whether or not it was verified: counting the nodes a trim left out too
        keeps the rates of low bins measured (counting verified nodes only, a bin the trim always drops would
        keep its prior for good).
        """
        parents, scores, origins, tokens, depths = host_columns(tree, "parents", "scores", "origins", "tokens", "depths")
        with host_only():
            path = committed.tolist()
        local = local_probabilities(parents, scores)
        on_path = committed_path(parents, tokens, depths, path)
        for node in range(1, len(parents)):
            if on_path[parents[node]] and depths[node] <= len(path):
                origin, column = origins[node], self._bin(local[node])
                self.seen[origin][column] += 1.0
                self.accepted[origin][column] += on_path[node]

    def node_rate(self, origin: int, local: float) -> float:
        """Measured P(accepted | parent accepted) of a node of ``origin`` with local probability ``local`` (float32)."""
        cell = self._bin(local)
        return float32(self.accepted[origin][cell] / self.seen[origin][cell])

    def reach_list(self, tree: DraftTree) -> list[float]:  # [num_nodes], 1 at the root
        """Calibrated probability that verification accepts each node (the product of rates to the root)."""
        parents, scores, origins = host_columns(tree, "parents", "scores", "origins")
        local = local_probabilities(parents, scores)
        reach = [1.0] * len(parents)
        for node in range(1, len(parents)):  # parents first: the product runs down every path at once
            reach[node] = reach[parents[node]] * self.node_rate(origins[node], local[node])
        return [float32(r) for r in reach]

    def reach(self, tree: DraftTree) -> torch.Tensor:  # -> [num_nodes] float32, 1 at the root
        return floats(self.reach_list(tree))

    def _bin(self, local: float) -> int:
        if local != local:  # NaN (a -inf score under a -inf parent): the lowest bin
            return 0
        return min(max(int(local * self.bins), 0), self.bins - 1)


def committed_path(
    parents: list[int],  # [num_nodes] parents first
    tokens: list[int],  # [num_nodes]
    depths: list[int],  # [num_nodes]
    committed: list[int],  # [τ] the tokens a step committed
) -> list[bool]:  # [num_nodes], True at the root
    """Which nodes lie on the committed path: their parent does and they hold the committed token at their depth.
    Greedy verification accepts exactly these (the one at depth τ is the bonus's), verified or not; a node whose
    parent lies on the path and whose depth is at most τ is judged by it either way."""
    on_path = [True] + [False] * (len(parents) - 1)
    for node in range(1, len(parents)):
        depth = depths[node]
        on_path[node] = on_path[parents[node]] and depth <= len(committed) and tokens[node] == committed[depth - 1]
    return on_path


def local_probabilities(parents: list[int], scores: list[float]) -> list[float]:  # [num_nodes], 1 at the root
    """Each node's exp(capped score − parent's capped score) in float32, capped scores being each score capped
    by its ancestors' (unscored chain tokens and merges can break the order): a running minimum down each path."""
    capped = list(scores)
    local = [1.0] * len(scores)
    for node in range(1, len(scores)):
        capped[node] = min(capped[parents[node]], scores[node])
        gap = float32(capped[node] - capped[parents[node]])
        local[node] = min(float32(math.exp(gap)), 1.0) if gap == gap else gap
    return local
