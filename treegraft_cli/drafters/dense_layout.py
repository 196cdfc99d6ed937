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
from .strong import TreeDrafter


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
        self.node_indices: dict[int, torch.Tensor] = {}  # ``_node_indices``
        self.prefixes: dict[tuple[int, int], torch.Tensor] = {}  # ``prefix``
        size = 1 + self.pool_size
        # tokens, parents and depths of the pool in one block (``OpenLayout`` gathers a layer's forwarded nodes' in one
        # call), and the scores: each layer's top-k writes its children's tokens and scores straight into its block
        self.pool = torch.stack([torch.zeros(size, dtype=torch.long, device=device),
                                 torch.zeros(size, dtype=torch.long, device=device), self.depths])  # [3, 1 + P]
        # views; the root's children's parent: 0. The depths are the layout's (``depths``) unless a layer writes its
        # block's (``OpenLayout``)
        self.pool_tokens, self.pool_parents, self.pool_depths = self.pool.unbind()
        self.pool_parents[0].fill_(-1)
        self.fresh_scores = torch.full((size,), float("-inf"), device=device)  # [1 + P] a step's start: the root's 0
        self.fresh_scores[0].fill_(0.0)
        self.pool_scores = self.fresh_scores.clone()  # [1 + P] cumulative log-probs
        self.child_logp = torch.empty(k, k, device=device)  # [K, K] a layer's top-k log-probs, before its parents' scores
        # each layer's block of the pool, flat and as the top-k writes it ([1, K] for layer 1, then [K, K]): views made once
        blocks = [(1 + self.pool_nodes(layer), (1 if layer == 0 else k)) for layer in range(depth)]
        self.token_blocks = [self.pool_tokens[first : first + rows * k] for first, rows in blocks]
        self.score_blocks = [self.pool_scores[first : first + rows * k] for first, rows in blocks]
        self.parent_blocks = [self.pool_parents[first : first + rows * k] for first, rows in blocks]
        self.depth_blocks = [self.pool_depths[first : first + rows * k] for first, rows in blocks]
        self.token_grids = [block.view(rows, k) for block, (_, rows) in zip(self.token_blocks, blocks, strict=True)]
        self.score_grids = [block.view(rows, k) for block, (_, rows) in zip(self.score_blocks, blocks, strict=True)]

    def prefix(self, column: torch.Tensor, n: int) -> torch.Tensor:
        """The first ``n`` entries of one of the layout's columns: the column itself when that is all of it, else a
        view made once per column and size (no slicing call a step)."""
        if column.shape[0] == n:
            return column
        key = (id(column), n)  # the layout's columns live as long as it does
        view = self.prefixes.get(key)
        if view is None:
            view = self.prefixes[key] = column[:n]
        return view

    def _node_indices(self, n: int) -> torch.Tensor:  # [n] 0 .. n − 1, made once per size
        indices = self.node_indices.get(n)
        if indices is None:
            indices = self.node_indices[n] = torch.arange(n, device=self.depths.device)
        return indices

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
        root_logp = drafter.begin_step_logp(committed)  # [1, vocab]
        drafted = DenseDraft(self, committed[-1:], drafter.committed_length)
        # the root's score is 0: its children score their own log-probs
        torch.topk(root_logp, k, dim=-1, out=(self.score_grids[0], self.token_grids[0]))
        scores, tokens = self.score_blocks[0], self.token_blocks[0]
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
            torch.topk(log_softmax_float32(logits), k, dim=-1, out=(self.child_logp, self.token_grids[layer]))  # [K, K]
            torch.add(picked.values[:, None], self.child_logp, out=self.score_grids[layer])  # cumulative, parent by parent
            scores, tokens = self.score_blocks[layer], self.token_blocks[layer]
            drafted.add_layer(tokens, scores)
            yield drafted

    def parents_and_forwarded(
        self, drafted: DenseDraft, n: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n] parents (root −1), [F · K] forwarded nodes in forward order
        """The parent of each of the first ``n`` nodes and the nodes the layers forwarded (None before any did)."""
        forwarded_layers = len(drafted.frontiers)
        if not forwarded_layers:
            return self.first_parents, None
        forwarded = (torch.stack(drafted.frontiers) + self.prefix(self.block_firsts, forwarded_layers)).view(-1)  # [F · K]
        parents = torch.cat([self.first_parents, forwarded.index_select(0, self.prefix(self.spread, n - 1 - self.width))])
        return parents, forwarded

    def tree(
        self,
        columns: torch.Tensor,  # [4, n] tokens, parents (−1 at the root), depths, kv_slot
        parents: torch.Tensor,  # [n] the parents column (``columns[1]``, or what it was stacked from)
        scores: torch.Tensor,  # [n]
        origins: torch.Tensor,  # [n] int8
        depth: int,  # no node is deeper
        capacity: int = 0,  # buffers for this many nodes (at least n); 0: n
    ) -> DraftTree:
        """A DraftTree on these columns (``tree_parts``)."""
        return DraftTree.from_parts(self.tree_parts(columns, parents, scores, origins, depth, capacity), columns.shape[1])

    def tree_parts(
        self,
        columns: torch.Tensor,  # [4, n] as ``tree``'s
        parents: torch.Tensor,  # [n]
        scores: torch.Tensor,  # [n]
        origins: torch.Tensor,  # [n] int8
        depth: int,
        capacity: int = 0,
    ) -> tuple[torch.Tensor, ...]:
        """The buffers of a tree on these columns (``DraftTree.parts``), its ancestor mask marked from each node's
        ancestors at distances 1..depth. Past the nodes, room for appending holds ``DraftTree``'s fill values: no row
        (−1) and a diagonal mask."""
        n = columns.shape[1]
        up = parents.clamp(min=0)  # the root is its own parent: every climb ends there
        ancestors = [self._node_indices(n), up]
        for _ in range(depth - 1):
            ancestors.append(up.index_select(0, ancestors[-1]))
        ancestors = torch.stack(ancestors, dim=1)  # [n, depth + 1]
        if capacity <= n:
            mask = torch.zeros(n, n, dtype=torch.bool, device=up.device)
            mask.scatter_(1, ancestors, True)
            return columns, scores, origins, mask
        room = (0, capacity - n)
        mask = torch.eye(capacity, dtype=torch.bool, device=up.device)
        mask[:n].scatter_(1, ancestors, True)
        pad = torch.nn.functional.pad
        return pad(columns, room, value=-1), pad(scores, room, value=float("-inf")), pad(origins, room), mask


class OpenLayout(DenseLayout):
    """TreeGraft's strong drafter called at layers 1..r from the root (``grafting.strong_run``: ``all-mid``'s every
    layer, nothing read on the host; ``fixed:1,2``'s first two, read once by ``run``) drafted on the dense tree's
    layout.

    Layer 1 is EAGLE-2's. Every later layer forwards the K best *open* nodes of the pool (not forwarded yet, depth
    at least the run's layer minus ``lookback``) wherever they hang, not only the last layer's children, and hangs
    each one's top-K children under it. The pool's blocks and drafter cache rows are the dense layout's; which node
    a layer forwards, and so each child's parent and depth, depends on the logits. A layer may forward a node an
    earlier layer left open, shallower than the last layer's children, so each layer writes its children's depths
    (their parents' plus one), and lineage (the step's cache rows a node sees) is kept per pool node.

    It drafts the host layer loop's tree (``LayerLoop.strong_layer`` layer by layer) node for node and bit for bit
    (tests/test_strong_run.py): the root's row from ``TreeDrafter.forward``'s pending-token forward, each layer's
    positions ranked by one stable sort (ties to the lower index) and forwarded best first, children in the same
    order. What it spares is the tree: no node is written and no ancestor mask kept until the cut or the run's end
    (on the tiny pair an ``all-mid`` step took 268.7 → 198.7 tensor calls).

    The pool's tokens, parents, scores and lineage live in buffers kept across steps, and each layer's top-k writes
    its children's tokens and scores straight into its block of them (views made once). Every entry a step reads it
    has written that step, or holds the layout's constant (the root's parent, its children's, its lineage, its
    score 0); the scores and the closed flags (the root and the forwarded nodes) are reset at a step's start, so
    that one sort ranks the whole pool: the blocks not written yet hold −inf, after every written node.
    """

    def __init__(self, drafter: TreeDrafter, depth: int, width: int, budget: int, lookback: int):
        super().__init__(drafter, depth, width, budget)
        device, k, size = drafter.device, width, 1 + self.pool_size
        self.lookback = lookback
        self.child_spread = torch.arange(k, device=device).repeat_interleave(k)  # [K · K] each position once per child
        step_rows = (depth - 1) * k
        # the bits of the rows layer f's forwarded nodes take, node j of the layer row (f − 1) · K + j
        self.own_rows = [torch.zeros(k, step_rows, dtype=torch.bool, device=device) for _ in range(depth - 1)]
        for f, own in enumerate(self.own_rows):
            own[:, f * k : (f + 1) * k] = self.eye
        self.fresh_closed = torch.zeros(size, dtype=torch.bool, device=device)  # [1 + P] a step's start: the root
        self.fresh_closed[0].fill_(True)
        self.closed = self.fresh_closed.clone()  # [1 + P] the root and the forwarded nodes
        self.lineage = torch.zeros(size, step_rows, dtype=torch.bool, device=device)  # [1 + P, rows] the root: none
        # per forwarded layer, written through ``out=`` and read through views made here (no slicing call a step):
        # the pool ranked by one sort, the forwarded nodes' tokens, parents and depths, and what each sees
        self.ranked = [(torch.empty(size, device=device), torch.empty(size, dtype=torch.long, device=device))
                       for _ in range(depth - 1)]  # ([1 + P] scores, [1 + P] nodes) best first
        self.forwarded_columns = [torch.empty(3, k, dtype=torch.long, device=device) for _ in range(depth - 1)]
        self.forwarded_views = [tuple(columns.unbind()) for columns in self.forwarded_columns]  # [K] views each
        self.sees = [torch.empty(k, step_rows, dtype=torch.bool, device=device) for _ in range(depth - 1)]
        self.sees_so_far = [sees[:, : (f + 1) * k] for f, sees in enumerate(self.sees)]  # the rows written by then
        self.best_scores = [scores[:k, None] for scores, _ in self.ranked]  # [K, 1]
        self.best_nodes = [nodes[:k] for _, nodes in self.ranked]  # [K]

    def layers(self, committed: torch.Tensor) -> Iterator[DenseDraft]:  # committed: [L], root last
        return self._layers(committed, self.depth, keep_rows=False)

    def run(self, committed: torch.Tensor, layers: int) -> DenseDraft:  # committed: [L], root last
        """The pool after the first ``layers`` layers, the layers after them left to the caller: the strong drafter
        keeps each forwarded node's log-prob row after the root's and knows whose cache rows follow the committed ones,
        in forward order, as its own forwards would (``TreeDrafter.logp_rows``, ``step_nodes``), for a later call of
        the step to read and mask against."""
        *_, drafted = self._layers(committed, layers, keep_rows=True)
        if drafted.frontiers:
            self.drafter.set_step_nodes(torch.cat(drafted.frontiers))
        return drafted

    def _layers(self, committed: torch.Tensor, layers: int, keep_rows: bool) -> Iterator[DenseDraft]:
        k, drafter = self.width, self.drafter
        self.pool_scores.copy_(self.fresh_scores)  # the last step's blocks: nothing is open until a layer writes it
        self.closed.copy_(self.fresh_closed)
        # the root's score is 0: its children score their own log-probs
        torch.topk(drafter.begin_step_logp(committed), k, dim=-1, out=(self.score_grids[0], self.token_grids[0]))
        drafted = DenseDraft(self, committed[-1:], drafter.committed_length)
        drafted.add_layer(self.token_blocks[0], self.score_blocks[0])
        yield drafted
        for layer in range(1, layers):
            forwarded, forwarded_scores = self._positions(layer + 1)  # [K] best first, [K, 1]
            torch.index_select(self.pool, 1, forwarded, out=self.forwarded_columns[layer - 1])
            forwarded_tokens, forwarded_parents, forwarded_depths = self.forwarded_views[layer - 1]
            sees = torch.index_select(self.lineage, 0, forwarded_parents, out=self.sees[layer - 1])  # [K, rows]
            sees.bitwise_or_(self.own_rows[layer - 1])
            last = layer == layers - 1  # no layer after it reads the lineage or the closed flags it would write
            if not last:
                self.lineage.index_copy_(0, forwarded, sees)
            logits = drafter.forward_block(forwarded_tokens, forwarded_depths, self.sees_so_far[layer - 1])
            logp = drafter.logp_rows.append_rows(logits) if keep_rows else log_softmax_float32(logits)  # [K, vocab]
            torch.topk(logp, k, dim=-1, out=(self.child_logp, self.token_grids[layer]))  # [K, K]
            torch.add(self.child_logp, forwarded_scores, out=self.score_grids[layer])  # cumulative, parent by parent
            torch.index_select(forwarded, 0, self.child_spread, out=self.parent_blocks[layer])
            torch.index_select(forwarded_depths, 0, self.child_spread, out=self.depth_blocks[layer]).add_(1)
            if not last:
                self.closed.index_fill_(0, forwarded, True)
            drafted.frontiers.append(forwarded)
            drafted.add_layer(self.token_blocks[layer], self.score_blocks[layer])
            yield drafted

    def _positions(self, run_layer: int) -> tuple[torch.Tensor, torch.Tensor]:  # [K] nodes, [K, 1] scores
        """The K best open nodes, best first, within the lookback of the run's layer, and their scores as a column.
        The whole pool is sorted: the nodes not written yet are −inf, after every written one (a stable sort keeps
        the −inf ones in index order, so the written nodes' ranks are those of a sort of the written prefix)."""
        window = torch.where(self.closed, float("-inf"), self.pool_scores)
        lowest = run_layer - self.lookback
        if lowest > 0:
            window = torch.where(self.pool_depths >= lowest, window, float("-inf"))
        forwarded_layer = run_layer - 2  # the run's layer 2 is the first to forward pool nodes
        torch.sort(window, descending=True, stable=True, out=self.ranked[forwarded_layer])
        return self.best_nodes[forwarded_layer], self.best_scores[forwarded_layer]

    def parents_and_forwarded(self, drafted: DenseDraft, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        forwarded = torch.cat(drafted.frontiers) if drafted.frontiers else None  # node indices, forward order
        return self.prefix(self.pool_parents, n), forwarded


class DenseDraft:
    """The layers of one step's dense tree drafted so far. Answers what a ``DraftTree`` of the pool would
    (``size``, ``top_by_score``) without writing one until asked."""

    def __init__(self, layout: DenseLayout, root: torch.Tensor, first_row: int):  # root: [1] the root token
        self.layout = layout
        self.root = root
        self.first_row = first_row  # the drafter cache row of the first forwarded node
        self.tokens: list[torch.Tensor] = []  # per layer: [K] (layer 1), then [K · K]
        self.scores: list[torch.Tensor] = []  # the same shapes, float32 cumulative log-probs
        # per forwarded layer, [K]: the picked offsets in its block, best first (``DenseLayout``); the forwarded nodes,
        # in forward order (``OpenLayout``)
        self.frontiers: list[torch.Tensor] = []

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
        if self.size <= budget:
            return self.tree(capacity)
        layout = self.layout
        columns, parents, scores = self._columns()
        kept = best_by_score(scores, budget)  # [1 + N] the root first
        columns = columns.index_select(1, kept)
        parents = columns[1]
        reindex_parents(kept, parents)
        origins = layout.origins.index_select(0, kept)
        return layout.tree(columns, parents, scores.index_select(0, kept), origins, len(self.tokens), capacity)

    def tree(self, capacity: int = 0) -> DraftTree:
        """The whole pool so far as a tree, in the generic builder's node order (no cut); ``capacity`` as in
        ``top_by_score``."""
        return DraftTree.from_parts(self.tree_parts(capacity), 1 + self.size)

    def tree_parts(self, capacity: int = 0) -> tuple[torch.Tensor, ...]:
        """``tree``'s buffers (``DraftTree.parts``), for a caller that reads them to the host without a device tree."""
        columns, parents, scores = self._columns()
        n = columns.shape[1]
        # a tree with room gets a padded copy; one without takes a copy of its own
        origins = self.layout.prefix(self.layout.origins, n)
        origins = origins if capacity > n else origins.clone()
        return self.layout.tree_parts(columns, parents, scores, origins, len(self.tokens), capacity)

    def _columns(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pool's int64 block ``[4, 1 + P]`` (tokens, parents, depths, kv_slot), its parents ``[1 + P]`` and
        scores ``[1 + P]``."""
        layout, n = self.layout, 1 + self.size
        tokens = torch.cat([on_device_of(self.root, self.tokens[0].device), *self.tokens])  # [1 + P]
        scores = torch.cat([layout.root_score, *self.scores])  # [1 + P]
        parents, forwarded = layout.parents_and_forwarded(self, n)
        slots = layout.prefix(layout.no_rows, n)  # the stack below copies it
        if forwarded is not None:  # out of place: the layout's column stays
            slots = slots.index_copy(0, forwarded, layout.prefix(layout.forward_rows, forwarded.shape[0]) + self.first_row)
        depths = layout.prefix(layout.pool_depths, n)
        return torch.stack([tokens, parents, depths, slots]), parents, scores
