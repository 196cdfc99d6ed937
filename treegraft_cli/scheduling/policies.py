"""Call policies: the state a policy sees, its features (the paper's 17 and the extended set), the cost model
and the rules.

Per tree layer a ``CallPolicy`` looks at a ``SchedulerState`` and says call (strong drafter) or skip
(weak n-gram expansion). ``decide`` enforces the per-step call budget for every policy; subclasses
only say whether they *want* the call. A learned scheduler (an MLP over ``feature_vector(state)``) plugs in
as ``step_rule.LearnedLayerRule`` per layer or ``step_rule.LearnedStepRule`` per step. ``registry`` names them.
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from ..errors import ConfigError
from ..hostlists import flags as host_flags
from ..lm import on_device_of
from ..syncs import host_value
from ..tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree, float32
from .calibration import AcceptanceCalibration, host_columns


def top_nodes(scores: torch.Tensor, allowed: torch.Tensor, k: int) -> torch.Tensor:
    """Up to ``k`` allowed node indices, best score first; ties go to the lower index (the shallower)."""
    candidates = torch.nonzero(allowed).flatten()
    order = torch.sort(scores[candidates], descending=True, stable=True).indices
    return candidates[order[:k]]


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
# the extended set adds what the recent steps of the request measured (``history.StepHistory``)
HISTORY_FEATURE_NAMES = (
    "recent_tau_no_call",
    "recent_tau_one_call",
    "recent_tau_more_calls",
    "recent_ngram_acceptance",
    "recent_model_acceptance",
    "recent_rate",
)
# and how far behind the committed text the strong drafter is: what a call must catch up on first
LAG_FEATURE_NAMES = ("log1p_strong_lag",)
# and what a weak layer would hang now (``preview_features``): how much n-gram text this step could copy
PREVIEW_FEATURE_NAMES = ("preview_log1p_tokens", "preview_expected_tokens")
FEATURE_SETS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {"paper": FEATURE_NAMES,
     "extended": FEATURE_NAMES + HISTORY_FEATURE_NAMES + LAG_FEATURE_NAMES + PREVIEW_FEATURE_NAMES}
)
# a per-step scheduler (``step_rule.LearnedStepRule``) reads the layer-1 features and which strong kind it prices
STEP_KIND_NAMES = ("short", "full")
STEP_KIND_FEATURE_NAMES = tuple(f"kind_{name}" for name in STEP_KIND_NAMES)


def kind_one_hot(kind: str) -> torch.Tensor:  # -> [len(STEP_KIND_NAMES)]
    return torch.tensor([1.0 if kind == name else 0.0 for name in STEP_KIND_NAMES])


def check_distilled_pair(distilled_for: Mapping[str, Any], source: str, pair: str) -> None:
    """Refuse a scheduler distilled on another pair's rollouts (its labels and cost features describe that pair's
    drafters and hardware); an unknown pair on either side is not checked."""
    distilled = distilled_for.get("pair")
    if not pair or not distilled or distilled == pair:
        return
    identity = distilled_for.get("identity", "?")
    raise ConfigError(
        f"{source} was distilled for the pair {distilled} (cost profile {identity}), not {pair}",
        f"distill one for this pair (treegraft profile/collect/distill --pair {pair}, see the README), "
        "or decide with the step rule: -o policy=step",
    )


@dataclass(frozen=True)
class CostModel:
    """Measured costs on this device: one target verification of a full tree, one strong drafter call.

    ``verify_root_ms``, the verification of the root alone, makes the verify cost grow with the tree
    (linearly between the two; 0: unknown, every tree costs ``verify_ms``). ``verify_curve``, when measured,
    replaces that line by the measured points. A line misjudges small trees on a CPU, where a second row
    moves a matrix product off the one-row kernel and can cost more than the first (a 1.5B model in fp32 on
    an AVX2 core: 2 tokens 2.2× one, 17 tokens 5×); on a GPU the curve is nearly flat up to a tile, then steps.

    ``strong_token_ms`` is what one more token adds to a wide strong forward, the rate at which the drafter catches up
    on committed tokens it has not seen (a prompt): the slope of its forward between a call's 2·K tokens and a wide
    one (0: unknown).
    """

    verify_ms: float
    strong_ms: float
    verify_root_ms: float = 0.0
    # (tree tokens, ms) measured points, tokens ascending, the root alone being 1 token (``interpolate`` between)
    verify_curve: tuple[tuple[int, float], ...] = ()
    strong_token_ms: float = 0.0

    def verify_at(self, nodes: int, budget: int) -> float:
        """Modelled ms to verify a tree of ``nodes`` non-root nodes (at most ``budget`` count)."""
        if nodes < 0:
            return self._modelled(nodes, budget)
        budget = max(budget, 0)
        return self.verify_times(budget)[min(nodes, budget)]

    def verify_times(self, budget: int) -> tuple[float, ...]:  # [budget + 1]
        """``verify_at(m, budget)`` for m = 0..budget: the step rule weighs every count at every step, and on a
        measured curve each lookup would walk the curve again."""
        tables = self.__dict__.setdefault("_verify_tables", {})  # memo of a frozen value, not part of its identity
        if budget not in tables:
            tables[budget] = tuple(self._modelled(m, budget) for m in range(budget + 1))
        return tables[budget]

    def _modelled(self, nodes: int, budget: int) -> float:
        if self.verify_curve:
            tokens, times = zip(*self.verify_curve, strict=True)
            return interpolate(min(nodes, max(budget, 0)) + 1, tokens, times)
        if self.verify_root_ms <= 0 or budget <= 0:
            return self.verify_ms
        return self.verify_root_ms + (self.verify_ms - self.verify_root_ms) * min(nodes, budget) / budget

    def token_share(self, budget: int) -> float:
        """What one more token adds to a forward, as a share of a one-token forward: the verify curve's mean slope up
        to ``budget`` tokens over its root time (0 when the model is flat or the root time unknown)."""
        root = self.verify_at(0, budget)
        if not self.grows or budget <= 0 or root <= 0:
            return 0.0
        return max(0.0, self.verify_at(budget, budget) - root) / (budget * root)

    @property
    def grows(self) -> bool:
        """Whether a bigger tree costs more to verify (a flat model gives no reason to verify fewer nodes)."""
        return bool(self.verify_curve) or 0 < self.verify_root_ms < self.verify_ms

    def verified_count(self, reach: list[float], rate: float, budget: int) -> int:
        """How many of the best nodes to verify: the count m maximising Σ reach[:m] − rate · verify_at(m).

        ``reach`` holds the candidate nodes' expected accepted tokens, best first; ``rate`` is tokens per ms. Every
        count is weighed, not only the next node against the slope: on a CPU the first node past the root costs
        far more than the ones after it, so a tree can pay as a whole where no single node would. On a line this
        keeps every node whose reach is at least rate × the line's slope. Ties keep the larger tree."""
        times = self.verify_times(max(budget, 0))  # a budget of 0 or less verifies the root alone
        best, best_value, gained = 0, -rate * times[0], 0.0
        for m, value in enumerate(reach[:budget], start=1):
            gained += value
            worth = gained - rate * times[m]
            if worth >= best_value:
                best, best_value = m, worth
        return best

    @property
    def log_ratio(self) -> float:
        """log(verify / strong); 0 when either is unknown."""
        if self.verify_ms <= 0 or self.strong_ms <= 0:
            return 0.0
        return math.log(self.verify_ms / self.strong_ms)


def interpolate(x: float, xs: Sequence[int], ys: Sequence[float]) -> float:
    """Piecewise linear; clamped below the first point, extended along the last segment (not below its end)."""
    if len(xs) == 1 or x <= xs[0]:
        return float(ys[0])
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            slope = (ys[i] - ys[i - 1]) / (xs[i] - xs[i - 1])
            value = ys[i - 1] + slope * (x - xs[i - 1])
            return float(max(value, ys[i]) if x > xs[i] else value)
    return float(ys[-1])


def token_ms(narrow: tuple[int, float], wide: tuple[int, float]) -> float:
    """Ms one more token adds to a forward, from two timed forwards as (tokens, ms), ``wide`` the wider: the slope
    between them, 0 when the wider one timed no slower (noise) or is not wider (``CostModel.strong_token_ms``)."""
    (narrow_tokens, narrow_ms), (wide_tokens, wide_ms) = narrow, wide
    return max(0.0, wide_ms - narrow_ms) / (wide_tokens - narrow_tokens) if wide_tokens > narrow_tokens else 0.0


@dataclass(frozen=True)
class MeasuredValues:
    """What the step rule measured of each step kind at a decision: its τ (tokens), its time T (ms) and R."""

    taus: Mapping[str, float]
    times: Mapping[str, float]
    rate: float  # tokens per ms

    @property
    def values(self) -> dict[str, float]:
        """Each kind's value τ − R·T, in tokens."""
        return {name: tau - self.rate * self.times[name] for name, tau in self.taus.items()}

    def margins(self) -> dict[str, float]:
        """Each kind's value over a weak step's, in tokens: the rule takes the largest (weak at 0)."""
        values = self.values
        return {name: value - values["weak"] for name, value in values.items()}


@dataclass(frozen=True)
class WeakPreview:
    """The chains a skip would hang, before they are hung: parents and per-token target log-probs."""

    parents: torch.Tensor  # [c] node each chain hangs under
    logp: torch.Tensor  # [c, width] float32 log-prob of each chain token where the n-gram matched; -inf pads
    tokens: torch.Tensor | None = None  # [c, width] the chain tokens, 0-padded

    def reach(
        self,
        parent_reach: list[float],  # [num_nodes] calibrated reach of the tree's nodes
        node_rate: Callable[[int, float], float],  # (origin, local probability) -> measured rate
    ) -> list[float]:  # -> [chain tokens]
        """Calibrated reach of every chain token (-inf pads skipped): the parent's times the measured n-gram rates
        along the chain, in float32. The preview is on the host (the layer loop's trees are)."""
        reach = []
        for parent, row in zip(host_value(self.parents), host_value(self.logp), strict=True):
            product = parent_reach[parent]
            for logp in row:
                if math.isfinite(logp):
                    product *= node_rate(ORIGIN_NGRAM, float32(math.exp(logp)))
                    reach.append(float32(product))
        return reach


@dataclass(frozen=True)
class SchedulerState:
    """What a policy sees before building ``layer``. Tensors are views of the live tree: do not mutate."""

    tree: DraftTree
    frontier: torch.Tensor  # [f] node indices the next weak expansion would use
    window: tuple[int, ...]  # where a strong call could graft now (``graft_window``), ascending
    layer: int  # 1-based layer about to be built
    num_layers: int  # D
    called: tuple[int, ...]  # layers called so far this step
    prompt_length: int
    costs: CostModel
    width: int  # K
    budget: int  # N
    weak: WeakPreview | None = None  # what a skip would add, when the policy previews it
    strong_lag: int = 0  # committed tokens the strong drafter has not forwarded yet (its next call will)
    history: tuple[float, ...] = ()  # ``StepHistory.values()`` before this step; () when nobody measures it

    @functools.cached_property
    def candidates(self) -> torch.Tensor:  # [num_nodes] bool
        """``window`` as a mask over the tree's nodes, on its device (made when a feature reads it)."""
        flags = [False] * self.tree.num_nodes
        for node in self.window:
            flags[node] = True
        return on_device_of(host_flags(flags), self.tree.device)

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
    parents_marked.index_fill_(0, tree.parents[1:], True)
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


def feature_vector(state: SchedulerState, feature_set: str = "paper") -> torch.Tensor:
    """The features of ``FEATURE_SETS[feature_set]``: the paper's 17, or those, the history's (its prior values
    when the state carries none), the strong drafter's lag and the weak preview's."""
    base = features(state)
    if feature_set == "paper":
        return base
    history = state.history or (0.0,) * len(HISTORY_FEATURE_NAMES)
    extra = [*history, math.log1p(state.strong_lag), *preview_features(state)]
    return torch.cat([base, torch.tensor(extra, dtype=torch.float32)])


def preview_features(state: SchedulerState) -> tuple[float, float]:
    """``PREVIEW_FEATURE_NAMES``: the previewed n-gram chain tokens (log1p of their count) and the accepted tokens
    their own scores promise (Σ of the ``budget`` best cumulative probabilities along the chains, taken from their
    parents), both 0 without a preview. The scores are the target's past log-probs where the n-gram matched,
    uncalibrated: with the history's measured n-gram acceptance beside them, the scheduler learns what they are worth
    on the text at hand, as the step rule's discount does."""
    if state.weak is None:
        return 0.0, 0.0
    cumulative = []
    for row in host_value(state.weak.logp):
        total = 0.0
        for logp in row:
            if math.isfinite(logp):
                total += logp
                cumulative.append(math.exp(total))
    best = sorted(cumulative, reverse=True)[: state.budget]
    return math.log1p(len(cumulative)), sum(best)


def leading_layers(layers: Collection[int], num_layers: int, call_budget: int) -> int:
    """How many of layers 1, 2, ... are in ``layers`` without a gap (at most ``num_layers`` and ``call_budget``)."""
    leading = 0
    while leading + 1 in layers and leading < min(num_layers, call_budget):
        leading += 1
    return leading


class CallPolicy(ABC):
    """Decides call/skip per layer; at most ``call_budget`` calls per step, none without a grafting position."""

    name = ""
    uses_costs = False  # reads SchedulerState.costs: the method measures them at warm-up when not given
    feature_set = "paper"  # the features it reads (FEATURE_SETS); "extended" needs the request's StepHistory

    def __init__(self, call_budget: int):
        self.call_budget = call_budget

    def previews(self, layer: int) -> bool:
        """Whether the layer loop should look up the weak chains before asking (``SchedulerState.weak``)."""
        return False

    def planned_calls(self, num_layers: int) -> int:
        """Asked once the policy decided to call at layer 1: how many layers from the first it calls whatever the
        tree holds (0: later decisions read the state). The layer loop may run them on the strong drafter's device,
        reading once (``grafting.strong_run``)."""
        return 0

    def calls_first_layer(self, num_layers: int) -> bool:
        """Whether every step calls at layer 1, where the tree holds the root alone: the next step's first call may
        then run before this step's verdict is read (``LayerLoop.looks_ahead``)."""
        return False

    def plans_whole_steps(self, num_layers: int) -> bool:
        """Whether every step calls at layers 1..``num_layers`` whatever the tree holds, and neither ``trim`` nor
        ``observe`` reads the step's tree on the host: the layer loop may then draft each step on the strong drafter's
        device without asking, and leave the tree there (``LayerLoop.strong_tree``)."""
        return False

    def drafts_weak(self, num_layers: int) -> bool:
        """Whether a step may draft with the weak drafter (a skipped layer, a preview): only then does the method keep
        the n-gram scores' target log-probs up to date."""
        return True

    def check_pair(self, pair: str) -> None:
        """Raise a ConfigError if the policy was made for another DRAFTER:TARGET pair (a distilled scheduler)."""

    def decided_on(self) -> MeasuredValues | None:
        """What the policy measured of each step kind when it last decided a step's kind (``collect`` stores it with
        the step's rows); None for a policy that measures none."""
        return None

    def observe(self, tree: DraftTree, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """A verified step: ``accepted`` ``[a]`` root and accepted nodes, ``next_tokens`` ``[a]`` the target's token after each."""

    def time_by(self, clock: Callable[[], float]) -> None:
        """Measure step times with ``clock`` (seconds) instead of the wall clock; a policy that times nothing ignores it."""

    def trim(self, tree: DraftTree, costs: CostModel, budget: int, called: tuple[int, ...] | None = None) -> DraftTree:
        """The tree to verify, given the step's tree already cut to ``budget`` nodes: by default all of it. ``called``:
        the layers a forced build called at (None: the step the policy decided)."""
        return tree

    def decide(self, state: SchedulerState) -> bool:
        if len(state.called) >= self.call_budget or not state.window:
            return False
        return self.wants_call(state)

    def wants_layer(self, layer: int) -> bool | None:
        """``wants_call`` when it depends on the layer alone, else None. The layer loop then builds no state for the
        policy, and looks up the graft window only where it calls (``decide`` with the same budget and window)."""
        return None

    @abstractmethod
    def wants_call(self, state: SchedulerState) -> bool:
        """The policy's own preference, before the budget."""


class AllSmall(CallPolicy):
    name = "all-small"

    def wants_call(self, state: SchedulerState) -> bool:
        return False

    def wants_layer(self, layer: int) -> bool:
        return False


class AllMid(CallPolicy):
    name = "all-mid"

    def wants_call(self, state: SchedulerState) -> bool:
        return True

    def wants_layer(self, layer: int) -> bool:
        return True

    def planned_calls(self, num_layers: int) -> int:
        return min(num_layers, self.call_budget)

    def calls_first_layer(self, num_layers: int) -> bool:
        return self.call_budget >= 1

    def plans_whole_steps(self, num_layers: int) -> bool:
        return self.planned_calls(num_layers) == num_layers

    def drafts_weak(self, num_layers: int) -> bool:
        return self.planned_calls(num_layers) < num_layers  # the layers it calls whatever the tree holds


class FixedLayers(CallPolicy):
    name = "fixed"

    def __init__(self, call_budget: int, layers: tuple[int, ...]):
        super().__init__(call_budget)
        self.layers = frozenset(layers)

    def wants_call(self, state: SchedulerState) -> bool:
        return state.layer in self.layers

    def wants_layer(self, layer: int) -> bool:
        return layer in self.layers

    def planned_calls(self, num_layers: int) -> int:
        return leading_layers(self.layers, num_layers, self.call_budget)

    def calls_first_layer(self, num_layers: int) -> bool:
        return self.planned_calls(num_layers) >= 1

    def plans_whole_steps(self, num_layers: int) -> bool:
        return self.planned_calls(num_layers) == num_layers

    def drafts_weak(self, num_layers: int) -> bool:
        return self.planned_calls(num_layers) < num_layers  # the layers it calls whatever the tree holds


class CostAwareRule(CallPolicy):
    """Rule from measured costs: call iff calling yields more expected tokens per modelled millisecond.

    A node's *reach* is its calibrated acceptance probability (``AcceptanceCalibration``: the drafters'
    scores mapped to acceptance rates measured on the verified steps); a tree cut to N is worth
    E = 1 + Σ reach over its N best nodes.

    - Skip adds the weak drafter's chains, previewed before deciding: E_skip, at time T_skip.
    - Call grafts under the K positions a reselection picks; at position u, whose children already cover
      c(u) = min(1, Σ reach(child) / reach(u)) of the next token, the strong children capture a share h of
      the rest: one virtual child of reach reach(u)·h·(1 − c(u)). E_call, at time T_call.

    T = verify of the tree after the layer (``CostModel.verify_at``, the nodes it would hold) + calls ·
    strong_ms, one more call for T_call. Call iff E_call / T_call > E_skip / T_skip. A confident n-gram
    match keeps the strong drafter idle; a miss makes it cheap. (Looking further ahead adds
    nothing here: in this model each further call adds at most h times the previous call's gain for the
    same cost, so a call that does not pay alone does not pay as the first of several.)

    h is measured on the verified steps too (``observe``): it starts at ``hit_rate`` and follows an
    exponential moving average (``decay`` per observed node) of how often the target's next token at an
    accepted node with strong children is one of that node's children.
    """

    name = "cost-aware"
    uses_costs = True

    def __init__(self, call_budget: int, hit_rate: float, decay: float = 0.95):
        super().__init__(call_budget)
        self.hit_rate = hit_rate
        self.decay = decay
        self.calibration = AcceptanceCalibration()

    def previews(self, layer: int) -> bool:
        return True

    def observe(self, tree: DraftTree, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.calibration.observe(tree, next_tokens)
        children = tree.parents[None, :] == accepted[:, None]  # [a, num_nodes]
        strong = (children & (tree.origins == ORIGIN_MODEL)[None, :]).any(dim=1)
        hits = (children & (tree.tokens[None, :] == next_tokens[:, None])).any(dim=1)[strong]
        if hits.numel():
            keep = self.decay ** hits.numel()
            self.hit_rate = keep * self.hit_rate + (1 - keep) * float(hits.float().mean())

    def wants_call(self, state: SchedulerState) -> bool:
        costs = state.costs
        if costs.strong_ms <= 0:
            return True
        positions = state.reselection().cpu()
        skip, call = self.expected_tokens(state, positions)
        tree, calls = state.tree, len(state.called)
        added = int(torch.isfinite(state.weak.logp).sum()) if state.weak is not None else 0
        grafted = state.width * int(positions.numel())
        skip_ms = costs.verify_at(tree.size + added, state.budget) + calls * costs.strong_ms
        call_ms = costs.verify_at(tree.size + grafted, state.budget) + (calls + 1) * costs.strong_ms
        return call * skip_ms > skip * call_ms

    def expected_tokens(self, state: SchedulerState, positions: torch.Tensor) -> tuple[float, float]:
        """(E_skip, E_call): expected accepted tokens of the cut tree after a skip, and after a call that
        grafts under ``positions`` ([p] node indices, the reselection).

        On host lists (a layer's tree holds a few dozen nodes: tensor ops would cost more), rounded to float32 after
        every operation as float32 tensors round: one double operation on float32 values, rounded, is the float32
        operation's result."""
        tree = state.tree
        reach = self.calibration.reach_list(tree)  # float32 values
        (parents,) = host_columns(tree, "parents")
        covered = [0.0] * len(reach)  # the children's summed share of each node's reach, in node order
        for node in range(1, len(reach)):
            parent = parents[node]
            covered[parent] = float32(covered[parent] + float32(reach[node] / max(reach[parent], _TINY_REACH)))
        hit_rate = float32(self.hit_rate)
        # one virtual child per position: the share of its reach its children leave, times the hit rate
        virtual = [float32(float32(reach[u] * hit_rate) * float32(1.0 - min(covered[u], 1.0)))
                   for u in host_value(positions)]
        weak = state.weak.reach(reach, self.calibration.node_rate) if state.weak is not None else []
        return expected_accepted(reach[1:] + weak, state.budget), expected_accepted(reach[1:] + virtual, state.budget)


_TINY_REACH = float32(1e-12)  # a parent's reach is at least this when its children's shares are taken


def expected_accepted(reach: torch.Tensor | list[float], budget: int) -> float:  # reach: [n] non-root
    """Expected accepted length of a tree cut to its ``budget`` best nodes: 1 + their summed reach."""
    values = host_value(reach) if isinstance(reach, torch.Tensor) else reach
    return 1.0 + sum(sorted(values, reverse=True)[:budget])
