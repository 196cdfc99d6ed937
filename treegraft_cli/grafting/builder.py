"""The TreeGraft layer loop (DESIGN.md §4): per layer, skip (weak n-gram expansion) or call (strong combine).

Per step: the tree starts at the root with the root as frontier. For ℓ = 1..D the policy (or a forced
action, for ``collect``'s counterfactual rollouts) picks call or skip; the layer leaves a frontier of at
most K nodes for the next one. At the end the tree is cut to N nodes by score, ancestors kept, and the
policy may trim it further (``CallPolicy.trim``: the step rule drops nodes not worth their verification).

Skip: every frontier parent not yet expanded by the weak drafter gets up to K n-gram continuations,
whole chains (up to ``max_depth``). Only the chain heads of parents that found all K continuations
form the next frontier: a parent that cannot reach K stops expanding, its chains stay. Every chain
token is scored with the target's log-prob of it at its matched context position (``chain_logp``). A
policy that ``previews`` a layer sees those scores before deciding (``SchedulerState.weak``): the
lookup is done once and reused when the layer skips.

Call: one strong forward over the tree — every unforwarded node that has children (their children need
rescoring) and the best ``pool`` unforwarded grafting candidates (an EAGLE-3 head needs one forward per
tree depth, see ``drafters.strong_eagle3``) — then every node is rescored with the strong drafter's
log-probs, the K best grafting positions in the lookback window are reselected (possibly shallower than
the frontier), and each gets its top-K children. Existing children are merged and take
the strong score; nothing is deleted. The new children's K best are the next frontier.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..config import TreeConfig
from ..drafters import StrongDrafter
from ..drafters.ngram import Continuation, NgramIndex, TargetLogProbCache
from ..syncs import fetch, host_only
from ..tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree
from .config import TreeGraftConfig
from .scheduler import CallPolicy, CostModel, SchedulerState, WeakPreview, features
from .tree_ops import cut_to_budget, graft_window, has_children, pad_column, top_nodes

HOST = torch.device("cpu")


@dataclass
class Growth:
    """The mutable state of one step's tree while it grows; side columns are aligned with the tree."""

    tree: DraftTree
    frontier: torch.Tensor  # [f] node indices
    expanded: torch.Tensor  # [num_nodes] bool: the strong drafter added this node's top-K children
    weak_done: torch.Tensor  # [num_nodes] bool: the weak drafter expanded this node
    rows: torch.Tensor  # [num_nodes] long: the node's strong log-prob row, -1 if never forwarded
    called: list[int] = field(default_factory=list)  # layers that called the strong drafter
    weak_expansions: int = 0

    @classmethod
    def start(cls, root_token: int, device: torch.device = HOST) -> Growth:
        """A host tree holding the root: the layer loop runs on the host (its weak drafter is host-side by
        nature); only the strong drafter's forwards and look-ups run on the device."""
        tree = DraftTree.from_root(root_token, device, host=True)
        flags = torch.zeros(1, dtype=torch.bool, device=device)
        return cls(tree, torch.zeros(1, dtype=torch.long, device=device), flags, flags.clone(), torch.full((1,), -1, device=device))

    def sync(self) -> None:
        n = self.tree.num_nodes
        self.expanded = pad_column(self.expanded, n, False)
        self.weak_done = pad_column(self.weak_done, n, False)
        self.rows = pad_column(self.rows, n, -1)


@dataclass(frozen=True)
class WeakProposal:
    """What a skip would add: the chains as tensors (``preview``, what a policy sees)."""

    preview: WeakPreview  # parents [c], per-token target log-probs and tokens [c, width], on the tree's device
    full: list[int]  # parents that found all K continuations (their chain heads form the next frontier)

    @property
    def empty(self) -> bool:
        return self.preview.parents.numel() == 0


@dataclass(frozen=True)
class LayerRecord:
    """What happened at one layer: the action, whether it was forced, and the features when recorded."""

    layer: int
    called: bool
    forced: bool
    features: torch.Tensor | None  # [17]


class LayerLoop:
    """Builds one step's tree from the weak index, the target log-prob cache and the strong drafter."""

    def __init__(
        self,
        tree_config: TreeConfig,
        options: TreeGraftConfig,
        index: NgramIndex,
        target_logp: TargetLogProbCache,
        strong: StrongDrafter | None,
    ):
        self.shape = tree_config
        self.options = options
        self.index = index
        self.target_logp = target_logp
        self.strong = strong

    @property
    def pool(self) -> int:
        return self.options.pool or 2 * self.shape.top_k

    def build(
        self,
        committed: torch.Tensor,  # [L] root last
        policy: CallPolicy,
        costs: CostModel,
        prompt_length: int,
        forced: Mapping[int, bool] | None = None,
        record: bool = False,
        history: tuple[float, ...] = (),
    ) -> tuple[DraftTree, list[LayerRecord], Growth]:
        """The cut tree, one record per layer, and the uncut growth state (for inspection and tests).

        ``history``: what the recent steps measured (``StepHistory.values()``), handed to the policy's state."""
        forced = forced or {}
        self.index.sync(committed)
        if self.strong is not None:
            self.strong.start_step()
        g = Growth.start(self.index.context[-1])
        records = []
        for layer in range(1, self.shape.depth + 1):
            with host_only():
                previewed = policy.previews(layer) and layer not in forced
                proposal = self.propose_weak(g, layer) if previewed else None
                state = self.state(g, layer, costs, prompt_length, proposal, self.strong_lag(committed), history)
                wanted = forced[layer] if layer in forced else policy.decide(state)
                call = wanted and self.strong is not None and bool(state.candidates.any())
            if call:
                self.strong_layer(g, layer, committed, state.candidates)
                g.called.append(layer)
            else:
                with host_only():
                    self.weak_layer(g, layer, proposal)
            with host_only():
                records.append(LayerRecord(layer, call, layer in forced, features(state) if record else None))
        with host_only():
            tree = policy.trim(cut_to_budget(g.tree, self.shape.budget), costs, self.shape.budget)
        return tree, records, g

    def strong_lag(self, committed: torch.Tensor) -> int:
        """Committed tokens the strong drafter has yet to forward (the whole prompt before its first call)."""
        return committed.shape[0] - self.strong.committed_length if self.strong is not None else 0

    def state(
        self,
        g: Growth,
        layer: int,
        costs: CostModel,
        prompt_length: int,
        proposal: WeakProposal | None = None,
        strong_lag: int = 0,
        history: tuple[float, ...] = (),
    ) -> SchedulerState:
        window = graft_window(g.tree, layer, self.options.lookback, self.options.max_depth, g.expanded)
        return SchedulerState(
            tree=g.tree,
            frontier=g.frontier,
            candidates=window,
            layer=layer,
            num_layers=self.shape.depth,
            called=tuple(g.called),
            prompt_length=prompt_length,
            costs=costs,
            width=self.shape.top_k,
            budget=self.shape.budget,
            weak=proposal.preview if proposal is not None else None,
            strong_lag=strong_lag,
            history=history,
        )

    # -- skip: the weak drafter ---------------------------------------------------------------------

    def weak_layer(self, g: Growth, layer: int, proposal: WeakProposal | None = None) -> None:
        """Skip: hang the weak drafter's chains (``proposal``, looked up here when not previewed)."""
        proposal = proposal if proposal is not None else self.propose_weak(g, layer)
        parents = g.frontier[~g.weak_done[g.frontier]]
        g.frontier = parents[:0]
        if parents.numel() == 0:
            return
        g.weak_done[parents] = True
        g.weak_expansions += 1
        if proposal.empty:
            return
        tree = g.tree
        heads = self.add_chains(tree, proposal)
        g.sync()
        full = torch.tensor(proposal.full, dtype=torch.long, device=tree.device)
        from_full = torch.isin(proposal.preview.parents, full)
        allowed = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
        allowed[heads[from_full]] = True
        g.frontier = top_nodes(tree.scores, allowed, self.shape.top_k)

    def propose_weak(self, g: Growth, layer: int) -> WeakProposal:
        """The chains a skip at ``layer`` would add, looked up but not added (a policy may preview them)."""
        parents = g.frontier[~g.weak_done[g.frontier]]
        k, max_n = self.shape.top_k, max(1, self.options.max_n - layer + 1)
        tree = g.tree
        tokens, parent_of, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
        context_tail = self.index.context[-max_n:]
        chains: list[tuple[int, Continuation]] = []
        full: list[int] = []
        for parent in parents.tolist():  # one index lookup per parent (host-side by nature)
            room = self.options.max_depth - depths[parent]
            if room <= 0:
                continue
            suffix = context_tail + _path_tail(parent, tokens, parent_of, max_n)
            found = self.index.continuations(suffix, max_n, k, room)
            chains.extend((parent, c) for c in found)
            if len(found) == k:
                full.append(parent)
        tokens, logp = self.chain_logp(chains)
        parents = torch.tensor([p for p, _ in chains], dtype=torch.long)
        return WeakProposal(WeakPreview(parents.to(tree.device), logp, tokens.to(tree.device)), full)

    def chain_logp(self, chains: list[tuple[int, Continuation]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain tokens ``[c, width]`` (0-padded) and the target's log-prob of each at its matched position.

        Token j of a continuation after the match ending at p is context[p + 1 + j]; the target saw it
        follow position p + j, and its log-prob there is how sure it was (-inf pads). A chain's cumulative
        score is its parent's plus the running sum, so a long match the target found surprising ranks low.
        """
        if not chains:
            return torch.empty(0, 1, dtype=torch.long), torch.empty(0, 1)
        lengths = torch.tensor([len(c.tokens) for _, c in chains])
        width = int(lengths.max())
        padded = torch.tensor([list(c.tokens) + [0] * (width - len(c.tokens)) for _, c in chains])
        positions = torch.tensor([c.position for _, c in chains])[:, None] + torch.arange(width)[None, :]
        logp = self.target_logp.score(positions.flatten(), padded.flatten()).view(len(chains), width)
        return padded, torch.where(torch.arange(width)[None, :] < lengths[:, None], logp, float("-inf"))

    def add_chains(self, tree: DraftTree, proposal: WeakProposal) -> torch.Tensor:  # -> [c] chain head nodes
        """Hang every chain under its parent (merging into existing nodes); return the heads."""
        preview = proposal.preview
        return torch.tensor(tree.add_chains(preview.parents, preview.tokens, preview.logp, ORIGIN_NGRAM))

    # -- call: the strong drafter -------------------------------------------------------------------

    def strong_layer(self, g: Growth, layer: int, committed: torch.Tensor, window: torch.Tensor | None = None) -> None:
        """Call: one strong forward, then one read of what the host needs (see ``StrongLookup``).

        ``window``: the layer's grafting window ([num_nodes] bool) when the caller has it already.
        """
        tree, k = g.tree, self.shape.top_k
        with host_only():
            if window is None:
                window = graft_window(tree, layer, self.options.lookback, self.options.max_depth, g.expanded)
            pooled = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
            pooled[top_nodes(tree.scores, window, self.pool)] = True
            needed = (g.rows < 0) & (has_children(tree) | pooled)
            needed[0] = False  # the root's row comes with the pending committed tokens
            nodes = torch.nonzero(needed).flatten()
        self.strong.forward(committed, tree, nodes, g.rows, tree.ancestor_mask())
        with host_only():
            candidates = window & (g.rows >= 0)
            depth = int(tree.depths.max())
        found = strong_lookup(self.strong.logp, tree, g.rows, candidates, depth, k)
        with host_only():
            tree.scores = found.scores
            positions = found.positions[found.allowed]
            top_logp, top_tokens = found.top_logp[found.allowed], found.top_tokens[found.allowed]
            child_scores = tree.scores[positions][:, None] + top_logp
            child_parents = positions[:, None].expand_as(top_tokens)
            children = tree.add_children(
                child_parents.flatten(), top_tokens.flatten(), child_scores.flatten(), ORIGIN_MODEL, rescore=True
            )
            g.sync()
            g.expanded[positions] = True
            allowed = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
            allowed[children] = True
            g.frontier = top_nodes(tree.scores, allowed, k)


@dataclass(frozen=True)
class StrongLookup:
    """What one strong call sends back to the host, read at once: every node's score rescored with the strong
    log-probs, the grafting positions a reselection picks, and their top-K children."""

    scores: torch.Tensor  # [num_nodes] float32
    positions: torch.Tensor  # [K] node indices, best first
    allowed: torch.Tensor  # [K] bool: the position is a real candidate (fewer than K may exist)
    top_logp: torch.Tensor  # [K, K] the positions' top-K strong log-probs
    top_tokens: torch.Tensor  # [K, K]


def strong_lookup(
    logp: torch.Tensor,  # [rows, vocab] the strong drafter's log-probs, on its device
    tree: DraftTree,  # the host tree
    rows: torch.Tensor,  # [num_nodes] each node's row in ``logp``, -1 if none (host)
    candidates: torch.Tensor,  # [num_nodes] bool: nodes a reselection may pick (host)
    max_depth: int,
    k: int,
) -> StrongLookup:
    """Rescore every node (cumulative strong log-prob along its root path), reselect the ``k`` best candidates
    and take their top-``k`` children, on the device; one read brings the results to the host.

    Ties in the reselection go to the lower index (the shallower), as ``top_nodes`` does.
    """
    device = logp.device
    with host_only():
        packed = torch.stack([tree.parents, tree.tokens, tree.depths, rows, candidates.long()])
    parents, tokens, depths, rows_d, allowed = packed.to(device, non_blocking=True).unbind(0)
    local = torch.zeros(tokens.shape[0], device=device)
    local[1:] = logp[rows_d[parents[1:]], tokens[1:]]
    scores = tree.scores.to(device, non_blocking=True)
    for depth in range(1, max_depth + 1):  # parents first: one pass per depth, no data-dependent shapes
        scores = torch.where(depths == depth, scores[parents.clamp(min=0)] + local, scores)
    allowed = allowed.bool()
    order = torch.sort(torch.where(allowed, scores, float("-inf")), descending=True, stable=True).indices[:k]
    top_logp, top_tokens = torch.topk(logp[rows_d[order]], k, dim=-1)
    return StrongLookup(*fetch(scores, order, allowed[order], top_logp, top_tokens))


def _path_tail(node: int, tokens: list[int], parent_of: list[int], count: int) -> list[int]:
    """The last ``count`` path tokens root→node (root excluded: it already ends the context)."""
    tail = []
    while node > 0 and len(tail) < count:
        tail.append(tokens[node])
        node = parent_of[node]
    return tail[::-1]
