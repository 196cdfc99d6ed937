"""Measured acceptance: what a node's score is worth, read off the verified trees.

A node's *local probability* is exp(s(node) − s(parent)), capped at 1: its drafter's belief that it
follows its parent (for an n-gram node, the target's log-prob where the n-gram matched). Read as the
chance that the target accepts the node once its parent is accepted, it is off in both directions: a
well-aligned small drafter's top child is right more often than its probability says, and a match's past
log-prob overstates how often the text repeats. ``AcceptanceCalibration`` counts, per origin and per bin
of local probability, how many verified nodes whose parent was accepted were accepted themselves, and
maps a local probability to that measured rate. A prior of ``prior_weight`` pseudo-observations at the
bin's own centre makes an unseen bin read as the score says.

A node's *reach* is the product of the measured rates along its root path: the calibrated probability
that verification accepts it. The expected accepted length of a tree is 1 + Σ reach.
"""

from __future__ import annotations

import torch

from ..grafting.tree_ops import monotone_scores
from ..tree import ORIGIN_NAMES, DraftTree


def _host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor.cpu()`` without the (counted) call for a tensor already on the host: the layer loop's trees are."""
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


class AcceptanceCalibration:
    def __init__(self, bins: int = 10, prior_weight: float = 2.0):
        self.bins = bins
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        self.seen = torch.full((len(ORIGIN_NAMES), bins), prior_weight, dtype=torch.float64)  # [origins, bins]
        self.accepted = centres[None, :].repeat(len(ORIGIN_NAMES), 1) * prior_weight  # [origins, bins]

    def observe(self, tree: DraftTree, accepted: torch.Tensor) -> None:  # accepted: [a] root and accepted nodes
        """Count every verified node whose parent was accepted, and whether it was accepted itself."""
        mask = torch.zeros(tree.num_nodes, dtype=torch.bool)
        mask[_host(accepted)] = True
        parents, origins = _host(tree.parents), _host(tree.origins).long()
        nodes = torch.nonzero(mask[parents.clamp(min=0)]).flatten()
        nodes = nodes[nodes > 0]
        local = self.local_probability(tree)[nodes]
        cells = origins[nodes] * self.bins + self._bin(local)
        self.seen.view(-1).index_add_(0, cells, torch.ones(nodes.numel(), dtype=torch.float64))
        self.accepted.view(-1).index_add_(0, cells, mask[nodes].double())

    def rate(self, origins: torch.Tensor, local: torch.Tensor) -> torch.Tensor:  # [m], [m] -> [m] float32
        """Measured P(accepted | parent accepted) for nodes of ``origins`` with local probability ``local``."""
        bins = self._bin(local)
        origins = _host(origins).long()
        return (self.accepted[origins, bins] / self.seen[origins, bins]).float()

    def reach(self, tree: DraftTree) -> torch.Tensor:  # -> [num_nodes] float32, 1 at the root
        """Calibrated probability that verification accepts each node (the product of rates to the root)."""
        log_rates = self.rate(tree.origins, self.local_probability(tree)).double().log()
        log_rates[0] = 0.0  # the root is committed
        # row i of the ancestor mask marks i and its ancestors: one product sums the logs along every root path
        return torch.exp(_host(tree.ancestor_mask()).double() @ log_rates).float()

    def local_probability(self, tree: DraftTree) -> torch.Tensor:  # -> [num_nodes] float32, 1 at the root
        scores = _host(monotone_scores(tree))
        local = torch.ones(tree.num_nodes)
        local[1:] = torch.exp(scores[1:] - scores[_host(tree.parents[1:])]).clamp(max=1.0)
        return local

    def _bin(self, local: torch.Tensor) -> torch.Tensor:  # [m] -> [m] long
        return (_host(local) * self.bins).long().clamp(0, self.bins - 1)
