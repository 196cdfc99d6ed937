"""ModelDrafter: a small LM that proposes tokens, with its own KV cache committed like the target's.

Cache layout during a step: ``[committed tokens up to and including the root][tree nodes forwarded
this step, in forward order]``. A node's row is recorded in ``DraftTree.kv_slot``. On commit the
accepted path's rows (the longest accepted prefix the drafter forwarded) are gathered behind the
committed tokens; accepted tokens without a row, and the bonus, are forwarded at the next step's start.
"""

from __future__ import annotations

import torch

from ..lm import CausalLM
from ..tree import DraftTree


class ModelDrafter:
    name = "model"  # key of its call count in the step statistics

    def __init__(self, lm: CausalLM):
        self.lm = lm
        self.committed_length = 0  # committed tokens whose rows sit at the front of the cache
        self.calls = 0  # forwards this step

    @property
    def device(self) -> torch.device:
        return self.lm.device

    def reset(self) -> None:
        self.lm.reset()
        self.committed_length = 0

    def begin_step(self, committed: torch.Tensor) -> torch.Tensor:  # committed: [L], root last
        """Forward the committed tokens the cache lacks (the root at least); return the root's logits ``[vocab]``."""
        self.calls = 0
        self.lm.crop(self.committed_length)
        pending = committed[self.committed_length:]
        logits = self.lm.forward(pending.to(self.device), logits_to_keep=1)
        self.calls += 1
        self.committed_length = committed.shape[0]
        return logits[-1]

    def forward_nodes(
        self,
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices whose ancestors were all forwarded
        ancestor_mask: torch.Tensor | None = None,  # [num_nodes, num_nodes]; computed when absent
    ) -> torch.Tensor:
        """Forward ``nodes`` under a tree mask; record their cache rows; return logits ``[m, vocab]``."""
        if ancestor_mask is None:
            ancestor_mask = tree.ancestor_mask()
        cache_length = self.lm.cache_length
        m = nodes.shape[0]
        visible = torch.zeros(m, cache_length + m, dtype=torch.bool, device=self.device)
        visible[:, : self.committed_length] = True
        rows = ancestor_mask[nodes]  # [m, num_nodes] ancestors and self
        has_slot = tree.kv_slot >= 0
        ancestor_rows = rows & has_slot[None, :]
        query, node = torch.nonzero(ancestor_rows, as_tuple=True)
        visible[query, tree.kv_slot[node]] = True
        new_slots = torch.arange(cache_length, cache_length + m, device=self.device)
        visible[torch.arange(m, device=self.device), new_slots] = True
        positions = self.committed_length - 1 + tree.depths[nodes]
        logits = self.lm.forward(tree.tokens[nodes], positions, visible)
        tree.kv_slot[nodes] = new_slots
        self.calls += 1
        return logits

    def commit(self, tree: DraftTree, path: torch.Tensor) -> None:  # path: [m] node indices, root excluded
        """Keep the rows of the accepted ``path`` that the drafter forwarded (its longest such prefix)."""
        slots = tree.kv_slot[path]
        missing = torch.nonzero(slots < 0).flatten()
        kept = int(missing[0]) if missing.numel() else path.numel()
        self.lm.commit(slots[:kept], self.committed_length)
        self.committed_length += kept
