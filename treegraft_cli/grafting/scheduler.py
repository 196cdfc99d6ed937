"""The call scheduler's side of TreeGraft: state, the 17 features, the cost model and the call policies.

Per tree layer a ``CallPolicy`` looks at a ``SchedulerState`` and says call (strong drafter) or skip
(weak n-gram expansion). ``decide`` enforces the per-step call budget for every policy; subclasses
only say whether they *want* the call. A learned scheduler (an MLP over ``features(state)``) plugs in
as ``MarginPolicy(margin_fn)``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ..errors import ConfigError
from ..tree import DraftTree
from .config import TreeGraftConfig, parse_layers
from .tree_ops import monotone_scores, top_nodes

FEATURE_NAMES = (
    "log1p_prompt_length",
    "verify_ms",
    "strong_ms",
    "log_cost_ratio",
    "layer_fraction",
    "calls_fraction",
    "called_layer_1",
    "called_layer_2",
    "called_layer_3",
    "called_layer_4",
    "called_layer_5",
    "frontier_mean_depth",
    "frontier_leaf_share",
    "reselect_depth_loss",
    "reselect_outside_share",
    "reselect_overlap",
    "reselect_mean_score",
)


@dataclass(frozen=True)
class CostModel:
    """Measured costs on this device: one target verification of a full tree, one strong drafter call."""

    verify_ms: float
    strong_ms: float

    @property
    def log_ratio(self) -> float:
        """log(verify / strong); 0 when either is unknown."""
        if self.verify_ms <= 0 or self.strong_ms <= 0:
            return 0.0
        return math.log(self.verify_ms / self.strong_ms)


@dataclass(frozen=True)
class SchedulerState:
    """What a policy sees before building ``layer``. Tensors are views of the live tree: do not mutate."""

    tree: DraftTree
    frontier: torch.Tensor  # [f] node indices the next weak expansion would use
    candidates: torch.Tensor  # [num_nodes] bool: where a strong call could graft now
    layer: int  # 1-based layer about to be built
    num_layers: int  # D
    called: tuple[int, ...]  # layers called so far this step
    prompt_length: int
    costs: CostModel
    width: int  # K
    budget: int  # N

    def reselection(self) -> torch.Tensor:
        """[≤K] the grafting positions a strong call would pick on the current scores (before rescoring)."""
        return top_nodes(self.tree.scores, self.candidates, self.width)


def features(state: SchedulerState) -> torch.Tensor:
    """[17] float32, in DESIGN.md §4 order (``FEATURE_NAMES``); empty sets give 0 (share outside: 1)."""
    tree, frontier = state.tree, state.frontier
    chosen = state.reselection()
    f_depths = tree.depths[frontier].float()
    c_depths = tree.depths[chosen].float()
    parents_marked = torch.zeros(tree.num_nodes, dtype=torch.bool, device=tree.device)
    parents_marked[tree.parents[1:]] = True
    frontier_depth = float(f_depths.mean()) if frontier.numel() else 0.0
    chosen_depth = float(c_depths.mean()) if chosen.numel() else frontier_depth
    in_frontier = torch.isin(chosen, frontier)
    outside = ~torch.isin(tree.depths[chosen], tree.depths[frontier])
    called = [1.0 if b in state.called else 0.0 for b in range(1, 6)]
    values = [
        math.log1p(state.prompt_length),
        state.costs.verify_ms,
        state.costs.strong_ms,
        state.costs.log_ratio,
        state.layer / state.num_layers,
        len(state.called) / state.num_layers,
        *called,
        frontier_depth,
        float((~parents_marked[frontier]).float().mean()) if frontier.numel() else 0.0,
        max(0.0, frontier_depth - chosen_depth),
        float(outside.float().mean()) if chosen.numel() else 1.0,
        float(in_frontier.float().mean()) if chosen.numel() else 0.0,
        float(tree.scores[chosen].mean()) if chosen.numel() else 0.0,
    ]
    return torch.tensor(values, dtype=torch.float32)


class CallPolicy(ABC):
    """Decides call/skip per layer; at most ``call_budget`` calls per step, none without a grafting position."""

    name = ""

    def __init__(self, call_budget: int):
        self.call_budget = call_budget

    def decide(self, state: SchedulerState) -> bool:
        if len(state.called) >= self.call_budget or not bool(state.candidates.any()):
            return False
        return self.wants_call(state)

    @abstractmethod
    def wants_call(self, state: SchedulerState) -> bool:
        """The policy's own preference, before the budget."""


class AllSmall(CallPolicy):
    name = "all-small"

    def wants_call(self, state: SchedulerState) -> bool:
        return False


class AllMid(CallPolicy):
    name = "all-mid"

    def wants_call(self, state: SchedulerState) -> bool:
        return True


class FixedLayers(CallPolicy):
    name = "fixed"

    def __init__(self, call_budget: int, layers: tuple[int, ...]):
        super().__init__(call_budget)
        self.layers = frozenset(layers)

    def wants_call(self, state: SchedulerState) -> bool:
        return state.layer in self.layers


class MarginPolicy(CallPolicy):
    """Call iff ``margin_fn(features(state)) > 0``: the hook for a distilled scheduler."""

    name = "margin"

    def __init__(self, call_budget: int, margin_fn: Callable[[torch.Tensor], float]):
        super().__init__(call_budget)
        self.margin_fn = margin_fn

    def wants_call(self, state: SchedulerState) -> bool:
        return float(self.margin_fn(features(state))) > 0


class CostAwareRule(CallPolicy):
    """Myopic rule: call iff the call raises this step's expected tokens per modelled millisecond.

    Scores are read as acceptance estimates: a node is accepted with probability ≈ exp(score), so the
    tree cut to N is worth E = 1 + Σ exp(top-N scores) tokens. A call would graft under the K positions
    a reselection picks; at position u the reach probability is exp(s(u)), its existing children already
    cover c(u) = min(1, Σ exp(s(child) − s(u))) of the next token, and the strong children are assumed to
    capture ``hit_rate`` of the rest: one virtual child scored s(u) + log(hit_rate·(1 − c(u))). The gain
    is E with those children minus E without (both cut to N). With T = verify_ms + calls·strong_ms the
    step's modelled time, call iff (E + gain) / (T + strong_ms) > E / T.
    """

    name = "cost-aware"

    def __init__(self, call_budget: int, hit_rate: float):
        super().__init__(call_budget)
        self.hit_rate = hit_rate

    def wants_call(self, state: SchedulerState) -> bool:
        costs = state.costs
        if costs.strong_ms <= 0:
            return True
        expected, gain = self.expected_and_gain(state)
        elapsed = costs.verify_ms + len(state.called) * costs.strong_ms
        return (expected + gain) * elapsed > expected * (elapsed + costs.strong_ms)

    def expected_and_gain(self, state: SchedulerState) -> tuple[float, float]:
        tree = state.tree
        scores = monotone_scores(tree)
        positions = state.reselection()
        relative = torch.exp(scores[1:] - scores[tree.parents[1:]])
        covered = torch.zeros(tree.num_nodes).index_add_(0, tree.parents[1:].cpu(), relative.cpu()).clamp(max=1.0)
        room = self.hit_rate * (1.0 - covered[positions.cpu()])
        virtual = scores[positions].cpu() + torch.log(room.clamp(min=1e-12))
        before = _expected_tokens(scores[1:].cpu(), state.budget)
        after = _expected_tokens(torch.cat([scores[1:].cpu(), virtual]), state.budget)
        return before, after - before


def _expected_tokens(scores: torch.Tensor, budget: int) -> float:  # scores: [n] non-root
    best = torch.topk(scores, min(budget, scores.numel())).values if scores.numel() else scores
    return 1.0 + float(torch.exp(best).sum())


def _learned(argument: str, options: TreeGraftConfig) -> CallPolicy:
    """``learned`` / ``learned:FILE``: the distilled MLP of ``treegraft distill`` (``scheduler`` option or FILE)."""
    from ..scheduling.artifact import load_scheduler  # here, not at the top: that module imports this one

    path = argument or options.scheduler
    if not path:
        raise ConfigError("call policy 'learned' needs a scheduler artifact", "pass -o scheduler=FILE (from treegraft distill)")
    return load_scheduler(path).policy(options.call_budget)


def _fixed(argument: str, options: TreeGraftConfig) -> CallPolicy:
    return FixedLayers(options.call_budget, parse_layers(argument) if argument else options.layers)


LEARNED = "learned"

# policy name → factory(argument after ':', settings); a learned scheduler adds its entry here
POLICY_FACTORIES: Mapping[str, Callable[[str, TreeGraftConfig], CallPolicy]] = MappingProxyType(
    {
        AllSmall.name: lambda argument, options: AllSmall(options.call_budget),
        AllMid.name: lambda argument, options: AllMid(options.call_budget),
        FixedLayers.name: _fixed,
        CostAwareRule.name: lambda argument, options: CostAwareRule(options.call_budget, options.hit_rate),
        LEARNED: _learned,
    }
)


def make_policy(spec: str, options: TreeGraftConfig) -> CallPolicy:
    """A policy from its spec: ``all-small``, ``all-mid``, ``fixed`` / ``fixed:1,3``, ``cost-aware``, ``learned[:FILE]``."""
    name, _, argument = spec.partition(":")
    factory = POLICY_FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown call policy {spec!r}", f"choose one of: {', '.join(POLICY_FACTORIES)}")
    return factory(argument, options)
