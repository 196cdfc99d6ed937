"""Methods that draft with a small LM: ``chain`` (classic speculative decoding) and ``dense`` (EAGLE-2)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..config import DecodeConfig
from ..drafters import make_model_drafter
from ..drafters.dense_layout import DenseDraft, DenseLayout
from ..drafters.logp_rows import log_softmax_float32
from ..syncs import host_value
from ..tree import ORIGIN_MODEL, DraftTree, RootTrees
from ..verify import StepVerdict
from .base import Method, Models, Observation, register


def forwarded_prefix(slots: list[int], accepted: list[int]) -> int:  # slots: [num_nodes], accepted: root excluded
    """How many accepted nodes, from the root's child down, the model drafter forwarded (its cache holds their rows):
    the leading ones with a cache row (``kv_slot`` read with the verdict)."""
    count = 0
    for node in accepted:
        if slots[node] < 0:
            break
        count += 1
    return count


class ModelDraftingMethod(Method):
    """Shared plumbing: one model drafter (a small LM or an EAGLE-3 head) committed after every verification."""

    needs_drafter = True

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        self.drafter = make_model_drafter(models.drafter, models.target)
        self.roots = RootTrees()
        self._spreads: dict[tuple[int, int], torch.Tensor] = {}  # ``DenseMethod.spread`` by (parents, k)

    def start(self, prefill) -> None:
        self.drafter.reset()

    def readback(self, tree: DraftTree, verdict: StepVerdict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # every node's cache row as it is: the host finds the forwarded prefix of the accepted path in Python,
        # cheaper than the handful of tensor ops that would count it on the device
        return (tree.kv_slot,)

    def observe(self, observation: Observation) -> None:
        forwarded = None
        if observation.host:
            forwarded = forwarded_prefix(host_value(observation.host[0]), observation.accepted_nodes)
        self.drafter.commit(observation.tree, observation.path, forwarded)

    def drafter_calls(self) -> dict[str, int]:
        return {self.drafter.name: self.drafter.calls}


@dataclass(frozen=True)
class Frontier:
    """The nodes a dense layer expands next, with their scores (the top-k that chose them returned those) and depth."""

    nodes: torch.Tensor  # [p] node indices
    scores: torch.Tensor | None  # [p] their cumulative log-probs; None for the root alone (score 0)
    depth: int  # tree depth of every node in it

    @classmethod
    def root(cls, device: torch.device) -> Frontier:
        return cls(torch.zeros(1, dtype=torch.long, device=device), None, 0)


@dataclass(frozen=True)
class GrownDraft:
    """The pool so far as the generic builder grows it (a tree written layer by layer), answering as ``DenseDraft``."""

    tree: DraftTree
    frontier: Frontier  # the last layer's K best nodes

    @property
    def size(self) -> int:
        return self.tree.size

    def best_score(self) -> torch.Tensor:  # [] on the device
        """The best cumulative score of the last layer's nodes (its frontier's first)."""
        return self.frontier.scores[0]

    def top_by_score(self, budget: int, capacity: int = 0) -> DraftTree:  # capacity: a tree grows as it needs
        return self.tree.top_by_score(budget)


PoolDraft = DenseDraft | GrownDraft  # the pool after a layer, on the layout or as a grown tree


@register
class ChainMethod(ModelDraftingMethod):
    """Classic speculative decoding: the drafter's greedy chain of ``tree.depth`` tokens."""

    name = "chain"
    description = "drafter's greedy chain of depth tokens (classic speculative decoding)"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        self.length = min(config.tree.depth, config.tree.budget)
        # a chain is the dense tree one node wide: a drafter whose forwards need no tree drafts it on that layout
        self.layout = DenseLayout(self.drafter, self.length, 1, self.length) if self.drafter.forwards_blocks else None

    def draft(self, committed: torch.Tensor) -> DraftTree:
        if self.layout is not None:
            return self.layout.draft(committed)
        length = self.length
        tree = self.roots.tree(committed[-1:], self.drafter.device, capacity=length + 1)
        logits = self.drafter.begin_step(committed)[None]
        last = torch.zeros(1, dtype=torch.long, device=tree.device)
        for depth in range(1, length + 1):
            score, token = log_softmax_float32(logits[-1:]).max(dim=-1)
            last = tree.append_children(last, token, tree.scores[last] + score, ORIGIN_MODEL)
            if depth < length:
                logits = self.drafter.forward_nodes(tree, last, ancestors_forwarded=True)
        return tree


@register
class DenseMethod(ModelDraftingMethod):
    """EAGLE-2 dynamic tree: expand the top-K frontier by cumulative score for D depths, keep the top N."""

    name = "dense"
    description = "EAGLE-2-style dynamic tree from the model drafter (depth D, frontier K, top-N)"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        tree = config.tree
        # a drafter whose forwards need no tree drafts on the fixed layout (the same tree, fewer tensor calls)
        self.layout = DenseLayout(self.drafter, tree.depth, tree.top_k, tree.budget) if self.drafter.forwards_blocks else None

    def draft(self, committed: torch.Tensor) -> DraftTree:
        *_, drafted = self.layers(committed)  # every layer: the pool after the last
        return drafted.top_by_score(self.config.tree.budget)

    def layers(self, committed: torch.Tensor) -> Iterator[PoolDraft]:  # committed: [L], root last
        """The candidate pool after each of the D layers: K children of the root, then K children of each of the
        K best new nodes per layer. A caller that stops early spares the forwards of the layers after."""
        if self.layout is not None:
            yield from self.layout.layers(committed)
            return
        k, depth = self.config.tree.top_k, self.config.tree.depth
        tree = self.roots.tree(committed[-1:], self.drafter.device, capacity=1 + k + (depth - 1) * k * k)
        root_logits = self.drafter.begin_step(committed)
        frontier = self.expand(tree, Frontier.root(tree.device), root_logits[None], k)
        yield GrownDraft(tree, frontier)
        for _ in range(depth - 1):
            logits = self.drafter.forward_nodes(tree, frontier.nodes, ancestors_forwarded=True)
            frontier = self.expand(tree, frontier, logits, k)
            yield GrownDraft(tree, frontier)

    def expand(
        self,
        tree: DraftTree,
        parents: Frontier,  # p nodes
        logits: torch.Tensor,  # [p, vocab] drafter logits at the parents
        k: int,
    ) -> Frontier:
        """Add each parent's top-k children; return the k best new nodes (the next frontier).

        The parents are the last frontier, childless, and a top-k never repeats a token: every child is new.
        """
        top_logp, top_tokens = torch.topk(log_softmax_float32(logits), k, dim=-1)  # [p, k]
        p = parents.nodes.shape[0]
        parent_of = parents.nodes.index_select(0, self.spread(p, k))  # [p * k] parent by parent
        # the parents' scores came with them from the last top-k (the root's is 0: its children score their own)
        scores = top_logp.view(-1) if parents.scores is None else (parents.scores[:, None] + top_logp).view(-1)  # [p * k]
        first = tree.append(parent_of, top_tokens.flatten(), scores, ORIGIN_MODEL, depth=parents.depth + 1)
        best = torch.topk(scores, min(k, scores.shape[0]))
        return Frontier(best.indices + first, best.values, parents.depth + 1)  # the new nodes are first, first + 1, ...

    def spread(self, p: int, k: int) -> torch.Tensor:  # -> [p * k]
        """``[0] * k + [1] * k + ...``: each of ``p`` parents once per child (kept per shape: a gather is cheaper
        than a ``repeat_interleave`` per layer)."""
        key = (p, k)
        index = self._spreads.get(key)
        if index is None:
            index = self._spreads[key] = torch.arange(p, device=self.drafter.device).repeat_interleave(k)
        return index
