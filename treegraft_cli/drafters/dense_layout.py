"""EAGLE-2's dense tree drafted on its fixed layout: how ``dense``, ``chain`` (the tree one node wide) and ``graft``
draft with a small-LM drafter.

Words as in ``tree.py``. A *layer* gives each node of the *frontier* the drafter's top-K children; the K new
nodes of best cumulative score are the next frontier, which the next layer forwards. The *pool* is every node
the D layers add, in the order the generic builder (``DenseMethod.layers`` on a ``DraftTree``) writes them:
the root's K children, then layer by layer the K children of each frontier node, frontier in order. The layout
is fixed by (D, K): the block of the pool each layer fills, every pool node's depth, and the drafter cache rows
each forward adds (layer l's frontier takes rows (l − 1) · K .. l · K − 1 after the committed ones). Only which
frontier node a child hangs under depends on the logits.

So no layer writes a tree. A layer keeps its children's tokens and scores and the K it picked, plus the
frontier's *lineage*: which of this step's drafter cache rows each frontier node sees (its ancestors' and its
own), the tree part of the drafter's attention mask, one gather per layer instead of a tree-wide ancestor mask.
The top-N tree is assembled once, at the end. It is the tree the generic builder followed by
``DraftTree.top_by_score`` gives, node for node and bit for bit (the same top-k and sort calls pick the same
nodes; tests/test_dense_layout.py), with about half the tensor calls of drafting it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..lm import on_device_of
from ..tree import ORIGIN_MODEL, ORIGIN_ROOT, DraftTree, best_by_score, reindex_parents
from .logp_rows import log_softmax_float32
from .model import ModelDrafter


class DenseLayout:
    """The dense tree of depth ``depth``, width ``width`` (K) and ``budget`` (N) nodes, drafted by ``drafter``.

    The constant parts of the layout (depths, the parents of the root's children, the child-to-frontier
    spread, the rows each forwarded node takes) are built once here, on the drafter's device.
    """

    def __init__(self, drafter: ModelDrafter, depth: int, width: int, budget: int):
        self.drafter = drafter
        self.depth, self.width, self.budget = depth, width, budget
        device, k = drafter.device, width
        sizes = [k] + [k * k] * (depth - 1)  # the pool block each layer fills
        self.pool_size = sum(sizes)  # P
        self.depths = torch.repeat_interleave(torch.arange(depth + 1, device=device),
                                              torch.tensor([1, *sizes], device=device))  # [1 + P] root first
        self.origins = torch.full((1 + self.pool_size,), ORIGIN_MODEL, dtype=torch.int8, device=device)
        self.origins[0] = ORIGIN_ROOT
        # node index of each forwarded layer's first child (layers 1..D−1): the frontier's picks are offsets in it
        firsts = [1 + sum(sizes[:layer]) for layer in range(depth - 1)]
        self.block_firsts = torch.tensor(firsts, dtype=torch.long, device=device)[:, None]  # [D − 1, 1]
        # child j of layers 2..D hangs under entry j // K of the frontiers in forward order
        self.spread = torch.arange((depth - 1) * k, device=device).repeat_interleave(k)  # [(D − 1) · K · K]
        self.first_parents = torch.tensor([-1] + [0] * k, dtype=torch.long, device=device)  # the root and its children
        self.forward_rows = torch.arange((depth - 1) * k, device=device)  # [(D − 1) · K] forward order
        self.no_rows = torch.full((1 + self.pool_size,), -1, dtype=torch.long, device=device)
        self.eye = torch.eye(k, dtype=torch.bool, device=device)
        self.root_score = torch.zeros(1, device=device)

    def pool_nodes(self, layers: int) -> int:
        """Nodes the first ``layers`` layers add (root excluded)."""
        return self.width + (layers - 1) * self.width * self.width if layers else 0

    def draft(self, committed: torch.Tensor) -> DraftTree:  # committed: [L], root last
        """This step's tree: D layers on the drafter, then the N best pool nodes by score (prefix-closed)."""
        *_, drafted = self.layers(committed)  # every layer: the pool after the last
        return drafted.top_by_score(self.budget)

    def layers(self, committed: torch.Tensor) -> Iterator[DenseDraft]:  # committed: [L], root last
        """Draft layer by layer, yielding the pool after each of the D layers (one object, grown in place): a
        caller that stops early (``graft``'s checkpoints) spares the forwards of the layers after."""
        k, drafter = self.width, self.drafter
        root_logits = drafter.begin_step(committed)  # [vocab]
        drafted = DenseDraft(self, committed[-1:], drafter.committed_length)
        logp, children = torch.topk(log_softmax_float32(root_logits[None]), k, dim=-1)  # [1, K]
        scores, tokens = logp.view(-1), children.view(-1)  # the root's score is 0: its children score their own
        drafted.add_layer(tokens, scores)
        yield drafted
        lineage = self.eye  # [K, rows]: layer 1's frontier sees only its own rows
        for layer in range(1, self.depth):
            picked = torch.topk(scores, k)  # this layer's frontier: offsets in its block, best first
            if layer > 1:  # a frontier node sees what its parent (entry pick // K of the last frontier) saw
                parents = torch.div(picked.indices, k, rounding_mode="floor")
                lineage = torch.cat([lineage.index_select(0, parents), self.eye], dim=1)
            drafted.frontiers.append(picked.indices)
            logits = drafter.forward_block(tokens.index_select(0, picked.indices), layer, lineage)  # [K, vocab]
            logp, children = torch.topk(log_softmax_float32(logits), k, dim=-1)  # [K, K]
            scores = (picked.values[:, None] + logp).view(-1)  # [K · K] cumulative, parent by parent
            tokens = children.view(-1)
            drafted.add_layer(tokens, scores)
            yield drafted

    def tree(
        self,
        columns: torch.Tensor,  # [4, n] tokens, parents (−1 at the root), depths, kv_slot
        scores: torch.Tensor,  # [n]
        origins: torch.Tensor,  # [n] int8
        depth: int,  # no node is deeper
        capacity: int = 0,  # buffers for this many nodes (at least n); 0: n
    ) -> DraftTree:
        """A DraftTree on these columns, its ancestor mask marked from each node's ancestors at distances 1..depth.
        Past the nodes, room for appending holds ``DraftTree``'s fill values: no row (−1) and a diagonal mask."""
        n = columns.shape[1]
        up = columns[1].clamp(min=0)  # the root is its own parent: every climb ends there
        ancestors = [torch.arange(n, device=up.device), up]
        for _ in range(depth - 1):
            ancestors.append(up.index_select(0, ancestors[-1]))
        ancestors = torch.stack(ancestors, dim=1)  # [n, depth + 1]
        if capacity <= n:
            mask = torch.zeros(n, n, dtype=torch.bool, device=up.device)
            mask.scatter_(1, ancestors, True)
            return DraftTree.from_parts((columns, scores, origins, mask), n)
        room = (0, capacity - n)
        mask = torch.eye(capacity, dtype=torch.bool, device=up.device)
        mask[:n].scatter_(1, ancestors, True)
        pad = torch.nn.functional.pad
        parts = (pad(columns, room, value=-1), pad(scores, room, value=float("-inf")), pad(origins, room), mask)
        return DraftTree.from_parts(parts, n)


class DenseDraft:
    """The layers of one step's dense tree drafted so far. Answers what a ``DraftTree`` of the pool would
    (``size``, ``top_by_score``) without writing one until asked."""

    def __init__(self, layout: DenseLayout, root: torch.Tensor, first_row: int):  # root: [1] the root token
        self.layout = layout
        self.root = root
        self.first_row = first_row  # the drafter cache row of the first forwarded node
        self.tokens: list[torch.Tensor] = []  # per layer: [K] (layer 1), then [K · K]
        self.scores: list[torch.Tensor] = []  # the same shapes, float32 cumulative log-probs
        self.frontiers: list[torch.Tensor] = []  # per forwarded layer: [K] picked offsets in its block, best first

    def add_layer(self, tokens: torch.Tensor, scores: torch.Tensor) -> None:
        self.tokens.append(tokens)
        self.scores.append(scores)

    @property
    def size(self) -> int:
        """Pool nodes so far (root excluded)."""
        return self.layout.pool_nodes(len(self.tokens))

    def best_score(self) -> torch.Tensor:  # [] on the device
        """The best cumulative score of the last layer's nodes."""
        return self.scores[-1].max()

    def top_by_score(self, budget: int, capacity: int = 0) -> DraftTree:
        """``DraftTree.top_by_score`` of the pool so far: its columns in the generic builder's node order, cut to the
        ``budget`` best nodes. ``capacity``: room for that many nodes (root included), for a caller that appends
        (``graft``); else exactly the nodes."""
        layout, n, forwarded_layers = self.layout, 1 + self.size, len(self.frontiers)
        tokens = torch.cat([on_device_of(self.root, self.tokens[0].device), *self.tokens])  # [1 + P]
        scores = torch.cat([layout.root_score, *self.scores])  # [1 + P]
        parents, slots = layout.first_parents, _prefix(layout.no_rows, n).clone()
        if forwarded_layers:
            forwarded = (torch.stack(self.frontiers) + _prefix(layout.block_firsts, forwarded_layers)).view(-1)  # [F · K]
            parents = torch.cat([parents, forwarded.index_select(0, _prefix(layout.spread, n - 1 - layout.width))])
            slots.index_copy_(0, forwarded, _prefix(layout.forward_rows, forwarded.shape[0]) + self.first_row)
        depths = _prefix(layout.depths, n)
        columns = torch.stack([tokens, parents, depths, slots])  # [4, 1 + P], DraftTree's int64 block
        if self.size <= budget:
            return layout.tree(columns, scores, _prefix(layout.origins, n).clone(), len(self.tokens), capacity)
        kept = best_by_score(scores, budget)  # [1 + N] the root first
        columns = columns.index_select(1, kept)
        reindex_parents(kept, columns[1])
        origins = layout.origins.index_select(0, kept)
        return layout.tree(columns, scores.index_select(0, kept), origins, len(self.tokens), capacity)


def _prefix(column: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` entries of a layout column: the column itself when that is all of it (no slicing call)."""
    return column if column.shape[0] == n else column[:n]


