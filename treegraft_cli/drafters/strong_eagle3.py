"""Eagle3TreeDrafter: an EAGLE-3 head as TreeGraft's strong drafter, with ``TreeDrafter``'s interface.

The layer loop (``grafting.builder``) asks its strong drafter for one thing per call: log-prob rows for the
root and a set of tree nodes, recorded in ``rows`` and ``logp``. A small LM (``TreeDrafter``) serves that in
one forward. An EAGLE-3 head cannot: a node's input feature is its parent's *output* feature, so a node
is never forwarded together with its parent. Here one strong call is therefore several head forwards:

- ``begin_step`` (one forward, the committed tokens with the target's own states) at the first call of a
  step only; it yields the root row;
- then one forward per tree depth among the nodes without a row (``Eagle3Drafter.forward_missing``).

``calls`` counts head forwards, as ``Eagle3Drafter`` does; a layer that calls may cost 1 + (depths spanned).

Steps the strong drafter never sees: ``commit`` runs after every verification (``TreeGraftMethod.observe``)
and keeps the target's states of the root and the accepted path, called or not; they pile up in ``pending``
and the next ``begin_step`` forwards them all in one go. Because a commit can come before the first
``begin_step``, ``reset`` takes the prefill's states at once (the engine starts a method right after the
prompt's prefill), where ``Eagle3Drafter`` waits for its first ``begin_step``.

A step drafted twice (``collect``'s counterfactual builds): ``begin_step`` runs once per committed context.
Its root row stays in the head's cache (the last committed row) and as row 0 of the per-row outputs;
``start_step`` crops the cache and those outputs back to it, so a redraft forwards tree nodes only.

Log-probs are float32 log-softmax over the *target* vocabulary. Tokens outside a reduced draft vocabulary
(the weak drafter proposes them too) get ``OUTSIDE_LOGP`` instead of -inf, so score arithmetic stays finite
(the cost-aware rule takes differences of scores).
"""

from __future__ import annotations

import torch

from ..lm import CausalLM, inference
from ..syncs import host_only
from ..tree import DraftTree
from .eagle3 import Eagle3Drafter
from .logp_rows import LogProbRows

OUTSIDE_LOGP = -1.0e4  # log-prob of a target token the head's draft vocabulary lacks (probability ~0)


class Eagle3TreeDrafter(Eagle3Drafter):
    """``committed_length`` counts committed head-cache rows, the root row included once ``begin_step`` ran."""

    looks_ahead = False  # its first call needs the target's hidden states of the committed tokens

    def __init__(self, lm: CausalLM, target: CausalLM):
        super().__init__(lm, target)
        self.logp_rows = LogProbRows(floor=OUTSIDE_LOGP)  # aligned with row_logits: row 0 the root
        self.root_length = -1  # committed length ``begin_step`` ran for (its root row is kept)

    @property
    def logp(self) -> torch.Tensor:  # [rows, vocab] float32
        return self.logp_rows.view

    def reset(self) -> None:
        super().reset()
        self.pending = self.target.last_hidden  # the prefill's states, or None: the first begin_step takes them
        self.root_length = -1
        self.logp_rows.keep(0)

    def rewind(self, length: int) -> None:
        """Not rewound: the head's catch-up replays the target's hidden states, which the step has already consumed."""

    def start_step(self) -> None:
        """Drop the node rows of an earlier draft of this step; keep its root row. Nothing is forwarded yet."""
        self.calls = 0
        self.crop_to_committed()
        self.row_logits, self.row_features = self.row_logits[:1], self.row_features[:1]
        self.logp_rows.keep(min(1, self.logp_rows.count))

    @inference
    def forward(
        self,
        committed: torch.Tensor,  # [L] committed tokens, root last
        tree: DraftTree,
        nodes: torch.Tensor,  # [m] node indices to forward (with any ancestor lacking a row)
        rows: torch.Tensor | None,  # [num_nodes] log-prob row per node, -1 when none; updated in place (None: not kept)
        ancestor_mask: torch.Tensor | None,  # [num_nodes, num_nodes]; None: the tree's own
    ) -> list[int]:
        """Root row (first call of a step), then ``nodes`` depth by depth; record slots, rows and log-probs. Returns
        the log-prob row of each of ``nodes``, in order."""
        length = committed.shape[0]
        if self.root_length != length:
            self.begin_step(committed)
            self.root_length = length
            self.logp_rows.keep(0)
            self.logp_rows.append(self._to_target(self.row_logits))  # the root row
        self.forward_missing(tree, nodes, tree.ancestor_mask() if ancestor_mask is None else ancestor_mask)
        fresh = self.row_logits[self.logp_rows.count :]
        if fresh.shape[0]:
            self.logp_rows.append(self._to_target(fresh))
        with host_only():  # the layer loop's tree and rows are host tensors
            if rows is not None:
                forwarded = tree.kv_slot >= 0
                rows.copy_(torch.where(forwarded, self._row_index(tree, torch.arange(tree.num_nodes)), rows))
                rows[0] = 0
            return self._row_index(tree, nodes).tolist()

    def commit(self, tree: DraftTree, path: torch.Tensor, forwarded: int | None = None) -> None:  # path: [m]
        if self.pending is None:
            raise RuntimeError("EAGLE-3 strong drafter: reset before the prompt's prefill, no target states to keep")
        super().commit(tree, path)
        self.root_length = -1
