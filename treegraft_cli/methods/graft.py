"""Graft (prune-then-graft, DESIGN.md §4) and its retrieval-only baseline ``adjacency``.

``adjacency`` (Token Recycling-style): every tree is the rank template of budget N materialised from
the root through the online adjacency table; no model drafter.

``graft``: EAGLE-2 dense drafting (the same pool ``dense`` builds) with confidence checkpoints. A
checkpoint ``d`` is a 0-based drafting layer (layer ``d`` holds the nodes at tree depth ``d + 1``,
the paper's indexing); after that layer is drafted, ``c_d = exp(max cumulative log-prob at that depth)``
is compared with ``τ_d``. The first checkpoint with ``c_d < τ_d`` fires: drafting stops, the stage's
``K_draft`` best draft nodes are kept (prefix-closed) and the remaining ``N - kept`` slots are grafted
from that stage's retrieval template (merged under the shared root, duplicates merged per parent).
No checkpoint fires: the top-N of the full pool, exactly like ``dense``. A checkpoint whose firing cannot
change the tree (τ_d = 0, or on the last layer with ``K_draft`` ≥ N) is judged after verification, in
the step's one read, so it costs no synchronisation of its own. A checkpoint at or past the
last drafted layer (``--depth`` D layers) is checked on the last layer, so the paper's (0, 1, 5) works
with any D. ``K_draft`` above N is read as N.

Stage templates: ``templates[i]`` (per-depth counts) if given, else ``base_template`` scaled to
``N - K_draft_i`` slots (see ``drafters/rank_template.py``), or to ``graft_nodes[i]`` when that is fewer. The
paper fills every freed slot: on a GPU a verification costs about the same for any tree up to the budget. Where
each verified node costs time (a CPU: tens of milliseconds per node next to a few hundred for the root),
``graft_nodes`` lets a stage graft only as many retrieved nodes as pay for their verification; the tree then
holds fewer than N nodes. Stage statistics go to ``drafter_calls()``:
``{"model": forwards, "adjacency": 1, "graft_stage_<i>": 1}`` where ``i`` indexes ``checkpoints``.

The adjacency table is kept across requests (one method object per decoder); its rows are refreshed
from every prompt's prefill; ``reset_table()`` clears it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backends import select_backend
from ..config import DecodeConfig
from ..drafters.adjacency import AdjacencyTable
from ..drafters.rank_template import BASE_TEMPLATE, RankTemplate, build_template, scale_counts
from ..errors import ConfigError
from ..syncs import host_value, read
from ..tree import DraftTree, RootTrees
from ..verify import StepVerdict
from .base import Method, Models, Observation, Prefill, register
from .model_drafting import DenseMethod, PoolDraft


def _check(condition: bool, message: str, hint: str) -> None:
    if not condition:
        raise ConfigError(message, hint)


def _check_counts(counts: tuple[int, ...], name: str) -> None:
    _check(all(isinstance(c, int) and c >= 1 for c in counts), f"{name} {counts} must hold positive integers",
           "give nodes per depth, depth 1 first, e.g. [8,10,8,6,5,4,4,4,3]")


@dataclass(frozen=True)
class AdjacencyConfig:
    """Options of ``adjacency`` (``--option key=value``)."""

    table_k: int = 8  # successors kept per vocabulary token
    template: tuple[int, ...] = ()  # nodes per depth; empty: base_template scaled to the budget
    base_template: tuple[int, ...] = BASE_TEMPLATE

    def __post_init__(self) -> None:
        _check(self.table_k >= 1, f"table_k {self.table_k} < 1", "use --option table_k=8")
        _check_counts(self.template, "template")
        _check(len(self.base_template) > 0, "base_template is empty", "give nodes per depth")
        _check_counts(self.base_template, "base_template")


@dataclass(frozen=True)
class GraftConfig:
    """Options of ``graft`` (``--option key=value``); one entry per checkpoint in each tuple."""

    checkpoints: tuple[int, ...] = (0, 1, 5)  # 0-based drafting layers
    thresholds: tuple[float, ...] = (0.35, 0.2, 0.05)  # τ_d: fire when c_d < τ_d
    draft_nodes: tuple[int, ...] = (8, 24, 40)  # K_draft kept when the stage fires
    # the most retrieved nodes a firing stage grafts; empty: every freed slot (N - K_draft), as the paper
    graft_nodes: tuple[int, ...] = ()
    templates: tuple[tuple[int, ...], ...] = ()  # per-stage nodes per depth; empty: scaled base_template
    base_template: tuple[int, ...] = BASE_TEMPLATE
    table_k: int = 8

    def __post_init__(self) -> None:
        n = len(self.checkpoints)
        _check(n >= 1, "graft needs at least one checkpoint", "use --option checkpoints=[0,1,5]")
        _check(len(self.thresholds) == n and len(self.draft_nodes) == n,
               f"{n} checkpoints but {len(self.thresholds)} thresholds and {len(self.draft_nodes)} draft_nodes",
               "give one threshold and one draft_nodes entry per checkpoint")
        _check(all(b > a for a, b in zip(self.checkpoints, self.checkpoints[1:], strict=False)) and min(self.checkpoints) >= 0,
               f"checkpoints {self.checkpoints} must be increasing layers >= 0", "e.g. --option checkpoints=[0,1,5]")
        _check(all(0 <= t <= 1 for t in self.thresholds), f"thresholds {self.thresholds} outside [0, 1]",
               "a confidence is a probability; 0 never fires")
        _check(all(k >= 0 for k in self.draft_nodes), f"draft_nodes {self.draft_nodes} < 0", "e.g. [8,24,40]")
        _check(len(self.templates) in (0, n), f"{len(self.templates)} templates for {n} checkpoints",
               "give one template per checkpoint or none")
        _check(len(self.graft_nodes) in (0, n) and all(g >= 0 for g in self.graft_nodes),
               f"graft_nodes {self.graft_nodes} for {n} checkpoints", "give one count >= 0 per checkpoint or none")
        _check(not (self.graft_nodes and self.templates), "graft_nodes and templates both given",
               "a template fixes each stage's retrieved nodes: give one of them")
        for template in self.templates:
            _check_counts(template, "template")
        _check(len(self.base_template) > 0, "base_template is empty", "give nodes per depth")
        _check_counts(self.base_template, "base_template")
        _check(self.table_k >= 1, f"table_k {self.table_k} < 1", "use --option table_k=8")


def adjacency_table(k: int, device: torch.device, kernels: str) -> AdjacencyTable:
    """An empty table on ``device`` that grafts with the ``--kernels`` backend's functions."""
    backend = select_backend(kernels, device)
    return AdjacencyTable(k, device, backend.graft_candidates, backend.appended_nodes)


@register
class AdjacencyMethod(Method):
    """Retrieval only: the budget-N rank template materialised from the root through the table."""

    name = "adjacency"
    options_class = AdjacencyConfig
    description = "retrieval-only trees from the online adjacency table (Token Recycling-style)"
    carried_state = "adjacency table"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        budget, k = config.tree.budget, self.options.table_k
        counts = self.options.template or scale_counts(self.options.base_template, budget, k)
        device = models.target.device
        self.template = build_template(counts, budget, k, device)
        self.table = adjacency_table(k, device, config.kernels)
        self.roots = RootTrees()

    def reset_table(self) -> None:
        self.table.reset()

    def reset(self) -> None:
        self.table.reset()

    def start(self, prefill: Prefill) -> None:
        self.table.write_prompt(prefill.prompt_ids, prefill.logits)

    def draft(self, committed: torch.Tensor) -> DraftTree:
        tree = self.roots.tree(committed[-1:], self.models.target.device, capacity=self.config.tree.budget + 1)
        return self.table.graft(tree, self.template, self.config.tree.budget)

    def observe(self, observation: Observation) -> None:
        self.table.write_verified(observation.tree, [0, *observation.accepted_nodes], observation.logits)

    def drafter_calls(self) -> dict[str, int]:
        return {"adjacency": 1}


@dataclass(frozen=True)
class Stage:
    """One checkpoint, resolved against the tree config."""

    layer: int  # drafting layer it is checked after
    log_threshold: float  # log τ_d: fire when the best score at that layer is below it
    draft_nodes: int  # K_draft, at most N
    graft_nodes: int  # the most retrieved nodes its graft adds (N: every freed slot)
    template: RankTemplate

    def slots(self, kept: DraftTree, budget: int) -> int:
        """Retrieved nodes a graft onto ``kept`` may add: the freed slots, at most ``graft_nodes``."""
        return min(budget - kept.size, self.graft_nodes)


@register
class GraftMethod(DenseMethod):
    """Dense drafting pruned at confidence checkpoints, the freed slots grafted from the adjacency table."""

    name = "graft"
    options_class = GraftConfig
    description = "dense drafting with confidence checkpoints; pruned slots filled by adjacency retrieval"
    carried_state = "adjacency table"

    def __init__(self, models: Models, config: DecodeConfig):
        super().__init__(models, config)
        device = models.drafter.device  # grafted onto the drafter's trees
        self.table = adjacency_table(self.options.table_k, device, config.kernels)
        self.stages = self._stages(models.drafter.device)
        self.fired: int | None = None  # the stage that fired in the last step
        self.deferred: tuple[list[int], torch.Tensor] | None = None  # stages judged after the step, their log c_d

    def _stages(self, device: torch.device) -> tuple[Stage, ...]:
        options, budget, last_layer = self.options, self.config.tree.budget, self.config.tree.depth - 1
        stages = []
        for i, checkpoint in enumerate(options.checkpoints):
            kept = min(options.draft_nodes[i], budget)
            graft_nodes = options.graft_nodes[i] if options.graft_nodes else budget
            counts = options.templates[i] if options.templates else scale_counts(
                options.base_template, min(budget - kept, graft_nodes), options.table_k
            )
            stages.append(Stage(
                layer=min(checkpoint, last_layer),
                log_threshold=math.log(options.thresholds[i]) if options.thresholds[i] > 0 else -math.inf,
                draft_nodes=kept,
                graft_nodes=graft_nodes,
                template=build_template(counts, budget, options.table_k, device),
            ))
        return tuple(stages)

    def reset_table(self) -> None:
        self.table.reset()

    def reset(self) -> None:
        self.table.reset()

    def start(self, prefill: Prefill) -> None:
        super().start(prefill)
        self.table.write_prompt(prefill.prompt_ids, prefill.logits)

    def draft(self, committed: torch.Tensor) -> DraftTree:
        self.fired, self.deferred = None, None
        for layer, drafted in enumerate(self.layers(committed)):
            grafted = self.checkpoint(drafted, layer)
            if grafted is not None:
                return grafted
        return drafted.top_by_score(self.config.tree.budget)

    def checkpoint(self, drafted: PoolDraft, layer: int) -> DraftTree | None:
        """The grafted tree when a checkpoint on ``layer`` fires (``self.fired`` set), else None.

        ``drafted``: the pool drafted up to ``layer``; its ``best_score`` is log c_d, the best score the layer
        drafted (``confidence`` finds it in a tree).

        One read decides it: the layer's confidence, packed with how many nodes the graft of the first stage
        that can fire would add. That graft is worked out before the read (``AdjacencyTable.prepare`` touches
        no tree), so a firing checkpoint costs no second read; when no stage fires it is dropped.
        """
        stages = [i for i, stage in enumerate(self.stages) if stage.layer == layer]
        if not stages:
            return None
        best = drafted.best_score()
        if all(self.changes_nothing(self.stages[i], drafted) for i in stages):
            self.deferred = (stages, best)
            return None
        guess = next((i for i in stages if self.stages[i].log_threshold > -math.inf), stages[0])
        stage = self.stages[guess]
        # room for the whole budget: the graft appends to the kept nodes
        kept = drafted.top_by_score(stage.draft_nodes, capacity=self.config.tree.budget + 1)
        pending = self.table.prepare(kept, stage.template, stage.slots(kept, self.config.tree.budget), layer + 1)
        if pending is None:
            log_confidence = read(best)
        else:
            log_confidence, count = read(torch.stack([best, pending.count]))
        self.fired = self.first_below(stages, log_confidence)
        if self.fired is None:
            return None
        if self.fired == guess and pending is not None:
            return self.table.finish(pending, int(count))
        return self.graft(drafted, self.stages[self.fired])

    def graft(self, drafted: PoolDraft, stage: Stage) -> DraftTree:
        """The stage's ``K_draft`` best nodes of the pool drafted up to the stage's layer, the freed slots grafted
        from the table."""
        kept = drafted.top_by_score(stage.draft_nodes, capacity=self.config.tree.budget + 1)
        return self.table.graft(kept, stage.template, stage.slots(kept, self.config.tree.budget), stage.layer + 1)

    @staticmethod
    def confidence(tree: DraftTree, layer: int) -> torch.Tensor:  # -> [] float32, on the device
        """log c_d: the best cumulative score among the nodes ``layer`` drafted (tree depth ``layer + 1``)."""
        return torch.where(tree.depths == layer + 1, tree.scores, float("-inf")).max()

    def stage_fired(self, tree: DraftTree, layer: int) -> int | None:
        """Index of the first checkpoint on ``layer`` whose confidence is below its threshold, else None (one read)."""
        stages = [i for i, stage in enumerate(self.stages) if stage.layer == layer]
        return self.first_below(stages, read(self.confidence(tree, layer))) if stages else None

    def changes_nothing(self, stage: Stage, drafted: PoolDraft) -> bool:
        """Firing ``stage`` now gives the tree that not firing gives: it never fires (τ_d = 0), or it is on the
        last layer and keeps the whole budget of a pool at least that large."""
        if stage.log_threshold == -math.inf:
            return True
        budget = self.config.tree.budget
        return stage.layer == self.config.tree.depth - 1 and stage.draft_nodes >= budget and drafted.size >= budget

    def first_below(self, stages: list[int], log_confidence: float) -> int | None:
        return next((i for i in stages if log_confidence < self.stages[i].log_threshold), None)

    def readback(self, tree: DraftTree, verdict: StepVerdict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        deferred = (self.deferred[1].reshape(1),) if self.deferred is not None else ()
        return super().readback(tree, verdict, logits) + deferred

    def observe(self, observation: Observation) -> None:
        if self.deferred is not None and len(observation.host) > 1:
            self.fired = self.first_below(self.deferred[0], float(host_value(observation.host[1])[0]))
        super().observe(observation)
        self.table.write_verified(observation.tree, [0, *observation.accepted_nodes], observation.logits)

    def drafter_calls(self) -> dict[str, int]:
        calls = super().drafter_calls()
        if self.fired is not None:
            calls["adjacency"] = 1
            calls[f"graft_stage_{self.fired}"] = 1
        return calls
