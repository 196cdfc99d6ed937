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

``run_strong_layers`` does what ``strong_layer`` does layer by layer — the same forwards, positions, children,
scores and node order — as tensor ops on the device, then reads the tree and the side columns to the host in one
``fetch``. One step of ``strong_layer`` is left out because it changes nothing here: rescoring. Every node of a
run was grafted by the strong drafter with its parent's score plus its own log-prob in the parent's row (a
value of that row's top-K), which is what rescoring would sum again, in the same float32 order. The layers after
the run continue on the host (``LayerLoop.build``).

A run over every layer of the step, for a policy that neither trims the cut tree nor learns from it on the host
(``CallPolicy.plans_whole_steps``: ``all-mid``), needs no read at all: the layer loop drafts it on the dense
layout instead (``drafters.dense_layout.OpenLayout``, the same tree without writing one) and cuts it on the device;
the step then reads only the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..drafters import TreeDrafter
from ..syncs import fetch, host_only
from ..tree import ORIGIN_MODEL, DraftTree, RootTrees


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
    rows: torch.Tensor  # [num_nodes] long: each node's strong log-prob row, -1 if never forwarded
    expanded: torch.Tensor  # [num_nodes] bool: the strong drafter grafted this node's children
    frontier: torch.Tensor  # [K] the last layer's K best children


def run_strong_layers(
    plan: RunPlan,
    strong: TreeDrafter,
    committed: torch.Tensor,  # [L] root last
    root_token: int,
    lookback: int,
    roots: RootTrees,
) -> RunResult:
    """Strong layers 1..``plan.layers`` of one step on ``strong``'s device, read by the host once at the end for the
    layers after them.

    In a run a layer's grafting positions are exactly the nodes it forwarded, best first: every node forwarded
    earlier was expanded by its own layer, so the forwarded-and-unexpanded candidates of a layer are the K it just
    forwarded. One sort of the open nodes' scores (window nodes not yet expanded) therefore picks both.
    """
    device, k, capacity = strong.device, plan.width, plan.capacity
    tree = roots.tree(root_token, device, capacity=capacity)
    # the side columns in one block, read with the tree: rows (-1: never forwarded), expanded (1) or not (-1),
    # and the frontier
    side = torch.full((2 * capacity + k,), -1, dtype=torch.long, device=device)
    rows, expanded = side[:capacity], side[capacity : 2 * capacity]
    open_scores = torch.full((capacity,), float("-inf"), device=device)  # [capacity] -inf: expanded or never written
    spread = torch.arange(k, device=device).repeat_interleave(k)  # [K·K] each position once per child
    positions, position_scores = side[:1].new_zeros(1), tree.scores[:1]  # layer 1 grafts under the root
    # masks from the tree's whole buffers (no ancestor-mask view per call): rows past its nodes hold no ancestors
    strong.forward(committed, tree, rows[:0], rows, None)  # the pending tokens: the root's row
    for layer in range(1, plan.layers + 1):
        if layer > 1:
            n, lowest = plan.nodes_before(layer), max(0, layer - lookback)
            # ``graft_window``: no node of a run is deeper than layer - 1 (``plan_run`` keeps max_depth above the run)
            window = open_scores[:n] if not lowest else torch.where(tree.depths >= lowest, open_scores[:n], float("-inf"))
            ranked = torch.sort(window, descending=True, stable=True)  # ties to the lower index, as ``best``
            positions, position_scores = ranked.indices[:k], ranked.values[:k]
            strong.forward(committed, tree, positions, rows, None)  # best first, as ``needed_nodes`` orders them
        # the positions' rows are the last the forward wrote, in their order (layer 1: the root's row 0), each read once
        top_logp, top_tokens = torch.topk(strong.logp_rows.view[-positions.shape[0] :], k)  # [p, K] twice
        # the positions' scores are already the strong drafter's: see the module docstring
        child_scores = (top_logp + position_scores[:, None]).view(-1)  # [p·K]
        parents = positions.expand(k) if layer == 1 else positions.index_select(0, spread)  # [p·K]
        first = tree.append(parents, top_tokens.view(-1), child_scores, ORIGIN_MODEL)
        open_scores[first : first + child_scores.shape[0]] = child_scores
        open_scores.index_fill_(0, positions, float("-inf"))
        expanded.index_fill_(0, positions, 1)
    last = plan.nodes_before(plan.layers)  # the last layer's children: their K best are the frontier
    torch.add(best(tree.scores[last:], None, k), last, out=side[2 * capacity :])
    return _to_host(tree, side)


def best(
    scores: torch.Tensor,  # [n] float32
    allowed: torch.Tensor | None,  # [n] bool; None: every node
    k: int,
) -> torch.Tensor:  # [k]
    """``strong_call.best_nodes`` on the device: ``k`` allowed nodes, best score first, ties to the lower index. The
    plan guarantees at least ``k`` allowed nodes, all with finite scores."""
    masked = scores if allowed is None else torch.where(allowed, scores, float("-inf"))
    return torch.sort(masked, descending=True, stable=True).indices[:k]


def _to_host(tree: DraftTree, side: torch.Tensor) -> RunResult:  # side: [2 · capacity + K]
    """The tree and side columns as host tensors: one read."""
    parts = tree.parts()
    n, capacity = tree.num_nodes, parts[0].shape[1]
    *parts, side = fetch(*parts, side)
    with host_only():
        host_tree = DraftTree.from_parts(tuple(parts), n, host=True)
        return RunResult(host_tree, side[:n], side[capacity : capacity + n] > 0, side[2 * capacity :])
