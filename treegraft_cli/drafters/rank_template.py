"""Rank templates: the static shape of a retrieved tree (DESIGN.md §4, Graft).

A template node ``u`` says "take successor number ``r_u`` of my parent's token": materialised from a
root by ``x_u = M[x_parent(u), r_u]`` against the adjacency table ``M``. The shape depends only on the
slot count, so it is built once per configuration, in Python, and every step only runs a handful of
batched gathers (one per depth).

How a template is derived
-------------------------
* Per-depth counts. The paper's 52-slot template is ``BASE_TEMPLATE = [8,10,8,6,5,4,4,4,3]`` (depth 1
  first). For ``S`` slots the base is scaled by ``S / 52`` with largest-remainder rounding (ties go to
  the shallower depth), then repaired so that every depth up to the deepest holds at least one node and
  at most ``k`` times the depth above; slots the repair frees extend the chain deeper. The counts sum to
  ``S`` exactly; ``scale_counts(BASE_TEMPLATE, 52, k)`` returns the base unchanged. An explicit count list
  (from a profile or ``--option``) replaces the scaled one.
* Which parent gets which child. Every node carries a prior weight ``w(u) = prod over its path of
  q(r)``, ``q(r) = 1 / (r + 2)`` (rank 0 is twice as likely as being wrong, and the odds fall with rank
  like the hit rates of a top-k successor list). Depth ``d + 1`` takes its ``count`` best children
  (parent at depth ``d``, rank ``r < k``) by ``w``. The rank-0 chain has the highest weight at every
  depth, so it is always present and reaches the deepest depth.
* Overflow candidates. Grafting merges retrieved tokens that duplicate an existing child; each merge
  frees a slot that goes to the next candidate. So a template is followed by an extension: the best
  further (parent, next rank) children by ``w``, best first, up to ``total`` candidates.

Candidates are stored in priority order (template by descending weight, then the extension in the
order it was grown). A child weighs strictly less than its parent, so every prefix of that order is
prefix-closed: cutting after the first ``n`` accepted candidates always leaves a valid tree.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

BASE_TEMPLATE = (8, 10, 8, 6, 5, 4, 4, 4, 3)  # the paper's 52-slot template, depth 1 first


def rank_log_prior(rank: int) -> float:
    """log q(r): the prior log-weight of taking successor ``rank`` of a row."""
    return -math.log(rank + 2)


def scale_counts(base: Sequence[int], slots: int, k: int) -> tuple[int, ...]:
    """Per-depth node counts for ``slots`` retrieval slots, shaped like ``base`` (see module docstring)."""
    if slots <= 0:
        return ()
    total = sum(base)
    raw = [c * slots / total for c in base]
    counts = [math.floor(x) for x in raw]
    by_remainder = sorted(range(len(raw)), key=lambda d: (-(raw[d] - counts[d]), d))
    for d in by_remainder[: slots - sum(counts)]:
        counts[d] += 1
    return _repair(counts, slots, k)


def _repair(counts: Sequence[int], slots: int, k: int) -> tuple[int, ...]:
    """No empty depth above a filled one, at most ``k`` children per parent, exactly ``slots`` nodes."""
    out: list[int] = []
    above, left = 1, slots
    for count in counts:
        if left == 0:
            break
        count = min(max(count, 1), above * k, left)
        out.append(count)
        above, left = count, left - count
    while left > 0:  # the repair took slots from deeper levels: extend the chain
        count = min(left, above * k)
        out.append(count)
        above, left = count, left - count
    return tuple(out)


@dataclass(frozen=True)
class RankTemplate:
    """Candidates in priority order; index ``-1`` in ``parents`` is the root."""

    parents: torch.Tensor  # [S] candidate index of the parent, -1 for the root
    ranks: torch.Tensor  # [S] successor rank within the parent's table row (0 = best)
    depths: torch.Tensor  # [S] 1 for the root's children
    log_prior: torch.Tensor  # [S] float32, log q(rank): the node's own step, added to its parent's score
    ancestry: torch.Tensor  # [S, S] uint8: row c marks candidate c and its ancestors among the candidates
    levels: tuple[torch.Tensor, ...]  # candidate indices at depth 1, 2, ...: one gather each
    template_size: int  # the first template_size candidates are the template, the rest its extension
    # per depth, each candidate's parent as a position among the candidates of the depth above (the root's children:
    # among the root alone), kept on the host: ``level_links`` builds from it without reading a device
    parent_positions: tuple[tuple[int, ...], ...] = ()

    @property
    def size(self) -> int:
        return self.parents.shape[0]

    def level_columns(self, device: torch.device) -> tuple[tuple[torch.Tensor, ...], ...]:
        """Per depth, on ``device``: (candidate indices, their slots = index + 1, parent slots, ranks, log priors);
        built once per device, for the per-depth gathers of grafting."""
        cache = self.__dict__.setdefault("_level_columns", {})  # frozen dataclass: a per-instance memo
        if device not in cache:
            cache[device] = tuple(
                tuple(t.to(device) for t in (level, level + 1, self.parents[level] + 1, self.ranks[level], self.log_prior[level]))
                for level in self.levels
            )
        return cache[device]

    def level_links(self, device: torch.device) -> tuple[torch.Tensor | None, ...]:
        """Per depth, each candidate's parent as a position among the candidates of the depth above (the root's
        children: among the root alone); None where that is every candidate above in order (a chain, or one parent
        with one child), so a depth worked out from the depth above as one tensor reads it without a gather;
        memoised per device."""
        cache = self.__dict__.setdefault("_level_links", {})
        if device not in cache:
            above = (1, *(len(positions) for positions in self.parent_positions))  # candidates per depth, the root's 1
            cache[device] = tuple(
                None if list(positions) == list(range(count)) else torch.tensor(positions, dtype=torch.long, device=device)
                for positions, count in zip(self.parent_positions, above, strict=False)
            )
        return cache[device]

    def tail(self, device: torch.device, n: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:  # [T] twice
        """The slots and the new node indices (in a tree of ``n`` nodes) of every candidate from depth ``first``
        (1-based) on, depth by depth: where grafting writes those depths at once; memoised."""
        cache = self.__dict__.setdefault("_tails", {})
        key = (device, n, first)
        if key not in cache:
            columns = self.level_columns(device)[first - 1 :]
            cache[key] = (torch.cat([slot for _, slot, *_ in columns]), torch.cat([level for level, *_ in columns]) + n)
        return cache[key]

    def root_scores(self, device: torch.device) -> torch.Tensor:  # [S] float32
        """Every candidate's score when grafted under a bare root (score 0, as every tree's root): its path's log
        priors summed in float32 depth by depth, as grafting sums them; memoised per device."""
        cache = self.__dict__.setdefault("_root_scores", {})
        if device not in cache:
            scores = torch.zeros(self.size + 1, device=device)  # slot 0: the root
            for _, slot, parent, _, prior in self.level_columns(device):
                scores.index_copy_(0, slot, scores.index_select(0, parent) + prior)
            cache[device] = scores[1:]
        return cache[device]

    def _on(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Whole-template columns on ``device``, copied once per device (a per-instance memo)."""
        cache = self.__dict__.setdefault("_columns_on", {})
        if device not in cache:
            cache[device] = {"parent_slots": (self.parents + 1).to(device), "depths": self.depths.to(device),
                             "fresh": torch.arange(self.size, device=device), "ancestry": self.ancestry.to(device),
                             "ranks": self.ranks.to(device), "log_prior": self.log_prior.to(device)}
        return cache[device]

    def kernel_columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Parent slots, ranks, log priors and depths, each ``[S]``, on ``device``: the whole template as the graft
        kernel reads it (``kernels.graft_candidates``)."""
        columns = self._on(device)
        return columns["parent_slots"], columns["ranks"], columns["log_prior"], columns["depths"]

    def ancestry_on(self, device: torch.device) -> torch.Tensor:  # [S, S] uint8
        """Each candidate's ancestors among the candidates, itself included, as 0/1 bytes (``argmax`` finds the
        shallowest: candidates are in priority order, parents first) on ``device``."""
        return self._on(device)["ancestry"]

    def fresh_levels(self, device: torch.device, n: int) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]:
        """Per depth, the node indices its candidates get when new in a tree of ``n`` nodes (``n`` + candidate
        index), flat and as a column, and the node index each one's parent gets when new (the root's children:
        the root, 0); memoised per device and tree size (a stage grafts on trees of one size)."""
        cache = self.__dict__.setdefault("_fresh_levels", {})
        key = (device, n)
        if key not in cache:
            cache[key] = tuple(
                (level + n, (level + n)[:, None], torch.where(parent > 0, parent + (n - 1), 0))
                for level, _, parent, *_ in self.level_columns(device)
            )
        return cache[key]

    def fresh_slots(self, device: torch.device, n: int) -> torch.Tensor:  # [1 + S]
        """Each slot's node index when every candidate is new in a tree of ``n`` nodes: the root (0) at slot 0, then
        ``n`` + candidate index; memoised (copy it before writing)."""
        cache = self.__dict__.setdefault("_fresh_slots", {})
        key = (device, n)
        if key not in cache:
            cache[key] = torch.cat([torch.zeros(1, dtype=torch.long, device=device), self._on(device)["fresh"] + n])
        return cache[key]

    def parent_slots_on(self, device: torch.device) -> torch.Tensor:  # [S]
        """Each candidate's parent slot (its parent's candidate index + 1; the root's slot 0) on ``device``."""
        return self._on(device)["parent_slots"]

    def fresh_depths(self, device: torch.device) -> torch.Tensor:  # [S]
        return self._on(device)["depths"]

    @property
    def counts(self) -> tuple[int, ...]:
        """Nodes per depth among the template part (without the extension)."""
        depths = self.depths[: self.template_size]
        deepest = int(depths.max()) if depths.numel() else 0
        return tuple(int((depths == d).sum()) for d in range(1, deepest + 1))


def build_template(
    counts: Sequence[int], total: int, k: int, device: torch.device | str = "cpu"
) -> RankTemplate:
    """The template with per-depth ``counts`` plus its extension, ``max(total, sum(counts))`` candidates at most."""
    nodes = _template_nodes(counts, k)  # (log weight, depth, parent, rank); parent indexes nodes, -1 root
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i][0], nodes[i][1], i))
    nodes = _reindex(nodes, order)
    template_size = len(nodes)
    nodes += _extension(nodes, total - template_size, k)
    return _to_tensors(nodes, template_size, device)


def _template_nodes(counts: Sequence[int], k: int) -> list[tuple[float, int, int, int]]:
    nodes: list[tuple[float, int, int, int]] = []
    level = [(-1, 0.0)]  # (node index, log weight) of the previous depth; the root first
    for depth, count in enumerate(counts, start=1):
        candidates = [
            (weight + rank_log_prior(rank), position, rank, parent)
            for position, (parent, weight) in enumerate(level)
            for rank in range(k)
        ]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        level = []
        for weight, _, rank, parent in candidates[:count]:
            level.append((len(nodes), weight))
            nodes.append((weight, depth, parent, rank))
    return nodes


def _reindex(nodes: list[tuple[float, int, int, int]], order: list[int]) -> list[tuple[float, int, int, int]]:
    new_index = {old: new for new, old in enumerate(order)}
    new_index[-1] = -1
    return [(nodes[i][0], nodes[i][1], new_index[nodes[i][2]], nodes[i][3]) for i in order]


def _extension(nodes: list[tuple[float, int, int, int]], extra: int, k: int) -> list[tuple[float, int, int, int]]:
    """Grow ``extra`` more candidates best-first: each node offers its next unused rank."""
    if extra <= 0:
        return []
    used = {-1: 0}
    weights = {-1: 0.0}
    depths = {-1: 0}
    for index, (weight, depth, parent, _) in enumerate(nodes):
        used[parent] = used.get(parent, 0) + 1
        used.setdefault(index, 0)
        weights[index], depths[index] = weight, depth
    heap = [(-(weights[n] + rank_log_prior(used[n])), n) for n in used if used[n] < k]  # max-heap by weight
    heapq.heapify(heap)
    added: list[tuple[float, int, int, int]] = []
    while heap and len(added) < extra:
        negative_weight, parent = heapq.heappop(heap)
        index = len(nodes) + len(added)
        added.append((-negative_weight, depths[parent] + 1, parent, used[parent]))
        used[parent] += 1
        weights[index], depths[index], used[index] = -negative_weight, depths[parent] + 1, 0
        if used[parent] < k:
            heapq.heappush(heap, (-(weights[parent] + rank_log_prior(used[parent])), parent))
        heapq.heappush(heap, (-(weights[index] + rank_log_prior(0)), index))
    return added


def _to_tensors(nodes: list[tuple[float, int, int, int]], template_size: int, device) -> RankTemplate:
    depths = torch.tensor([n[1] for n in nodes], dtype=torch.long, device=device)
    ranks = torch.tensor([n[3] for n in nodes], dtype=torch.long, device=device)
    max_depth = max((n[1] for n in nodes), default=0)
    by_depth: list[list[int]] = [[] for _ in range(max_depth + 1)]  # candidate indices per depth, the root at 0
    by_depth[0].append(-1)
    for index, node in enumerate(nodes):
        by_depth[node[1]].append(index)
    positions = [{candidate: position for position, candidate in enumerate(level)} for level in by_depth]
    ancestry = [[0] * len(nodes) for _ in nodes]
    for index, node in enumerate(nodes):  # a parent comes before its children
        if node[2] >= 0:
            ancestry[index] = list(ancestry[node[2]])
        ancestry[index][index] = 1
    return RankTemplate(
        parents=torch.tensor([n[2] for n in nodes], dtype=torch.long, device=device),
        ranks=ranks,
        depths=depths,
        log_prior=torch.tensor([rank_log_prior(n[3]) for n in nodes], dtype=torch.float32, device=device),
        ancestry=torch.tensor(ancestry, dtype=torch.uint8, device=device).reshape(len(nodes), len(nodes)),
        levels=tuple(torch.nonzero(depths == d).flatten() for d in range(1, max_depth + 1)),
        template_size=template_size,
        parent_positions=tuple(tuple(positions[d - 1][nodes[i][2]] for i in by_depth[d]) for d in range(1, max_depth + 1)),
    )
