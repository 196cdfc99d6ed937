"""A run of strong layers from a step's start, on the strong drafter's device, read by the host once.

``LayerLoop.strong_layer`` reads each call's lookup back (one synchronisation per call) because the host decides
what the next layer forwards. When the policy calls at layers 1..r whatever the tree holds
(``CallPolicy.planned_calls``: ``all-mid``, the step rule's strong steps, ``fixed`` with layers from 1 on), none
of those answers is needed in between: growing from the root alone, a strong layer never merges (its grafting
positions have no children yet, and a position's top-K tokens are distinct) and every node's parent has a row,
so every count the host would read is known beforehand (``plan_run``):

- layer 1 forwards the pending committed tokens only (the root's row) and grafts K children under the root;
- every later layer forwards the K best unforwarded nodes of its window (``LayerLoop.pool_at``: a tree without
  n-gram chains needs no more; the K·K children the layer before added lie there, the root's K at layer 2) and
  grafts K children under each of its K positions.

Such a run is drafted on the dense tree's layout (``drafters.dense_layout.OpenLayout``): the same forwards,
positions, children, scores and node order as ``strong_layer`` layer by layer, as tensor ops on the device, with
no tree written until the run ends. One step of ``strong_layer`` is left out because it changes nothing here:
rescoring. Every node of a run was grafted by the strong drafter with its parent's score plus its own log-prob in
the parent's row (a value of that row's top-K), which is what rescoring would sum again, in the same float32 order.

``run_strong_layers`` writes the run's tree once and reads it to the host in one ``fetch``; the layers after the
run continue on the host (``LayerLoop.build``), where the strong drafter's rows of the run are its log-prob rows
and cache rows as ``strong_layer`` would have left them. A run over every layer, for a policy that neither trims
the cut tree nor learns from it on the host (``CallPolicy.plans_whole_steps``: ``all-mid``), needs no read at all:
the layer loop cuts it on the device instead; the step then reads only the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters.dense_layout import OpenLayout
from ..syncs import fetch, host_only
from ..tree import DraftTree
from .strong_call import best_nodes


@dataclass(frozen=True)
class RunPlan:
    """Strong layers 1..``layers`` grown from the root: what each forwards and how many positions it picks."""

    layers: int
    width: int  # K

    def forwarded(self, layer: int) -> int:
        """Nodes ``layer`` forwards: none at layer 1 (the pending tokens give the root's row), then K."""
        return 0 if layer == 1 else self.width

    def positions(self, layer: int) -> int:
        """Grafting positions ``layer`` picks: the root at layer 1, then K."""
        return 1 if layer == 1 else self.width

    def nodes_before(self, layer: int) -> int:
        """Nodes (root included) when ``layer`` (1-based) starts."""
        return 1 + self.width * sum(self.positions(earlier) for earlier in range(1, layer))

    @property
    def capacity(self) -> int:
        return self.nodes_before(self.layers + 1)


def plan_run(layers: int, width: int, pool: int, max_depth: int) -> RunPlan | None:
    """The plan of strong layers 1..``layers`` grown from the root, or None when the data could change its counts: a
    pool smaller than K (a layer could find fewer than K candidates) or a run deeper than ``max_depth`` (children
    would leave the window)."""
    if layers < 1 or layers > max_depth or pool < width:
        return None
    return RunPlan(layers, width)


@dataclass(frozen=True)
class RunResult:
    """The run's tree and side columns (``Growth``'s), on the host."""

    tree: DraftTree
    rows: list[int]  # [num_nodes] each node's strong log-prob row, -1 if never forwarded: in a run, the nodes with a
    # row (the root and every forwarded node) are the ones the strong drafter grafted children under
    frontier: list[int]  # [K] the last layer's K best children


def run_strong_layers(
    plan: RunPlan,
    layout: OpenLayout,  # the strong drafter's
    committed: torch.Tensor,  # [L] root last
) -> RunResult:
    """Strong layers 1..``plan.layers`` of one step on the strong drafter's device, read by the host once at the end
    for the layers after them.

    The drafter's log-prob rows are the root's (row 0), then each forwarded node's in forward order, and its cache rows
    past the committed ones the same nodes' (``kv_slot``): a node's log-prob row is its cache row's offset plus one.
    """
    drafted = layout.run(committed, plan.layers)
    parts = fetch(*drafted.tree_parts())
    with host_only():
        tree = DraftTree.from_read_parts(parts, plan.capacity)
        slots, first_row = tree.host_list("kv_slot"), drafted.first_row
        rows = [-1 if slot < 0 else slot - first_row + 1 for slot in slots]
        rows[0] = 0
        last = plan.nodes_before(plan.layers)  # the last layer's children: their K best are the frontier
        frontier = best_nodes(tree.score_list(), list(range(last, plan.capacity)), plan.width)
        return RunResult(tree, rows, frontier)
