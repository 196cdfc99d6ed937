"""DraftTree: the candidate tokens of one step, held as tensors.

Node 0 is the root (the last committed token). Nodes are stored parents-before-children, siblings
have distinct tokens, and every tree builder grows the tree in batches of children so no per-node
Python runs on the hot path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Which drafter proposed a node (the ``origin`` column).
ORIGIN_ROOT = 0
ORIGIN_MODEL = 1
ORIGIN_NGRAM = 2
ORIGIN_ADJACENCY = 3
ORIGIN_NAMES = {ORIGIN_ROOT: "root", ORIGIN_MODEL: "model", ORIGIN_NGRAM: "ngram", ORIGIN_ADJACENCY: "adjacency"}


@dataclass
class DraftTree:
    """A draft tree. All columns are 1-D tensors of length ``num_nodes`` (root included).

    ``kv_slot`` is the cache position of the node's row in the model drafter's KV cache, or -1 when the
    model drafter never ran a forward over the node; it lets the drafter commit its own cache.
    """

    tokens: torch.Tensor  # [num_nodes] int64
    parents: torch.Tensor  # [num_nodes] int64, -1 for the root
    depths: torch.Tensor  # [num_nodes] int64, 0 for the root
    scores: torch.Tensor  # [num_nodes] float32, cumulative log-prob; 0 for the root
    origins: torch.Tensor  # [num_nodes] int8
    kv_slot: torch.Tensor  # [num_nodes] int64

    @classmethod
    def from_root(cls, root_token: int, device: torch.device | str = "cpu") -> DraftTree:
        def column(value, dtype):
            return torch.tensor([value], dtype=dtype, device=device)

        return cls(
            tokens=column(int(root_token), torch.long),
            parents=column(-1, torch.long),
            depths=column(0, torch.long),
            scores=column(0.0, torch.float32),
            origins=column(ORIGIN_ROOT, torch.int8),
            kv_slot=column(-1, torch.long),
        )

    @property
    def num_nodes(self) -> int:
        """Nodes including the root."""
        return self.tokens.shape[0]

    @property
    def size(self) -> int:
        """Non-root nodes: what counts against the budget."""
        return self.num_nodes - 1

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    @property
    def max_depth(self) -> int:
        return int(self.depths.max())

    def add_children(
        self,
        parents: torch.Tensor,  # [m] node indices
        tokens: torch.Tensor,  # [m]
        scores: torch.Tensor,  # [m]
        origin: int,
        rescore: bool = False,
    ) -> torch.Tensor:
        """Append children; a (parent, token) pair that already exists or repeats is not added.

        Returns the node index of every requested child ([m]): new nodes get new indices, duplicates
        get the index of the node they merged into. A merged node keeps the higher of its two scores,
        or with ``rescore`` takes the new score (the strong drafter's word replaces the weak one's).
        """
        parents, tokens = parents.long(), tokens.long()
        keys = self._keys(parents, tokens)
        existing = self._keys(self.parents, self.tokens)
        # first occurrence of each key among the new ones, and match against the existing nodes
        unique_keys, inverse = torch.unique(keys, return_inverse=True)
        in_tree = torch.isin(unique_keys, existing)
        first = torch.full_like(unique_keys, keys.numel()).scatter_reduce(
            0, inverse, torch.arange(keys.numel(), device=keys.device), reduce="amin"
        )
        new_first = first[~in_tree]
        new_first = new_first.sort().values  # keep request order
        self.tokens = torch.cat([self.tokens, tokens[new_first]])
        self.parents = torch.cat([self.parents, parents[new_first]])
        self.depths = torch.cat([self.depths, self.depths[parents[new_first]] + 1])
        self.scores = torch.cat([self.scores, scores[new_first].float()])
        self.origins = torch.cat([self.origins, torch.full_like(new_first, origin, dtype=torch.int8)])
        self.kv_slot = torch.cat([self.kv_slot, torch.full_like(new_first, -1)])
        # map every request to its node
        all_keys = self._keys(self.parents, self.tokens)
        order = torch.argsort(all_keys)
        position = torch.searchsorted(all_keys[order], keys)
        node = order[position]
        if rescore:  # touched nodes forget their old score and take the (best) new one
            self.scores[node] = float("-inf")
        self.scores.scatter_reduce_(0, node, scores.float(), reduce="amax")
        return node

    def _keys(self, parents: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        # parent index and token packed into one int64 (token ids < 2**32)
        return (parents + 1) * (1 << 32) + tokens

    def children_of(self, node: int) -> torch.Tensor:
        return torch.nonzero(self.parents == node).flatten()

    def keep(self, keep: torch.Tensor) -> DraftTree:
        """A new tree with the nodes where ``keep`` ([num_nodes] bool) is set; must be prefix-closed."""
        keep = keep.clone()
        keep[0] = True
        kept = torch.nonzero(keep).flatten()
        new_index = torch.full((self.num_nodes,), -1, dtype=torch.long, device=self.device)
        new_index[kept] = torch.arange(kept.numel(), device=self.device)
        parents = self.parents[kept]
        new_parents = torch.where(parents >= 0, new_index[parents.clamp(min=0)], parents)
        if bool((new_parents[1:] < 0).any()):
            raise ValueError("DraftTree.keep: the kept set is not prefix-closed")
        return DraftTree(
            tokens=self.tokens[kept],
            parents=new_parents,
            depths=self.depths[kept],
            scores=self.scores[kept],
            origins=self.origins[kept],
            kv_slot=self.kv_slot[kept],
        )

    def top_by_score(self, budget: int) -> DraftTree:
        """The ``budget`` best non-root nodes by score, prefix-closed.

        A child's cumulative log-prob never exceeds its parent's, and a stable sort keeps a parent
        (lower index) ahead of an equal-scored child, so the top set is prefix-closed.
        """
        if self.size <= budget:
            return self
        order = torch.sort(self.scores[1:], descending=True, stable=True).indices + 1
        keep = torch.zeros(self.num_nodes, dtype=torch.bool, device=self.device)
        keep[order[:budget]] = True
        return self.keep(self.close_over_ancestors(keep, limit=budget))

    def close_over_ancestors(self, keep: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """Add every ancestor of a kept node; with ``limit``, the result must fit it (checked)."""
        keep = keep.clone()
        keep[0] = True
        for _ in range(self.max_depth):
            parent_kept = keep.clone()
            parent_kept[self.parents[keep].clamp(min=0)] = True
            if torch.equal(parent_kept, keep):
                break
            keep = parent_kept
        if limit is not None and int(keep.sum()) - 1 > limit:
            raise ValueError(f"closing over ancestors grew the tree past its budget {limit}")
        return keep

    def ancestor_mask(self) -> torch.Tensor:
        """[num_nodes, num_nodes] bool: ``mask[i, j]`` iff j is i or an ancestor of i."""
        n = self.num_nodes
        mask = torch.eye(n, dtype=torch.bool, device=self.device)
        # parents come before children, so one pass per depth fills every row from its parent's row
        for depth in range(1, self.max_depth + 1):
            rows = torch.nonzero(self.depths == depth).flatten()
            mask[rows] |= mask[self.parents[rows]]
        return mask

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root's first child down to ``node`` (root excluded)."""
        path = []
        parents = self.parents.tolist()
        while node > 0:
            path.append(node)
            node = parents[node]
        return path[::-1]

    def validate(self, budget: int | None = None) -> None:
        """Raise if an invariant is broken: used by tests and by builders in debug runs."""
        n = self.num_nodes
        if budget is not None and self.size > budget:
            raise AssertionError(f"tree has {self.size} nodes, budget {budget}")
        if int(self.parents[0]) != -1:
            raise AssertionError("node 0 must be the root")
        idx = torch.arange(n, device=self.device)
        if n > 1 and bool((self.parents[1:] >= idx[1:]).any() | (self.parents[1:] < 0).any()):
            raise AssertionError("parents must come before children")
        if n > 1 and bool((self.depths[1:] != self.depths[self.parents[1:]] + 1).any()):
            raise AssertionError("depth must be parent depth + 1")
        keys = self._keys(self.parents, self.tokens)
        if torch.unique(keys).numel() != n:
            raise AssertionError("siblings must have distinct tokens")
