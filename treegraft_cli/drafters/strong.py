"""TreeDrafter: the strong model drafter of TreeGraft, one forward over a whole (growing) tree.

It extends ``ModelDrafter`` in two ways the layer loop needs:

- one forward covers the committed tokens the cache lacks (the root at least) *and* any set of tree
  nodes, even nodes whose ancestors are in the same batch; the first strong call of a step therefore
  costs one forward, not two;
- it keeps the log-probs of every node it forwarded this step (``logp_rows``, indexed by ``rows``), so a later
  call can rescore children the weak drafter hung under nodes forwarded earlier.

Cache layout and commit are ``ModelDrafter``'s: committed rows first, then this step's node rows.
"""

from __future__ import annotations

import torch

from ..lm import on_device_of
from ..tree import DraftTree
from .logp_rows import LogProbRows
from .model import ModelDrafter


class TreeDrafter(ModelDrafter):
    looks_ahead = True  # ``forward_ahead``: the next step's first call, before the host reads this step's verdict

    def __init__(self, lm):
        super().__init__(lm)
        self.logp_rows = LogProbRows()  # row 0 the root, then nodes in forward order
        self.root_length = -1  # committed length whose root row is row 0 (kept so a step can be drafted twice: collect)
        self.no_nodes = torch.zeros(0, dtype=torch.long, device=self.device)  # [0]: a forward of the pending tokens alone
        self.ahead: int | None = None  # the committed tokens ``forward_ahead`` forwarded before its block

    @property
    def logp(self) -> torch.Tensor:  # [rows, vocab] float32
        return self.logp_rows.view

    def reset(self) -> None:
        super().reset()
        self.root_length = -1
        self.ahead = None

    def rewind(self, length: int) -> None:
        """Forget every committed token forwarded past the first ``length``: a collection's probes call the drafter where
        the real policy may not, and their catch-up must not be the real policy's."""
        if length < self.committed_length:
            self.committed_length, self.root_length = length, -1
            self.crop_to_committed()
            self.logp_rows.keep(0)

    def start_step(self) -> None:
        """Drop the rows of an earlier draft of this step; nothing is forwarded until a call needs it."""
        self.calls = 0
        self.crop_to_committed()
        self.logp_rows.keep(0)

    def forward(
        self,
        committed: torch.Tensor,  # [L] committed tokens, root last
        tree: DraftTree | None,  # None when there are no nodes
        nodes: torch.Tensor,  # [m] node indices, forward order; each node's ancestors forwarded or earlier in ``nodes``
        rows: torch.Tensor | None,  # [num_nodes] log-prob row per node, -1 when none; updated in place (None: not kept)
        ancestor_mask: torch.Tensor | None,  # [num_nodes, num_nodes]; None: the tree's whole buffers (``node_mask``)
    ) -> range:
        """Forward the pending committed tokens and ``nodes`` in one pass; record slots and log-prob rows. Returns the
        log-prob row of each of ``nodes``, in order (consecutive: they are forwarded in that order)."""
        length = committed.shape[0]
        if self.committed_length == length and self.root_length == length and self.logp_rows.count == 0:
            self.logp_rows.keep(1)  # a redraft of this step: row 0 still holds its root
        p, m = length - self.committed_length, nodes.shape[0]
        pending = on_device_of(committed[self.committed_length :], self.device) if p else None
        if p + m == 0:
            if self.logp_rows.count and rows is not None:  # a redraft of this step's first call: the kept root row
                rows[0].fill_(0)
            return range(0)
        cache_length = self.lm.cache_length
        total = cache_length + p + m
        if m:
            mask = self.node_mask(tree, nodes, ancestor_mask, length, cache_length + p)
            if p:  # the pending rows first
                mask = torch.cat([self._pending_mask(p, total)[None, None], mask], dim=2)
            tokens = on_device_of(tree.buffer("tokens").index_select(0, nodes), self.device)
            positions = on_device_of(tree.buffer("depths").index_select(0, nodes) + (length - 1), self.device)
            if p:
                tokens = torch.cat([pending, tokens])
                positions = torch.cat([torch.arange(self.committed_length, length, device=self.device), positions])
        else:  # the pending tokens alone (a step's first call grafting under the root): a causal mask over them,
            # the model's own when the cache holds no row of this step
            mask = self._pending_mask(p, total) if self.committed_length < cache_length else None
            tokens = pending
            positions = torch.arange(self.committed_length, length, device=self.device)
        kept = m + (1 if p else 0)  # the root's row (last pending) and the nodes': never the prompt's
        logits = self.lm.forward(tokens, positions, logits_to_keep=kept, mask=mask)
        self.calls += 1
        self.committed_length = length
        if p:  # the root's row (the last pending) comes first: row 0
            self.logp_rows.keep(0)
            self.root_length = length
        first = self.logp_rows.append(logits) + (1 if p else 0)  # the nodes' first row
        if rows is not None:
            rows[0].fill_(0)
            if m:
                rows.index_copy_(0, nodes, torch.arange(first, first + m, device=rows.device))
        return range(first, first + m)

    def forward_ahead(
        self,
        committed: torch.Tensor,  # [L] this step's committed tokens, root last
        block: torch.Tensor,  # [b] what the step commits, then anything (``StepVerdict.committed_block``)
        accepted: torch.Tensor,  # [1] accepted nodes: the next root's index in ``block``
        k: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [1, k] twice
        """The next step's first call, made before the host knows how many tokens this step commits: drop this step's
        node rows, forward the pending committed tokens and the whole ``block`` (causal), keep the next root's
        log-prob row as row 0 and return its top-``k`` log-probs and tokens.

        The rows after the root see only rows before them, so they change nothing of it; ``settle_ahead`` crops them
        once the host has read the verdict. Costs a forward of ``b`` rows where the next step's first call would
        forward the few the drafter lacks (its node rows of the accepted path are forwarded again), and saves that
        call's read: the host reads this one with the verdict."""
        self.crop_to_committed()
        known = committed.shape[0] - self.committed_length  # committed tokens not forwarded yet (none after a look-ahead)
        tokens = on_device_of(block, self.device)
        root = on_device_of(accepted, self.device)  # [1] the root's row in the forward
        if known:
            tokens = torch.cat([on_device_of(committed[self.committed_length :], self.device), tokens])
            root = root + known
        positions = torch.arange(self.committed_length, self.committed_length + tokens.shape[0], device=self.device)
        logits = self.lm.forward(tokens, positions, logits_to_keep=root)  # [1, vocab]
        self.calls += 1
        self.ahead = known
        self.logp_rows.keep(0)
        self.logp_rows.append(logits)
        return torch.topk(self.logp_rows.view, k)

    def settle_ahead(self, num_accepted: int) -> None:
        """Keep ``forward_ahead``'s rows of the committed tokens (the known pending ones, ``num_accepted`` nodes' and the
        bonus's); the bonus is the next root, whose row 0 the next step keeps (a redraft's)."""
        self.committed_length += self.ahead + num_accepted + 1
        self.crop_to_committed()
        self.root_length = self.committed_length
        self.ahead = None

    def begin_step_logp(self, committed: torch.Tensor) -> torch.Tensor:  # committed: [L], root last -> [1, vocab]
        """The root's log-probs from the pending committed tokens forwarded as ``forward`` forwards them (row 0 of
        ``logp``, kept for a redraft of the step)."""
        self.forward(committed, None, self.no_nodes, None, None)
        return self.logp[:1]

    def _pending_mask(self, p: int, total: int) -> torch.Tensor:  # -> [p, total] additive
        """The pending committed tokens' rows: the committed rows, the cache rows of this step hidden (none at a
        step's first call), and the pending ones up to their own (causal)."""
        cache_length = self.lm.cache_length
        mask = torch.full((p, total), torch.finfo(self.lm.dtype).min, dtype=self.lm.dtype, device=self.device)
        mask.triu_(cache_length + 1)  # pending row i sits at cache row cache_length + i and sees every row up to it
        if self.committed_length < cache_length:
            mask[:, self.committed_length : cache_length] = torch.finfo(self.lm.dtype).min
        return mask
