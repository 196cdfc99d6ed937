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
    def __init__(self, k: int, device: torch.device | str | None = None):
        """``device``: where trees are grafted (the table lives there; written rows move to it). None: where
        the first logits written are."""
        self.k = k
        self.device = None if device is None else torch.device(device)
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
        rank: torch.Tensor | None = None,  # [n] write order when not the positions' (a higher rank writes later)
    ) -> None:
        """``M[tokens[i]] = top-k(logits[i])`` for every i; the last write of a repeated token wins.

        No data-dependent shapes: rows that a later write of the same token overrides go to a scratch row.
        """
        if tokens.numel() == 0:
            return
        self._allocate(logits)
        tokens = tokens.to(self.table.device).long()
        n = tokens.shape[0]
        if rank is None:
            rank = torch.arange(n, device=tokens.device)
        rank = rank.to(tokens.device)
        overridden = ((tokens[:, None] == tokens[None, :]) & (rank[None, :] > rank[:, None])).any(dim=1)
        rows = torch.where(overridden, self.table.shape[0], tokens)  # [n]; the scratch row past the table
        top = torch.topk(logits, self.k, dim=-1).indices.to(self.table.device)
        self._rows.index_copy_(0, rows, top)
        self._written.index_fill_(0, rows, True)

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
        n = tree.num_nodes
        path = torch.cat([torch.zeros(1, dtype=torch.long, device=device), path.to(device)])
        # node order, then the root and the accepted nodes in path order after every other node
        rank = torch.arange(n, device=device).index_copy(0, path, n + torch.arange(path.shape[0], device=device))
        self.write(tree.tokens, logits, rank)

    def _allocate(self, logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], self.device or logits.device
        if self.table is None or self.table.shape[0] < vocab:
            # one scratch row past the vocabulary takes the writes a later one overrides
            self._rows = torch.zeros(vocab + 1, self.k, dtype=torch.long, device=device)
            self._written = torch.zeros(vocab + 1, dtype=torch.bool, device=device)
            self.table, self.written = self._rows[:vocab], self._written[:vocab]

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

        Candidates are resolved depth by depth: a retrieved token equal to an existing child merges into
        it (costing no slot, its retrieved children hang below the existing node, its score becomes the
        higher of the two). The first ``slots`` candidates that make new nodes, in priority order, are
        kept, so every merge frees its slot for the next candidate. Candidates of one depth never repeat
        one another (their parents are distinct nodes, or one parent's distinct table ranks), so only
        merges with the tree's own nodes are looked for. ``tree`` is grown in place; use the returned tree.
        One read: how many new nodes there are.
        """
        if slots <= 0 or template.size == 0 or self.table is None:
            return tree
        device, n, size = tree.device, tree.num_nodes, template.size
        table, written = self.table.to(device), self.written.to(device)
        parents = template.parents.to(device) + 1
        existing = tree.parents * (1 << 32) + tree.tokens  # [n] keys (parent, token)
        # per candidate (slot 0 the root): token, valid, resolved node (existing index, or n + slot - 1 if new)
        tokens = torch.zeros(size + 1, dtype=torch.long, device=device)
        tokens[:1] = tree.tokens[:1]
        valid = torch.zeros(size + 1, dtype=torch.bool, device=device)
        valid[0] = True
        node = torch.zeros(size + 1, dtype=torch.long, device=device)
        score = torch.zeros(size + 1, device=device)
        score[:1] = tree.scores[:1]
        scores = torch.cat([tree.scores, tree.scores.new_full((1,), float("-inf"))])  # [n + 1], n: scratch
        for level, slot, parent, rank, prior in template.level_columns(device):
            parent_tokens = tokens[parent]
            tokens[slot] = table[parent_tokens, rank]
            valid[slot] = valid[parent] & written[parent_tokens]
            if n == 1:  # a bare root: nothing to merge into, every candidate is new
                score[slot] = score[parent] + prior
                node[slot] = n + level
                continue
            parent_node = node[parent]
            parent_score = torch.where(parent_node < n, scores[parent_node.clamp(max=n)], score[parent])
            score[slot] = parent_score + prior
            same = (parent_node * (1 << 32) + tokens[slot])[:, None] == existing[None, :]  # [l, n]
            merged = same.any(dim=1) & valid[slot]
            match = same.byte().argmax(dim=1)
            node[slot] = torch.where(merged, match, n + level)
            scores.scatter_reduce_(0, torch.where(merged, match, n), score[slot], reduce="amax")
        if n > 1:
            tree.scores = scores[:n]
        is_new = valid[1:] & (node[1:] >= n)  # [size] in priority order
        kept = is_new & (torch.cumsum(is_new, 0) <= slots)
        count = int(tree._read(kept.sum()))
        if count == 0:
            return tree
        depths = template.depths.to(device)
        order = torch.sort(torch.where(kept, depths, depths.max() + 1), stable=True).indices[:count]  # depth order
        final = torch.arange(n + size, device=device)  # resolved node → index in the grown tree
        final[n + order] = n + torch.arange(count, device=device)
        tree._reserve(count)
        tree._write(n, final[node[parents[order]]], tokens[order + 1], score[order + 1], ORIGIN_ADJACENCY,
                    generations=len(template.levels))
        return tree
