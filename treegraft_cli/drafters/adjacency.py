"""AdjacencyTable: top-k successor tokens of every vocabulary token, learned online from the target.

``M[v]`` holds the k tokens the target ranked highest right after ``v`` the last time it verified a node
whose token was ``v`` (DESIGN.md §4). Rows start unwritten; the prompt's prefill fills the rows of the
prompt's tokens, and after every verification each verified node ``i`` (root included, accepted or
not) sets ``M[token_i] = top-k(target logits at i)``. Rows never written yield no nodes.

When one batch writes a token twice, the later write wins, and the accepted path (root first) is
written last: the row then comes from the context that was actually committed.

The table lives on the target's device and is kept across requests: methods call ``write_prompt`` at
every request start and ``reset`` only when they want a fresh table.
"""

from __future__ import annotations

import torch

from ..tree import ORIGIN_ADJACENCY, DraftTree
from .rank_template import RankTemplate


class AdjacencyTable:
    def __init__(self, k: int):
        self.k = k
        self.table: torch.Tensor | None = None  # [vocab, k] int64, allocated at the first write
        self.written: torch.Tensor | None = None  # [vocab] bool

    def reset(self) -> None:
        """Forget every row."""
        self.table = None
        self.written = None

    @property
    def rows_written(self) -> int:
        return 0 if self.written is None else int(self.written.sum())

    def write(
        self,
        tokens: torch.Tensor,  # [n] token of each position, in write order
        logits: torch.Tensor,  # [n, vocab] target logits right after each token
    ) -> None:
        """``M[tokens[i]] = top-k(logits[i])`` for every i; the last write of a repeated token wins."""
        if tokens.numel() == 0:
            return
        self._allocate(logits)
        tokens = tokens.to(self.table.device).long()
        unique, inverse = torch.unique(tokens, return_inverse=True)
        positions = torch.arange(tokens.numel(), device=tokens.device)
        last = torch.full_like(unique, -1).scatter_reduce(0, inverse, positions, reduce="amax")
        # top-k only over the rows that survive deduplication
        top = torch.topk(logits[last.to(logits.device)], self.k, dim=-1).indices.to(self.table.device)
        self.table[unique] = top
        self.written[unique] = True

    def write_prompt(
        self,
        prompt_ids: torch.Tensor,  # [prompt_length]
        logits: torch.Tensor,  # [prompt_length, vocab] target prefill logits
    ) -> None:
        self.write(prompt_ids, logits)

    def write_verified(
        self,
        tree: DraftTree,
        path: torch.Tensor,  # [m] accepted node indices, root excluded
        logits: torch.Tensor,  # [num_nodes, vocab] target logits at every tree node
    ) -> None:
        """Write every verified node; the root and the accepted path last, so their rows win."""
        device = tree.device
        on_path = torch.zeros(tree.num_nodes, dtype=torch.bool, device=device)
        path = torch.cat([torch.zeros(1, dtype=torch.long, device=device), path.to(device)])
        on_path[path] = True
        order = torch.cat([torch.nonzero(~on_path).flatten(), path])
        self.write(tree.tokens[order], logits[order.to(logits.device)])

    def _allocate(self, logits: torch.Tensor) -> None:
        vocab = logits.shape[-1]
        if self.table is None or self.table.shape[0] < vocab:
            self.table = torch.zeros(vocab, self.k, dtype=torch.long, device=logits.device)
            self.written = torch.zeros(vocab, dtype=torch.bool, device=logits.device)

    def materialise(
        self, root_token: int, template: RankTemplate
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[S]`` of every template candidate grown from ``root_token``, and which are valid ``[S]``.

        One batched gather per depth: ``x_u = M[x_parent(u), r_u]``. A candidate is valid when its
        parent is and the parent's row was written.
        """
        device = template.parents.device
        size = template.size
        tokens = torch.zeros(size + 1, dtype=torch.long, device=device)  # slot 0 is the root
        valid = torch.zeros(size + 1, dtype=torch.bool, device=device)
        if self.table is None:
            return tokens[1:], valid[1:]
        tokens[0], valid[0] = int(root_token), True
        table, written = self.table.to(device), self.written.to(device)
        for level in template.levels:
            parent = template.parents[level] + 1
            parent_tokens = tokens[parent]
            tokens[level + 1] = table[parent_tokens, template.ranks[level]]
            valid[level + 1] = valid[parent] & written[parent_tokens]
        return tokens[1:], valid[1:]

    def graft(self, tree: DraftTree, template: RankTemplate, slots: int) -> DraftTree:
        """Hang up to ``slots`` new retrieved nodes from ``tree``'s root, merging duplicates (DESIGN.md §4).

        Candidates are attached depth by depth with ``add_children``: a retrieved token equal to an
        existing child merges into it (costing no slot, its retrieved children hang below the existing
        node). The first ``slots`` candidates that made new nodes, in priority order, are kept, so
        every merge frees its slot for the next candidate. ``tree`` is grown in place; use the returned tree.
        """
        if slots <= 0 or template.size == 0:
            return tree
        tokens, valid = self.materialise(int(tree.tokens[0]), template)
        tokens, valid = tokens.to(tree.device), valid.to(tree.device)
        parents, ranks_prior = template.parents.to(tree.device), template.log_prior.to(tree.device)
        start = tree.num_nodes
        node = torch.full((template.size + 1,), -1, dtype=torch.long, device=tree.device)
        node[0] = 0
        for level in template.levels:
            level = level.to(tree.device)
            level = level[valid[level]]
            if level.numel() == 0:
                break  # every deeper candidate hangs from an invalid one
            at = node[parents[level] + 1]
            scores = tree.scores[at] + ranks_prior[level]
            node[level + 1] = tree.add_children(at, tokens[level], scores, ORIGIN_ADJACENCY)
        node = node[1:]
        is_new = node >= start
        surplus = is_new & (torch.cumsum(is_new.long(), 0) > slots)
        if not bool(surplus.any()):
            return tree
        keep = torch.ones(tree.num_nodes, dtype=torch.bool, device=tree.device)
        keep[node[surplus]] = False
        return tree.keep(keep)
