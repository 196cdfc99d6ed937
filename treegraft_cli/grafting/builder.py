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
tree depth, see ``drafters.strong_eagle3``; K of them when the K best are all the reselection can pick, see
``LayerLoop.pool_at``) — then every node is rescored with the strong drafter's
log-probs, the K best grafting positions in the lookback window are reselected (possibly shallower than
the frontier), and each gets its top-K children. Existing children are merged and take
the strong score; nothing is deleted. The new children's K best are the next frontier.

Strong layers the policy calls from layer 1 on whatever the tree holds run on the strong drafter's device and
are read back once (``strong_run``); the loop goes on from the layer after them. A run over every layer is not read
back at all when neither the policy nor the caller reads the tree on the host: it is cut on the device.

A lone strong call at layer 1 of every step (``fixed:1,3``) looks ahead (``LayerLoop.looks_ahead``): it needs only
the root's log-prob row, and that depends on nothing the host decides after the verdict, only on the tokens the step
commits, which are on the device once the target has verified. So the strong drafter forwards them there and then
(the accepted tokens and the bonus, padded to the tree's depth: ``TreeDrafter.forward_ahead``), the root's top-K
rides along with the verdict's read, and the next step's layer 1 grafts from it without a read of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..config import TreeConfig
from ..drafters import StrongDrafter
from ..drafters.dense_layout import OpenLayout
from ..drafters.ngram import Continuation, NgramIndex, TargetLogProbCache
from ..hostlists import floats, longs
from ..lm import on_device_of
from ..scheduling.options import TreeGraftConfig
from ..scheduling.policies import CallPolicy, CostModel, SchedulerState, WeakPreview, features, preview_features
from ..syncs import fetch, host_only
from ..tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree, RootTrees, float32_list
from ..verify import StepVerdict
from .strong_call import StrongLookup, best_nodes, needed_nodes, rescored, reselect, strong_lookup
from .strong_run import RunPlan, RunResult, plan_run, run_strong_layers
from .tree_ops import cut_to_budget

HOST = torch.device("cpu")


@dataclass
class Growth:
    """The mutable state of one step's tree while it grows; the side column ``rows`` is aligned with the tree."""

    tree: DraftTree
    frontier: list[int]  # [f] node indices
    weak_done: set[int]  # nodes the weak drafter expanded
    rows: list[int]  # [num_nodes] the node's strong log-prob row, -1 if never forwarded (host work: a list)
    called: list[int] = field(default_factory=list)  # layers that called the strong drafter
    weak_expansions: int = 0
    expanded_nodes: set[int] = field(default_factory=set)  # nodes the strong drafter added top-K children under
    weak_chains: bool = False  # a weak layer hung n-gram chains (scores a strong call rescores)

    @classmethod
    def start(cls, root_token: int, roots: RootTrees | None = None) -> Growth:
        """A host tree holding the root: the layer loop runs on the host (its weak drafter is host-side by
        nature); only the strong drafter's forwards and look-ups run on the device."""
        tree = (roots or RootTrees()).tree(root_token, HOST, host=True)
        return cls(tree, [0], set(), [-1])

    @classmethod
    def under_root(cls, root_token: int, lookup: StrongLookup, roots: RootTrees) -> Growth:
        """The state after layer 1 called the strong drafter on the root alone, from ``lookup`` (its top-K, made
        ahead): the root's children are the frontier (nodes 1..K, best first as top-K lists them), the root is
        expanded and its row is the drafter's row 0 (the caller counts the call in ``called``). The tree is a copy of
        ``roots``' prototype of that shape."""
        tree = roots.under_root(root_token, lookup.top_tokens[0], lookup.top_logp[0], ORIGIN_MODEL, HOST)
        children = tree.num_nodes - 1
        return cls(tree, list(range(1, children + 1)), set(), [0] + [-1] * children, expanded_nodes={0})

    def take(self, other: Growth) -> None:
        """Become ``other``: every field, so a caller holding this state sees the step as ``other`` grew it."""
        vars(self).update(vars(other))

    @classmethod
    def after_run(cls, run: RunResult, layers: int) -> Growth:
        """The state after a device run of strong layers 1..``layers`` (``strong_run``): the nodes it forwarded (those
        with a row, the root's included) are the ones it grafted children under."""
        expanded = {node for node, row in enumerate(run.rows) if row >= 0}
        return cls(run.tree, run.frontier, set(), run.rows, list(range(1, layers + 1)), expanded_nodes=expanded)

    def sync(self) -> None:
        """Grow the side column to the tree's size (new nodes were never forwarded)."""
        self.rows.extend([-1] * (self.tree.num_nodes - len(self.rows)))


@dataclass(frozen=True)
class WeakProposal:
    """What a skip would add: the chains as tensors (``preview``, what a policy sees)."""

    preview: WeakPreview  # parents [c], per-token target log-probs and tokens [c, width], on the tree's device
    full: list[int]  # parents that found all K continuations (their chain heads form the next frontier)
    expanding: tuple[int, ...] = ()  # the frontier nodes the weak drafter had not expanded yet: the ones looked up
    chain_parents: tuple[int, ...] = ()  # ``preview.parents`` on the host

    @property
    def empty(self) -> bool:
        return not self.chain_parents


@dataclass(frozen=True)
class LayerRecord:
    """What happened at one layer: the action, whether it was forced, and the features when recorded."""

    layer: int
    called: bool
    forced: bool
    features: torch.Tensor | None  # [17]
    preview: tuple[float, ...] = ()  # ``preview_features`` when recorded
    forwarded: int = 0  # tree nodes the layer's strong call forwarded (the pending committed tokens not counted)


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
        self.roots = RootTrees()
        # a strong run over every layer, drafted on the dense layout when the drafter forwards blocks without a tree
        self.layout = (OpenLayout(strong, tree_config.depth, tree_config.top_k, tree_config.budget, options.lookback)
                       if strong is not None and strong.forwards_blocks else None)
        # what a layer that finds no chains hands on, the same (never written) empty tensors every time:
        # node indices [0], chain tokens [0, 1], their log-probs [0, 1]
        self.nothing = (torch.empty(0, dtype=torch.long), torch.empty(0, 1, dtype=torch.long), torch.empty(0, 1))
        self.ahead: tuple[int, StrongLookup] | None = None  # the next root's lookup, looked up ahead, by committed length

    @property
    def pool(self) -> int:
        return self.options.pool or 2 * self.shape.top_k

    def pool_at(self, g: Growth) -> int:
        """Unforwarded candidates the next call forwards: ``pool``, or K while the tree holds no n-gram chain.

        The reselection picks the K best candidates by their rescored scores. Without n-gram chains rescoring
        changes no score (every node already holds its strong log-prob), so the K best unforwarded nodes are all
        it can pick among them: more would be forwarded for nothing.
        """
        return self.pool if g.weak_chains else min(self.pool, self.shape.top_k)

    def build(
        self,
        committed: torch.Tensor,  # [L] root last
        policy: CallPolicy,
        costs: CostModel,
        prompt_length: int,
        forced: Mapping[int, bool] | None = None,
        record: bool = False,
        history: tuple[float, ...] = (),
        device_tree: bool = False,
    ) -> tuple[DraftTree, list[LayerRecord], int]:
        """The cut tree, one record per layer, and how many nodes the weak drafter expanded.

        ``history``: what the recent steps measured (``StepHistory.values()``), handed to the policy's state.
        ``device_tree``: the caller reads nothing of the tree on the host, so a strong run over every layer may hand
        it over on the strong drafter's device (when the policy does not read it either); else it is a host tree."""
        forced = forced or {}
        self.index.sync(committed)
        if self.strong is not None:
            self.strong.start_step()
        if device_tree and not forced and not record and policy.plans_whole_steps(self.shape.depth):
            plan = self.run_plan(committed, policy)
            if plan is not None:  # every layer strong, and no read
                records = run_records(plan)
                return self.strong_tree(committed), records, 0
        ahead, self.ahead = self.ahead, None
        root_lookup = ahead[1] if ahead is not None and ahead[0] == committed.shape[0] and not forced else None
        g, records, layer = self.first_layers(committed, policy, root_lookup, forced, record)
        while layer <= self.shape.depth:
            with host_only():
                by_layer = None if record or layer in forced else policy.wants_layer(layer)
                if by_layer is None:
                    previewed = policy.previews(layer) and layer not in forced
                    proposal = self.propose_weak(g, layer) if previewed else None
                    window = self.window_nodes(g, layer)
                    state = self.state(g, layer, costs, prompt_length, proposal, self.strong_lag(committed), history,
                                       window)
                    # recorded as the policy sees them: before the layer grows the tree the state holds
                    recorded = (features(state), preview_features(state)) if record else (None, ())
                    wanted = forced[layer] if layer in forced else policy.decide(state)
                else:  # a policy deciding by the layer alone: ``decide``'s budget and window, no state
                    proposal, recorded = None, (None, ())
                    wanted = by_layer and len(g.called) < policy.call_budget
                    window = self.window_nodes(g, layer) if wanted else []
                call = wanted and self.strong is not None and bool(window)
            plan = self.run_plan(committed, policy) if call and layer == 1 and not forced and not record else None
            if plan is not None:  # a policy deciding by the state (the step rule's strong steps)
                g, records, layer = self.run_from_root(plan, committed)
                continue
            forwarded = 0
            if call:
                forwarded = self.strong_layer(g, layer, committed, window, root_lookup if layer == 1 else None)
                g.called.append(layer)
            else:
                with host_only():
                    self.weak_layer(g, layer, proposal)
            with host_only():
                records.append(LayerRecord(layer, call, layer in forced, *recorded, forwarded))
            layer += 1
        with host_only():
            # a forced build (``collect``'s probe of another action) is trimmed as a step that called where it did
            called = tuple(g.called) if forced else None
            tree = policy.trim(cut_to_budget(g.tree, self.shape.budget), costs, self.shape.budget, called)
        return tree, records, g.weak_expansions

    def first_layers(
        self,
        committed: torch.Tensor,  # [L] root last
        policy: CallPolicy,
        root_lookup: StrongLookup | None,
        forced: Mapping[int, bool],
        record: bool,
    ) -> tuple[Growth, list[LayerRecord], int]:
        """The state, records and next layer before the loop decides: layer 1 already done when the policy calls it by
        the layer alone (every window at layer 1 holds the root) and the call was made ahead (``graft_root``) or starts
        a device run (``run_from_root``: no root-only tree made for nothing); else the root alone, at layer 1."""
        by_layer = (not record and not forced and self.strong is not None and policy.wants_layer(1)
                    and policy.call_budget >= 1)
        if by_layer and root_lookup is not None:
            g = self.graft_root(committed, root_lookup)
            g.called.append(1)
            return g, [LayerRecord(1, True, False, None, (), 0)], 2
        plan = self.run_plan(committed, policy) if by_layer else None
        if plan is not None:
            return self.run_from_root(plan, committed)
        return Growth.start(self.index.context[-1], self.roots), [], 1

    def run_from_root(self, plan: RunPlan, committed: torch.Tensor) -> tuple[Growth, list[LayerRecord], int]:
        """The device run of ``plan``: the state after it, its records and the layer after it."""
        run = run_strong_layers(plan, self.layout, committed)
        return Growth.after_run(run, plan.layers), run_records(plan), plan.layers + 1

    def run_plan(self, committed: torch.Tensor, policy: CallPolicy) -> RunPlan | None:
        """Once ``policy`` decided to call at layer 1: the device run of the layers it calls from there on whatever
        the tree holds, when there is one worth running: two layers at least (one strong layer reads once either
        way), a drafter that forwards blocks (the run is drafted on its dense layout), committed tokens it lacks
        that hold the root, and counts that do not depend on the data (``plan_run``)."""
        if not self.options.device_layers or self.layout is None:
            return None
        layers = policy.planned_calls(self.shape.depth)
        if layers < 2 or self.strong_lag(committed) < 1:
            return None
        return plan_run(layers, self.shape.top_k, self.pool, self.options.max_depth)

    def strong_tree(self, committed: torch.Tensor) -> DraftTree:
        """The cut tree of a strong run over every layer, on the strong drafter's device: no read. Drafted on the
        dense layout (``OpenLayout``: no node written before the cut).

        ``cut_to_budget`` caps each score by its ancestors' before ranking; a run's scores need no cap (each child's is
        its parent's plus a log-prob, never above it), so the cut is ``DraftTree.top_by_score``'s, node for node. The
        policy keeps the cut tree (no trim)."""
        *_, drafted = self.layout.layers(committed)
        return drafted.top_by_score(self.shape.budget)

    def looks_ahead(self, policy: CallPolicy) -> bool:
        """Whether each step's lone layer-1 call runs before the step before it is read (see the module docstring): the
        policy calls layer 1 every step, and not as the first of a run (which reads once either way)."""
        return (self.options.look_ahead and self.strong is not None and self.strong.looks_ahead
                and policy.calls_first_layer(self.shape.depth) and policy.planned_calls(self.shape.depth) < 2)

    def look_ahead(
        self,
        committed: torch.Tensor,  # [L] the step's committed tokens, root last
        verdict: StepVerdict,
        path: torch.Tensor,  # [depth + 1] ``verdict.path_rows`` to the tree's deepest
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [1, K] twice, on the strong drafter's device
        """Before the verdict is read: the next step's layer-1 call (``TreeDrafter.forward_ahead``); the caller reads
        its top-K log-probs and tokens with the verdict and hands them to ``settle_ahead``."""
        block, accepted = verdict.committed_block(path)
        return self.strong.forward_ahead(committed, block, accepted, self.shape.top_k)

    def settle_ahead(self, length: int, num_accepted: int, top_logp: torch.Tensor, top_tokens: torch.Tensor) -> None:
        """After the read: the drafter keeps the committed tokens' rows, and the next step (``length`` committed
        tokens) grafts under its root from the read ``top_logp`` and ``top_tokens`` (``[1, K]`` host tensors)."""
        self.strong.settle_ahead(num_accepted)
        with host_only():
            self.ahead = (length, StrongLookup([], top_logp.tolist(), top_tokens.tolist()))

    def look_ahead_from_prompt(
        self, prompt: torch.Tensor, first: torch.Tensor  # [P] the prompt, [1] the first root
    ) -> None:
        """A request's start: the first step's layer-1 call, after the prefill (the prompt's catch-up, the first root
        its block), read with the request's reads."""
        accepted = torch.zeros(1, dtype=torch.long, device=first.device)  # the block is the root alone
        top_logp, top_tokens = fetch(*self.strong.forward_ahead(prompt, first, accepted, self.shape.top_k))
        self.settle_ahead(prompt.shape[0] + 1, 0, top_logp, top_tokens)

    def forget_ahead(self) -> None:
        """A request's start without a look-ahead: no lookup of an earlier request may serve its first step."""
        self.ahead = None

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
        window: list[int] | None = None,  # ``window_nodes`` when the caller has them
    ) -> SchedulerState:
        return SchedulerState(
            tree=g.tree,
            frontier=longs(g.frontier),
            window=tuple(self.window_nodes(g, layer) if window is None else window),
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

    def window_nodes(self, g: Growth, layer: int) -> list[int]:
        """``graft_window``'s nodes, ascending, from the host tree's depths and the strong-expanded set."""
        lowest, highest = max(0, layer - self.options.lookback), min(layer - 1, self.options.max_depth - 1)
        expanded = g.expanded_nodes
        return [i for i, d in enumerate(g.tree.listed("depths")) if lowest <= d <= highest and i not in expanded]

    # -- skip: the weak drafter ---------------------------------------------------------------------

    def weak_layer(self, g: Growth, layer: int, proposal: WeakProposal | None = None) -> None:
        """Skip: hang the weak drafter's chains (``proposal``, looked up here when not previewed)."""
        proposal = proposal if proposal is not None else self.propose_weak(g, layer)
        g.frontier = []
        if not proposal.expanding:
            return
        g.weak_done.update(proposal.expanding)
        g.weak_expansions += 1
        if proposal.empty:
            return
        tree = g.tree
        heads = self.add_chains(tree, proposal)
        g.weak_chains = True
        g.sync()
        full = set(proposal.full)
        allowed = sorted({head for head, parent in zip(heads, proposal.chain_parents, strict=True) if parent in full})
        g.frontier = best_nodes(tree.score_list(), allowed, self.shape.top_k)

    def propose_weak(self, g: Growth, layer: int) -> WeakProposal:
        """The chains a skip at ``layer`` would add, looked up but not added (a policy may preview them)."""
        tree = g.tree
        with host_only():
            parents = [p for p in g.frontier if p not in g.weak_done]
        k, max_n = self.shape.top_k, max(1, self.options.max_n - layer + 1)
        tokens, parent_of, depths = tree.listed("tokens"), tree.listed("parents"), tree.listed("depths")
        context_tail = self.index.context[-max_n:]
        chains: list[tuple[int, Continuation]] = []
        full: list[int] = []
        for parent in parents:  # one index lookup per parent (host-side by nature)
            room = self.options.max_depth - depths[parent]
            if room <= 0:
                continue
            suffix = context_tail + _path_tail(parent, tokens, parent_of, max_n)
            found = self.index.continuations(suffix, max_n, k, room, min_n=min(self.options.min_n, max_n))
            chains.extend((parent, c) for c in found)
            if len(found) == k:
                full.append(parent)
        chain_tokens, logp = self.chain_logp(chains)
        chain_parents = [p for p, _ in chains]
        preview = WeakPreview(on_device_of(longs(chain_parents) if chains else self.nothing[0], tree.device), logp,
                              on_device_of(chain_tokens, tree.device))
        return WeakProposal(preview, full, tuple(parents), tuple(chain_parents))

    def chain_logp(self, chains: list[tuple[int, Continuation]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain tokens ``[c, width]`` (0-padded) and the target's log-prob of each at its matched position.

        Token j of a continuation after the match ending at p is context[p + 1 + j]; the target saw it
        follow position p + j, and its log-prob there is how sure it was (-inf pads). A chain's cumulative
        score is its parent's plus the running sum, so a long match the target found surprising ranks low.
        """
        if not chains:
            return self.nothing[1], self.nothing[2]
        width = max(len(c.tokens) for _, c in chains)
        positions = [c.position + j for _, c in chains for j in range(len(c.tokens))]
        scored = iter(self.target_logp.score_on_host(positions, [t for _, c in chains for t in c.tokens]))
        pad = [float("-inf")] * width
        logp = [[next(scored) for _ in c.tokens] + pad[len(c.tokens) :] for _, c in chains]
        padded = [list(c.tokens) + [0] * (width - len(c.tokens)) for _, c in chains]
        return longs(itertools.chain.from_iterable(padded)).view(len(chains), width), floats(
            itertools.chain.from_iterable(logp)).view(len(chains), width)

    def add_chains(self, tree: DraftTree, proposal: WeakProposal) -> list[int]:  # -> [c] chain head nodes
        """Hang every chain under its parent (merging into existing nodes); return the heads."""
        preview = proposal.preview
        return tree.add_chains(preview.parents, preview.tokens, preview.logp, ORIGIN_NGRAM)

    # -- call: the strong drafter -------------------------------------------------------------------

    def strong_layer(
        self,
        g: Growth,
        layer: int,
        committed: torch.Tensor,
        window: list[int] | None = None,
        root_lookup: StrongLookup | None = None,
    ) -> int:
        """Call: one strong forward, then one read of what the host needs (see ``strong_lookup``). Returns how many
        tree nodes the forward took.

        ``window``: the layer's ``window_nodes`` when the caller has them already. ``root_lookup``: at layer 1, what
        the call sends back when it was made ahead (``look_ahead``): the forward then has nothing left to do. The host
        tree's bookkeeping runs on host lists: a strong call touches a few dozen nodes, cheaper in Python than in
        tensor ops of a few microseconds each.
        """
        tree, k = g.tree, self.shape.top_k
        with host_only():
            in_window = self.window_nodes(g, layer) if window is None else window
        if root_lookup is not None and tree.num_nodes == 1 and in_window == [0]:
            g.take(self.graft_root(committed, root_lookup))  # the root-only state holds nothing else yet
            return 0
        with host_only():
            parents, tokens, scores = tree.listed("parents"), tree.listed("tokens"), tree.score_list()
            nodes = needed_nodes(parents, scores, g.rows, in_window, self.pool_at(g))
        forwarded = self.strong.forward(committed, tree, longs(nodes), None, None)  # the mask from the whole buffers
        with host_only():
            rows = g.rows
            if self.strong.logp_rows.count:  # the root's row: forwarded with the pending tokens, or kept
                rows[0] = 0
            for node, row in zip(nodes, forwarded, strict=True):
                rows[node] = row
            candidates = [i for i in in_window if rows[i] >= 0]
        # without n-gram chains rescoring would give every node the score it holds (``pool_at``)
        found = strong_lookup(self.strong.logp_rows, parents, tokens, rows, candidates, k, rescore=g.weak_chains)
        with host_only():
            if g.weak_chains:
                scores = rescored(scores, parents, found.local)
            positions = reselect(scores, candidates, k)
            child_parents, child_tokens, child_scores = [], [], []
            for position in positions:
                c = candidates.index(position)
                child_parents += [position] * k
                child_tokens += found.top_tokens[c]
                child_scores += [scores[position] + logp for logp in found.top_logp[c]]
            children, scores = tree.add_rescored_children(child_parents, child_tokens, float32_list(child_scores),
                                                          ORIGIN_MODEL, scores)
            self.grafted(g, positions, children, scores)
        return len(nodes)

    def graft_root(self, committed: torch.Tensor, lookup: StrongLookup) -> Growth:
        """``strong_layer`` at layer 1 on the root alone, from the root's lookup made ahead: the drafter has nothing
        to forward (the root's row is its row 0, kept ahead), the root is the only candidate, and its top-K children
        are new nodes (``Growth.under_root``; no tree node forwarded)."""
        self.strong.forward(committed, None, self.nothing[0], None, None)  # keeps the root's row 0 for this step
        # top-K lists the children best first, so in node order they are the frontier ``best_nodes`` would pick
        with host_only():
            return Growth.under_root(self.index.context[-1], lookup, self.roots)

    def grafted(self, g: Growth, positions: list[int], children: list[int], scores: list[float]) -> None:
        """After a strong call's merge: the side column follows the tree, ``positions`` are expanded, and the K best
        of the call's ``children`` (by ``scores``, every node's) are the next frontier."""
        g.sync()
        g.expanded_nodes.update(positions)
        g.frontier = best_nodes(scores, sorted(set(children)), self.shape.top_k)


def run_records(plan: RunPlan) -> list[LayerRecord]:
    """The records of a run's layers: each called, none forced, the nodes each forwarded by the plan."""
    return [LayerRecord(layer, True, False, None, forwarded=plan.forwarded(layer)) for layer in range(1, plan.layers + 1)]


def _path_tail(node: int, tokens: list[int], parent_of: list[int], count: int) -> list[int]:
    """The last ``count`` path tokens root→node (root excluded: it already ends the context)."""
    tail = []
    while node > 0 and len(tail) < count:
        tail.append(tokens[node])
        node = parent_of[node]
    return tail[::-1]
