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

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..hostlists import longs
from ..lm import on_device_of
from ..tree import ORIGIN_ADJACENCY, DraftTree
from .rank_template import RankTemplate

# (successors, tree tokens, tree parents, tree scores, template, slots, tree depth) -> tokens, node, scores, kept, count
GraftCandidates = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
# (tokens, node, scores, kept, template, count) -> parents, tokens, scores, depths, inside
AppendedNodes = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class PendingGraft:
    """A graft worked out on the device, waiting for one number: how many new nodes it makes (``count``)."""

    tree: DraftTree  # the tree to grow (untouched until ``AdjacencyTable.finish``)
    template: RankTemplate
    tokens: torch.Tensor  # [size + 1] each candidate's token, slot 0 the root
    node: torch.Tensor  # [size + 1] the node each candidate resolves to
    scores: torch.Tensor  # [n + size] by resolved node, merges raised
    kept: torch.Tensor  # [size] bool: the new candidates that fit the slots
    count: torch.Tensor  # [] float32: how many are kept (read together with a score)


class AdjacencyTable:
    def __init__(
        self,
        k: int,
        device: torch.device | str | None = None,
        candidates: GraftCandidates | None = None,
        appended: AppendedNodes | None = None,
    ):
        """``device``: where trees are grafted (the table lives there; written rows move to it). None: where
        the first logits written are. ``candidates`` and ``appended``: how a graft's candidates are worked out and
        its new nodes laid out, ``graft_candidates`` and ``appended_nodes`` (the defaults) or their kernels (as a
        ``VerifyBackend`` picks)."""
        self.k = k
        self.candidates = candidates or graft_candidates
        self.appended = appended or appended_nodes
        self.device = None if device is None else torch.device(device)
        # [vocab + 2, k], allocated at the first write: the table, a scratch row (vocab) that takes the writes a later
        # one overrides, and a sentinel token's (vocab + 1) row of sentinels. Every unwritten row holds sentinels, so
        # grafting follows the table without tracking which rows were written.
        self._successors: torch.Tensor | None = None

    def reset(self) -> None:
        """Forget every row."""
        self._successors = None

    @property
    def table(self) -> torch.Tensor | None:  # [vocab, k] int64: the sentinel (vocab + 1) in unwritten rows
        return None if self._successors is None else self._successors[: self._successors.shape[0] - 2]

    @property
    def written(self) -> torch.Tensor | None:  # [vocab] bool
        table = self.table
        return None if table is None else table[:, 0] != table.shape[0] + 1

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

        No data-dependent shapes: rows that a later write of the same token overrides go to a scratch row. Ranks are
        distinct, so each token's highest (one scatter into a buffer entry per token) picks its one winning write.
        """
        if tokens.shape[0] == 0:
            return
        self._allocate(logits)
        device = self._successors.device
        tokens = on_device_of(tokens if tokens.dtype == torch.long else tokens.long(), device)
        rank = torch.arange(tokens.shape[0], device=device) if rank is None else on_device_of(rank, device)
        # entries of the tokens not written here keep older values: only this write's tokens are read back
        latest = self._latest.scatter_reduce_(0, tokens, rank, reduce="amax", include_self=False)  # [vocab + 1]
        overridden = latest.index_select(0, tokens) != rank  # [n]
        rows = torch.where(overridden, self._successors.shape[0] - 2, tokens)  # [n]; the scratch row past the table
        top = on_device_of(torch.topk(logits, self.k, dim=-1).indices, device)
        self._successors.index_copy_(0, rows, top)

    def write_prompt(
        self,
        prompt_ids: torch.Tensor,  # [prompt_length]
        logits: torch.Tensor,  # [prompt_length, vocab] target prefill logits
    ) -> None:
        self.write(prompt_ids, logits)

    def write_verified(
        self,
        tree: DraftTree,
        root_path: list[int],  # [a + 1] the root and the accepted node indices, root first (the host's)
        logits: torch.Tensor,  # [num_nodes, vocab] target logits at every tree node
    ) -> None:
        """Write every verified node; the root and the accepted path last, so their rows win."""
        n = tree.num_nodes
        # node order, then the root and the accepted nodes after every other node: in path order, since nodes are
        # stored parents first (ranked on the host, where the path is: one copy instead of three device calls)
        rank = list(range(n))
        for node in root_path:
            rank[node] += n
        self.write(tree.tokens, logits, on_device_of(longs(rank), tree.device))

    def _allocate(self, logits: torch.Tensor) -> None:
        vocab, device = logits.shape[-1], self.device or logits.device
        if self._successors is None or self._successors.shape[0] < vocab + 2:
            self._latest = torch.zeros(vocab + 1, dtype=torch.long, device=device)  # ``write``'s scratch: rank by token
            self._successors = torch.full((vocab + 2, self.k), vocab + 1, dtype=torch.long, device=device)

    def materialise(
        self, root_token: int, template: RankTemplate
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens ``[S]`` of every template candidate grown from ``root_token``, and which are valid ``[S]``.

        One batched gather per depth: ``x_u = M[x_parent(u), r_u]``. A candidate is valid when its parent's row was
        written (an unwritten row, and so every candidate below it, holds the sentinel token); invalid candidates'
        tokens are the sentinel.
        """
        device = template.parents.device
        size = template.size
        tokens = torch.zeros(size + 1, dtype=torch.long, device=device)  # slot 0 is the root
        if self._successors is None:
            return tokens[1:], torch.zeros(size, dtype=torch.bool, device=device)
        tokens[0] = int(root_token)
        successors = self._successors.to(device)
        for level in template.levels:
            tokens[level + 1] = successors[tokens[template.parents[level] + 1], template.ranks[level]]
        return tokens[1:], tokens[1:] != successors.shape[0] - 1

    def graft(self, tree: DraftTree, template: RankTemplate, slots: int, depth: int | None = None) -> DraftTree:
        """Hang up to ``slots`` new retrieved nodes from ``tree``'s root, merging duplicates (DESIGN.md §4).

        Candidates are resolved depth by depth: a retrieved token equal to an existing child merges into
        it (costing no slot, its retrieved children hang below the existing node, its score becomes the
        higher of the two). The first ``slots`` candidates that make new nodes, in priority order, are
        kept, so every merge frees its slot for the next candidate. Candidates of one depth never repeat
        one another (their parents are distinct nodes, or one parent's distinct table ranks), so only
        merges with the tree's own nodes are looked for. ``tree`` is grown in place; use the returned tree.
        One read: how many new nodes there are. ``depth``: a bound on ``tree``'s depth when the caller knows it
        (candidates deeper than every node cannot merge: their depths skip the search for a match).
        """
        pending = self.prepare(tree, template, slots, depth)
        if pending is None:
            return tree
        return self.finish(pending, int(tree._read(pending.count)))

    def prepare(self, tree: DraftTree, template: RankTemplate, slots: int, depth: int | None = None) -> PendingGraft | None:
        """``graft``'s device work, without its read and without touching ``tree``; None when nothing can be
        grafted. A caller may read ``count`` together with other values, then ``finish``."""
        if slots <= 0 or template.size == 0 or self._successors is None:
            return None
        successors = on_device_of(self._successors, tree.device)
        tree_depth = len(template.levels) if depth is None else depth
        tokens, node, scores, kept, count = self.candidates(
            successors, tree.tokens, tree.parents, tree.scores, template, slots, tree_depth
        )
        return PendingGraft(tree, template, tokens, node, scores, kept, count)

    def finish(self, pending: PendingGraft, count: int) -> DraftTree:
        """Grow ``pending.tree`` by the ``count`` kept candidates (``pending.count`` read) and its merges' scores."""
        tree = pending.tree
        n = tree.num_nodes
        if n > 1:
            tree.scores = pending.scores[:n]
        if count == 0:
            return tree
        parents, tokens, scores, depths, inside = self.appended(
            pending.tokens, pending.node, pending.scores, pending.kept, pending.template, count
        )
        tree._reserve(count)
        tree._write(n, parents, tokens, scores, ORIGIN_ADJACENCY, depth=depths, inside=inside)
        return tree


def graft_candidates(
    successors: torch.Tensor,  # [vocab + 2, k] the table, its scratch row, and the sentinel token's row of sentinels
    tree_tokens: torch.Tensor,  # [n]
    tree_parents: torch.Tensor,  # [n] -1 for the root
    tree_scores: torch.Tensor,  # [n] float32, the root's 0
    template: RankTemplate,
    slots: int,  # the most new nodes kept
    tree_depth: int,  # no node of the tree is deeper
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every template candidate grown from the tree's root, resolved against the tree: ``(tokens [S + 1], node
    [S + 1], scores [n + S], kept [S], count [])`` as ``PendingGraft`` holds them (slot 0 the root).

    A candidate's token is ``successors[parent's token, rank]``; it resolves to the existing child of its parent's
    node with that token (the lowest index when several match), else to the new node ``n + candidate index``. Its
    score is its parent node's score plus its log prior (float32); a merge raises the existing node's score to the
    higher of the two, before the depth below reads it. ``kept``: the valid new candidates, in priority order, up
    to ``slots``. The torch reference of ``kernels.graft_candidates.graft_candidates``.
    """
    n, device, size = tree_tokens.shape[0], tree_tokens.device, template.size
    invalid = successors.shape[0] - 1  # the sentinel token: some row on the way was never written
    # per candidate (slot 0 the root): token, then the resolved node: an existing index, or n + slot - 1 if new
    # (every candidate's token is written below: only the root's matters here)
    tokens = tree_tokens[:1].repeat(size + 1)
    node = template.fresh_slots(device, n).clone()  # every candidate new until it merges (``_resolve``)
    # scores by resolved node: the tree's nodes, then every candidate's own (a merged one's too), all written in
    # ``_resolve``: the memoised root scores only fill the room, and are every score under a bare root
    scores = torch.cat([tree_scores, template.root_scores(device)])  # [n + size]
    if n == 1:  # a bare root: nothing to merge into, every candidate is new and scored by its priors alone
        chained, _ = _chains(successors, template, device, 1, tokens[:1], None)
        tokens.index_copy_(0, template.tail(device, n, 1)[0], chained)
    else:
        levels = template.fresh_levels(device, n)
        _resolve(tree_tokens, tree_parents, template, tokens, node, scores, successors, levels, tree_depth)
    is_new = ((tokens != invalid) & (node >= n))[1:]  # [size] valid new candidates, in priority order
    kept = is_new & (torch.cumsum(is_new, 0) <= slots)
    return tokens, node, scores, kept, kept.sum(dtype=torch.float32)


def appended_nodes(
    tokens: torch.Tensor,  # [S + 1] each candidate's token, slot 0 the root
    node: torch.Tensor,  # [S + 1] the node each candidate resolves to
    scores: torch.Tensor,  # [n + S] by resolved node
    kept: torch.Tensor,  # [S] bool
    template: RankTemplate,
    count: int,  # kept candidates (``kept``'s sum, read)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kept candidates as the nodes a graft appends to a tree of ``n`` nodes, by depth, then priority (so
    parents come first): ``(parents [count], tokens [count], scores [count], depths [count], inside [count, count])``,
    ``inside`` their ancestry among themselves (uint8, self included). A kept candidate's ancestors are merged
    (existing nodes) or kept: earlier in priority order, they are new and valid whenever it is. The torch reference
    of ``kernels.graft_candidates.appended_nodes``."""
    size = template.size
    n, device = scores.shape[0] - size, scores.device
    by_depth = torch.sort(torch.where(kept, template.fresh_depths(device), size + 1), stable=True)
    order, depths = by_depth.indices[:count], by_depth.values[:count]  # the kept candidates, in depth order
    final = torch.arange(n + size, device=device)  # resolved node → index in the grown tree
    final[n:].index_copy_(0, order, torch.arange(n, n + count, device=device))
    inside = template.ancestry_on(device).index_select(0, order).index_select(1, order)  # [count, count]
    # gathers by index_select on offset views: cheaper on the host than indexing with a tensor, or offsetting one
    parents = final.index_select(0, node.index_select(0, template.parent_slots_on(device).index_select(0, order)))
    return parents, tokens[1:].index_select(0, order), scores[n:].index_select(0, order), depths, inside


def _resolve(
    tree_tokens: torch.Tensor,  # [n]
    tree_parents: torch.Tensor,  # [n]
    template: RankTemplate,
    tokens: torch.Tensor,  # [size + 1] filled here, slot 0 the root
    node: torch.Tensor,  # [size + 1] each candidate's new node index; a merging one's replaced here
    scores: torch.Tensor,  # [n + size] existing nodes' scores (merges raise them), candidates' filled here
    successors: torch.Tensor,  # [vocab + 2, k]
    fresh_levels: tuple[tuple[torch.Tensor, ...], ...],  # ``RankTemplate.fresh_levels``
    tree_depth: int,  # no node of ``tree`` is deeper
) -> None:
    """Depth by depth: each candidate's token, and the node it resolves to, merging into an existing child.

    A candidate merges only into an existing node of its own depth: past ``tree_depth`` every one is new. Two
    depths past the tree's every parent is new too, so those depths follow from the one above alone
    (``_chains``) and are written at once."""
    n, device = tree_tokens.shape[0], tree_tokens.device
    columns = template.level_columns(device)
    existing = torch.add(tree_tokens, tree_parents, alpha=1 << 32)[None, :]  # [1, n] keys (parent, token)
    indices = torch.arange(n, device=device)
    resolving = min(tree_depth + 1, len(columns))  # the depths whose parents may be existing nodes
    levels = zip(columns[:resolving], fresh_levels, strict=False)
    for depth, ((_, slot, parent, rank, prior), (fresh, fresh_column, _)) in enumerate(levels, start=1):
        parent_node = node.index_select(0, parent)
        token = successors[tokens.index_select(0, parent), rank]
        tokens.index_copy_(0, slot, token)
        score = scores.index_select(0, parent_node) + prior
        scores.index_copy_(0, fresh, score)
        if depth > tree_depth:
            continue
        same = torch.add(token, parent_node, alpha=1 << 32)[:, None] == existing  # [l, n]; sentinels match nothing
        resolved = torch.where(same, indices, fresh_column).amin(dim=1)  # the matching node, else the new one
        node.index_copy_(0, slot, resolved)
        scores.scatter_reduce_(0, resolved, score, reduce="amax")  # a merged node keeps the higher score
    if resolving < len(columns):
        chained, chained_scores = _chains(successors, template, device, resolving + 1, token, score)
        slots, nodes = template.tail(device, n, resolving + 1)
        tokens.index_copy_(0, slots, chained)
        scores.index_copy_(0, nodes, chained_scores)


def _chains(
    successors: torch.Tensor,  # [vocab + 2, k]
    template: RankTemplate,
    device: torch.device,
    first: int,  # the first depth (1-based) worked out here
    token: torch.Tensor,  # [l] the tokens of the depth above ``first``, in its candidate order
    score: torch.Tensor | None,  # [l] their scores; None: no scores
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [T] tokens, [T] scores (or None): the depths from ``first``, concatenated
    """The candidates of depth ``first`` on, where every parent is a new candidate: each depth from the tensors of the
    one above (a gather by position, none along a chain), with a score as grafting sums it (the parent's plus the
    candidate's log prior, in float32)."""
    tokens, scores = [], []
    columns, links = template.level_columns(device)[first - 1 :], template.level_links(device)[first - 1 :]
    for (_, _, _, rank, prior), link in zip(columns, links, strict=True):
        if link is not None:
            token = token.index_select(0, link)
            score = None if score is None else score.index_select(0, link)
        token = successors[token, rank]
        tokens.append(token)
        if score is not None:
            score = score + prior
            scores.append(score)
    return torch.cat(tokens), (torch.cat(scores) if score is not None else None)
