"""ModelDrafter: a small LM that proposes tokens, with its own KV cache committed like the target's.

Cache layout during a step: ``[committed tokens up to and including the root][tree nodes forwarded
this step, in forward order]``. A node's row is recorded in ``DraftTree.kv_slot``. On commit the
accepted path's rows (the longest accepted prefix the drafter forwarded) are gathered behind the
committed tokens; accepted tokens without a row, and the bonus, are forwarded at the next step's start.
"""

from __future__ import annotations

import torch

from ..hostlists import longs
from ..lm import CausalLM, on_device_of
from ..syncs import host_only, read
from ..tree import DraftTree
from .logp_rows import log_softmax_float32

_NO_NODES = torch.zeros(0, dtype=torch.long)  # [0]: no node rows this step (never written)


class ModelDrafter:
    name = "model"  # key of its call count in the step statistics
    # its forwards need only tokens, a depth and what each sees (``forward_block``): no tree, so ``dense`` drafts
    # on its fixed layout (``drafters.dense_layout``)
    forwards_blocks = True

    def __init__(self, lm: CausalLM):
        self.lm = lm
        self.committed_length = 0  # committed tokens whose rows sit at the front of the cache
        self.calls = 0  # forwards this step
        self.step_nodes = _NO_NODES  # [s] the tree nodes whose cache rows follow the committed ones, in row order

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def reset(self) -> None:
        self.lm.reset()
        self.committed_length = 0
        self.step_nodes = _NO_NODES

    def crop_to_committed(self) -> None:
        """Drop the cache rows past the committed ones: this step's node rows (``step_nodes``) go with them."""
        self.lm.crop(self.committed_length)
        self.step_nodes = _NO_NODES

    def begin_step(self, committed: torch.Tensor) -> torch.Tensor:  # committed: [L], root last
        """Forward the committed tokens the cache lacks (the root at least); return the root's logits ``[vocab]``."""
        self.calls = 0
        self.crop_to_committed()
        pending = committed[self.committed_length:]
        logits = self.lm.forward(on_device_of(pending, self.device), logits_to_keep=1)
        self.calls += 1
        self.committed_length = committed.shape[0]
        return logits[-1]

    def begin_step_logp(self, committed: torch.Tensor) -> torch.Tensor:  # committed: [L], root last -> [1, vocab]
        """``begin_step``'s root row as float32 log-probs."""
        return log_softmax_float32(self.begin_step(committed)[None])

    def forward_nodes(
        self,
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices whose ancestors were all forwarded
        ancestor_mask: torch.Tensor | None = None,  # [num_nodes, num_nodes]; the tree's own when absent
        ancestors_forwarded: bool = True,  # always so here (a head's drafter also forwards missing ancestors)
    ) -> torch.Tensor:
        """Forward ``nodes`` under a tree mask; record their cache rows; return logits ``[m, vocab]``."""
        mask = self.node_mask(tree, nodes, ancestor_mask, self.committed_length, self.lm.cache_length)
        positions = on_device_of(tree.buffer("depths").index_select(0, nodes) + (self.committed_length - 1), self.device)
        tokens = on_device_of(tree.buffer("tokens").index_select(0, nodes), self.device)
        logits = self.lm.forward(tokens, positions, mask=mask)
        self.calls += 1
        return logits

    def forward_block(
        self,
        tokens: torch.Tensor,  # [m]
        depth: int | torch.Tensor,  # the nodes' depth, or each node's ([m])
        lineage: torch.Tensor,  # [m, step_rows] bool: this step's cache rows each node sees, its own (the last m) included
    ) -> torch.Tensor:
        """Forward ``m`` nodes at ``depth`` whose ancestors' rows are this step's earlier rows; logits ``[m, vocab]``.

        ``lineage`` covers every row after the committed ones, the nodes' own new rows last: the caller knows
        which rows hold what (a fixed layout), so no tree is read.
        """
        mask = self.lineage_mask(lineage, self.committed_length)
        if isinstance(depth, int):
            positions = torch.full((tokens.shape[0],), self.committed_length - 1 + depth, device=self.device)
        else:
            positions = depth + (self.committed_length - 1)
        logits = self.lm.forward(tokens, positions, mask=mask)
        self.calls += 1
        return logits

    def set_step_nodes(self, nodes: torch.Tensor) -> None:  # nodes: [s]
        """Name the tree nodes whose cache rows this step's block forwards (``forward_block``) wrote, in row order:
        those forwards see no tree, and a later forward over one (``node_mask``) masks against these rows."""
        self.step_nodes = nodes

    def node_mask(
        self,
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices, their cache rows to be written from ``start`` on
        ancestor_mask: torch.Tensor | None,  # [num_nodes, num_nodes]; None: the tree's whole buffers
        first_row: int,  # the committed rows: every node sees them
        start: int,  # the nodes' first cache row
    ) -> torch.Tensor:  # [1, 1, m, start + m] additive
        """Record the nodes' cache rows (``kv_slot``) after this step's earlier node rows (``step_nodes``) and mask
        them: each sees the committed rows and, of this step's node rows, its ancestors' and its own (the nodes'
        ancestor rows at those nodes' columns)."""
        m = nodes.shape[0]
        if start != first_row + self.step_nodes.shape[0]:
            raise RuntimeError(f"the drafter's cache holds {start} rows, not the {first_row} committed and "
                               f"{self.step_nodes.shape[0]} node rows of this step: crop it before a step's first call")
        tree.buffer("kv_slot").index_copy_(0, nodes, torch.arange(start, start + m, device=tree.device))
        seen = self.step_nodes = nodes if not self.step_nodes.shape[0] else torch.cat([self.step_nodes, nodes])
        rows = tree.ancestor_rows(nodes) if ancestor_mask is None else ancestor_mask.index_select(0, nodes)
        return self.lineage_mask(on_device_of(rows.index_select(1, seen), self.device), first_row)

    def lineage_mask(
        self, lineage: torch.Tensor, first_row: int  # [m, s] bool: which of this step's s node rows each node sees
    ) -> torch.Tensor:  # [1, 1, m, first_row + s] additive
        """The model's mask of ``m`` node rows: every committed row (before ``first_row``) and the step's rows in
        ``lineage``, picked from two constants and padded in front (no reshaping call)."""
        visible, hidden = self.lm.mask_values()
        return torch.nn.functional.pad(torch.where(lineage, visible, hidden), (first_row, 0))

    def commit(self, tree: DraftTree, path: torch.Tensor, forwarded: int | None = None) -> None:  # path: [m]
        """Keep the rows of the accepted ``path`` (node indices, root excluded) that the drafter forwarded: its
        longest such prefix, ``forwarded`` nodes long when the caller knows it (else one read)."""
        if tree.host and forwarded is None:  # the slots are host lists: the prefix is counted in Python
            with host_only():
                slots = tree.host_list("kv_slot")
                path_slots = [slots[node] for node in path.tolist()]
                forwarded = next((j for j, slot in enumerate(path_slots) if slot < 0), len(path_slots))
                kept = longs(path_slots[:forwarded])
        else:
            slots = tree.kv_slot[on_device_of(path, tree.device)]
            if forwarded is None:
                prefix = torch.cumprod(slots >= 0, 0).sum() if path.numel() else slots.new_zeros(())
                forwarded = int(read(prefix))
            kept = slots[:forwarded]
        self.lm.commit(on_device_of(kept, self.device), self.committed_length)
        self.committed_length += forwarded
        self.step_nodes = _NO_NODES
