"""Eagle3Drafter: an EAGLE-3 head drafting tree nodes through ModelDrafter's interface.

EAGLE pairs the feature of position t with the token at t + 1. Head cache row t holds
``(target state at committed[t], token committed[t + 1])`` at position t, so after ``begin_step``
the cache holds one row per committed token but the first, and the last row (the *root row*,
token = root) yields the root's logits. A tree node at depth d is forwarded at position
``committed_length - 1 + d`` with its parent's output feature (the root row's for depth 1), so a
node can only be forwarded after its parent; ``forward_nodes`` forwards missing ancestors first,
one tree depth per head call.

Where the target states come from: the drafter turns on hidden-state capture in the target's
CausalLM and reads ``target.last_hidden`` at two moments the engine fixes: at the first
``begin_step`` after ``reset`` (the target's last forward was the prompt's prefill) and at
``commit`` (its last forward was this step's verification, one row per tree node); it keeps the
rows of the root and the accepted path only. ``commit`` drops every tree row from the head's
cache and the next ``begin_step`` forwards the accepted tokens and the bonus again, now with the
target's own states in place of the head's guesses, as the EAGLE reference implementation does.
So, unlike a small-LM drafter, this one needs ``commit`` after every verification (it is where the
accepted path's states are kept); accepted nodes it never forwarded (another drafter's) are fine.
"""

from __future__ import annotations

import torch

from ..lm import CausalLM, additive_mask, inference
from ..models.eagle3 import aux_hidden_indices
from ..models.eagle3_head import Eagle3Head
from ..syncs import uncounted
from ..tree import DraftTree
from .model import ModelDrafter


def _tree_visibility(
    tree: DraftTree,
    nodes: torch.Tensor,  # [m] node indices, their kv_slot already set
    ancestor_mask: torch.Tensor,  # [num_nodes, num_nodes]
    first_row: int,  # the first cache row a tree node may hold (rows before it are committed)
    end_row: int,  # cache rows after the forward (the nodes' own rows included)
) -> torch.Tensor:  # [m, end_row - first_row] bool, on the tree's device
    """Which of the rows ``first_row..end_row`` each of ``nodes`` sees: its ancestors' and its own.

    Nodes without a row point at one extra scratch column, dropped at the end: no data-dependent indexing.
    """
    m, width = nodes.shape[0], end_row - first_row
    visible = torch.zeros(m, width + 1, dtype=torch.bool, device=ancestor_mask.device)
    slots = torch.where(tree.kv_slot >= 0, tree.kv_slot - first_row, width)  # [num_nodes]
    visible.scatter_(1, slots[None, :].expand(m, -1), ancestor_mask[nodes])
    return visible[:, :width]


class Eagle3Drafter(ModelDrafter):
    """``committed_length`` counts committed cache rows (committed tokens minus one after ``begin_step``)."""

    name = "eagle3"
    forwards_blocks = False  # a node's forward reads its parent's features: it needs the tree

    def __init__(self, lm: CausalLM, target: CausalLM):
        super().__init__(lm)
        self.head: Eagle3Head = lm.model
        self.target = target
        layers = target.model.config.get_text_config().num_hidden_layers
        target.capture_hidden_states(aux_hidden_indices(self.head.config, layers))
        self.draft_to_target = self.head.draft_to_target  # [draft_vocab]
        self.vocab_size = self.head.config.vocab_size
        self.identity_vocab = self.draft_to_target.numel() == self.vocab_size and bool((self.head.d2t == 0).all())
        self.pending: torch.Tensor | None = None  # [p, 3 * target_hidden] states of committed tokens without a row
        # per row from the root row on (index = cache row - (committed_length - 1)): head outputs
        self.row_logits = torch.empty(0)  # [rows, draft_vocab]
        self.row_features = torch.empty(0)  # [rows, hidden]

    def reset(self) -> None:
        super().reset()
        self.pending = None  # None: the first begin_step takes the prefill's states

    @inference
    def begin_step(self, committed: torch.Tensor) -> torch.Tensor:  # committed: [L], root last
        """Forward the committed tokens without a row, with the target's states; return the root's logits ``[vocab]``."""
        self.calls = 0
        self.crop_to_committed()
        states = self._take_pending(committed)
        start = self.committed_length
        tokens = committed[start + 1 :].to(self.device)  # [n] token t + 1 pairs with the state at t
        n = tokens.shape[0]
        positions = torch.arange(start, start + n, device=self.device)
        visible = torch.ones(n, start + n, dtype=torch.bool, device=self.device).tril(diagonal=start)
        # the target's states come from its layers' devices: the head reads them on its own
        logits, features = self._forward(tokens, self.head.fuse(states.to(self.device)), positions, visible)
        self.committed_length += n
        self.row_logits, self.row_features = logits[-1:], features[-1:]
        return self._to_target(logits[-1:])[0]

    @inference
    def forward_nodes(
        self,
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices
        ancestor_mask: torch.Tensor | None = None,  # [num_nodes, num_nodes]; the tree's own when absent
        ancestors_forwarded: bool = False,
    ) -> torch.Tensor:
        """Logits ``[m, vocab]`` at ``nodes``; forwards them, and any ancestor not yet forwarded, depth by depth.

        ``ancestors_forwarded``: the caller knows ``nodes`` share one depth and every ancestor has a row (a
        dense drafter's frontier): one head call, no read of what is missing.
        """
        if ancestor_mask is None:
            ancestor_mask = tree.ancestor_mask()
        if ancestors_forwarded:
            self._forward_level(tree, nodes, ancestor_mask)
        else:
            self.forward_missing(tree, nodes, ancestor_mask)
        return self._to_target(self.row_logits[self._row_index(tree, nodes).to(self.device)])

    def forward_block(self, tokens: torch.Tensor, depth: int, lineage: torch.Tensor) -> torch.Tensor:
        raise TypeError("an EAGLE-3 head forwards nodes from their parents' features: use forward_nodes with the tree")

    def forward_missing(
        self,
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices
        ancestor_mask: torch.Tensor,  # [num_nodes, num_nodes]
    ) -> None:
        """Forward ``nodes`` and their ancestors that have no row yet, shallowest depth first, one head call per depth."""
        needed = ancestor_mask[nodes].any(dim=0) & (tree.kv_slot < 0)
        needed[0].fill_(False)  # the root's row is the last committed row
        # how many nodes each depth needs: one read (none on a host tree), then one head call per depth
        per_depth = torch.zeros(tree.num_nodes, dtype=torch.long, device=tree.device)
        per_depth.scatter_add_(0, tree.depths, needed.long())
        counts = tree._read(per_depth)
        for depth, count in enumerate(counts):
            if count:
                level = torch.sort((~(needed & (tree.depths == depth))).byte(), stable=True).indices[:count]
                self._forward_level(tree, level, ancestor_mask)

    def commit(self, tree: DraftTree, path: torch.Tensor, forwarded: int | None = None) -> None:  # path: [m]
        """Keep the target's states of the root and the accepted ``path`` (node indices, root excluded); drop this
        step's tree rows (``forwarded`` is a small LM drafter's concern: a head keeps no accepted rows)."""
        states = self.target.last_hidden
        if states is None or states.shape[0] != tree.num_nodes:
            raise RuntimeError("EAGLE-3 drafter: the target's last forward was not this tree's verification")
        accepted = torch.cat([torch.zeros(1, dtype=torch.long, device=path.device), path]).to(states.device)
        self.pending = torch.cat([self.pending, states[accepted]])
        self.crop_to_committed()

    def _take_pending(self, committed: torch.Tensor) -> torch.Tensor:  # -> [n, 3 * target_hidden]
        states = self.target.last_hidden if self.pending is None else self.pending
        needed = committed.shape[0] - 1 - self.committed_length
        if needed < 1:
            raise RuntimeError("EAGLE-3 drafter: begin_step again without a commit in between")
        if states is None or states.shape[0] != needed:
            have = 0 if states is None else states.shape[0]
            raise RuntimeError(f"EAGLE-3 drafter holds target states for {have} tokens, needs {needed}: commit every step")
        self.pending = states[:0]
        return states

    def _forward_level(self, tree: DraftTree, level: torch.Tensor, ancestor_mask: torch.Tensor) -> None:
        """Forward nodes of one depth whose ancestors all have rows; record their rows and outputs."""
        cache_length = self.lm.cache_length
        m = level.shape[0]
        tree.kv_slot[level] = torch.arange(cache_length, cache_length + m, device=tree.device)
        visible = torch.ones(m, cache_length + m, dtype=torch.bool, device=self.device)
        visible[:, self.committed_length :] = _tree_visibility(
            tree, level, ancestor_mask, self.committed_length, cache_length + m
        ).to(self.device)
        features = self.row_features[self._row_index(tree, tree.parents[level]).to(self.device)]
        positions = (self.committed_length - 1 + tree.depths[level]).to(self.device)
        logits, out = self._forward(tree.tokens[level].to(self.device), features, positions, visible)
        self.row_logits = torch.cat([self.row_logits, logits])
        self.row_features = torch.cat([self.row_features, out])

    def _row_index(self, tree: DraftTree, nodes: torch.Tensor) -> torch.Tensor:  # [m] -> [m]
        """Index into the per-row outputs: 0 for the root, cache row - root row for forwarded nodes."""
        slots = torch.where(nodes == 0, self.committed_length - 1, tree.kv_slot[nodes])
        return slots - (self.committed_length - 1)

    def _forward(
        self,
        tokens: torch.Tensor,  # [n]
        features: torch.Tensor,  # [n, hidden]
        positions: torch.Tensor,  # [n]
        visible: torch.Tensor,  # [n, cache_length + n] bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with uncounted():
            logits, out = self.head(tokens, features, positions, additive_mask(visible, self.head.dtype), self.lm.cache)
        self.lm.forward_calls += 1
        self.calls += 1
        return logits, out

    def _to_target(self, logits: torch.Tensor) -> torch.Tensor:  # [m, draft_vocab] -> [m, vocab]
        """Spread draft-vocabulary logits over the target vocabulary; tokens outside it get -inf."""
        if self.identity_vocab:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full
