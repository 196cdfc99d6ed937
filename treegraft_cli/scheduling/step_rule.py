"""StepRule: TreeGraft's call rule that decides once per step, from measured gains and measured times.

A per-layer rule weighs one call against one skip, but a strong call pays off through the calls and
weak expansions after it (a strong child gives the n-gram index a fresh suffix, the next call reaches
one level deeper). ``StepRule`` therefore chooses a whole step at layer 1, one of these kinds:

- *weak*: every layer skips (the n-gram chains alone);
- *short*: the strong drafter is called at ``short_layers`` (default 1: its top-K children of the
  root, for the n-gram layers after it to extend), the other layers skip;
- *full*: the strong drafter is called at ``layers`` (default 1..D−1), the other layers skip.

Decoding maximises accepted tokens per second. With R the rate achieved so far, an action a of the
current step is worth τ_a − R·T_a (its tokens minus what its time would have earned at the running
rate; choosing the largest per step drives R to its best fixed point, as in Dinkelbach's method for
ratio objectives). So the step takes the kind with the largest

    τ_kind − R · T_kind

- τ_weak: what this step's n-gram match is worth. The weak chains previewed at layer 1 give an
  estimate e = 1 + Σ calibrated reach of their best N tokens (``AcceptanceCalibration``). Chain
  scores are the target's log-probs where the n-gram matched, which misjudge copying (a summary
  repeats its article with a confidence the article's first reading never had) and chance repeats
  alike, so e is discounted by how such estimates fared on the last steps (``WeakOutcomes``). A
  strong step measures it too: its previewed chains are matched against the tokens it committed.
- τ_short, τ_full: exponential moving averages of the accepted length of the steps of that kind
  (``strong_decay`` per step; the prior is 1 + |called layers| · ``hit_rate``).
- T: each kind's measured wall time from decision to verified step, an exponential moving average
  (``rate_decay``); until measured, the cost model's (verification of the tree + the calls). A weak
  step's time follows its size: the modelled verification of the tree it would verify, plus the mean of
  what weak steps took beyond their modelled verification (a step with no match verifies the root alone).
- R: accepted tokens over wall time of the recent steps, both exponentially weighted. Before the first
  verified step (a new request when the bench resets state per question) R is the best modelled rate
  τ_kind / T_kind, so the first step takes the kind that promises the most tokens per ms.

The same value decides which nodes a step verifies. On a CPU the verification grows with the tree
(``CostModel.verify_at``: the measured curve of tree size against time), so a step verifies the m nodes of
highest calibrated reach (their expected accepted tokens) for the m with the largest Σ reach − R·T_verify(m)
(``CostModel.verified_count``): nodes whose tokens are worth less than the time their verification would
have earned at rate R are dropped. Every m is weighed, not only the next node against the curve's slope: on
a CPU the first node after the root costs far more than the ones after it. A weak step weighs each node at
ρ times its reach (capped at 1), the discount τ_weak applies: chains that have been copying keep more of their
nodes, chance repeats fewer. Reach never grows down a path, so the kept nodes are prefix-closed, and τ_weak and
T_weak count only the previewed tokens that would be kept. ρ keeps learning while the trim cuts: a weak step is
judged on its verified nodes and on the nodes the trim dropped under accepted verified parents, whose fate the
committed tokens tell (``verified_outcome``), so a trim down to the root still measures whether the chains'
first tokens were right. The calibration learns from the tree before the trim (a dropped node is judged
against the tokens the step committed), so the rates of the bins the trim drops stay measured instead of
keeping their prior. On a GPU, where a tree costs about what the root alone costs, nothing is dropped. Before
R is measured, the modelled rate of verifying the root alone (plain decoding's) stands for it.

A strong step whose first call catches the drafter up on more than ``max_lag`` committed tokens (the
prompt, at a generation's first call) pays a one-off cost: its time is kept out of T and R, and its
excess over its kind's T, per token caught up, is measured instead. The decision to pay it charges the
step ``lag · ms_per_token / catch_up_horizon`` (until measured, ms_per_token is a strong call's ms times the share of a
one-token forward that one more token adds, from the target's verify curve): the catch-up is worth it only if about
``catch_up_horizon`` strong steps will follow, so a long prompt the n-gram chains copy well keeps the
strong drafter idle.

Measuring on this device and this text adapts the rule to both: the strong drafter runs where it is
right for long stretches (code), the n-gram chains where the text copies its context (summaries,
long-context QA), and a long context that slows verification shows in T. So that each τ keeps
tracking the text, a strong kind not chosen for ``explore`` steps is chosen next, unless it would
catch up on the prompt or could not win even at ``explore_upside`` times its τ (a weak step that
copies whole chains is not interrupted to re-measure strong steps that cannot beat it). An exploration
that did not make its kind the best choice at the next decision doubles that kind's wait, up to
``explore_limit`` steps; one that did resets it to ``explore``. Where strong steps keep losing (a
drafter that costs much of a target forward, text the n-gram chains copy) the rule then spends
ever fewer steps re-measuring them; where they win, it measures them as often as before. T is wall
time, so two runs may decide differently; what they output does not differ, every tree is verified.
Tests pass a fake ``clock``.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..syncs import host_value
from ..tree import DraftTree
from .calibration import AcceptanceCalibration, committed_path, host_columns
from .policies import (
    STEP_KIND_NAMES,
    CallPolicy,
    CostModel,
    MeasuredValues,
    SchedulerState,
    WeakPreview,
    check_distilled_pair,
    feature_vector,
    kind_one_hot,
    leading_layers,
)
from .values import CATCH_UP_HORIZON, MAX_LAG


class WeakOutcomes:
    """τ_weak = 1 + ρ·(e − 1): the previewed estimate's gain, discounted by how it has been doing lately.

    ρ is the ratio of measured gains (accepted length − 1) to estimated gains (e − 1) over the recent
    observations, both exponentially weighted (``decay`` per observation) from a prior of ρ = 1 worth
    ``prior_gain`` estimated tokens. One number adapts within a few steps to the text at hand: above 1
    where it copies its context, well below 1 where the matches are chance repeats.
    """

    def __init__(self, decay: float = 0.8, prior_gain: float = 2.0):
        self.decay = decay
        self.measured = prior_gain
        self.estimated = prior_gain

    @property
    def ratio(self) -> float:
        return self.measured / self.estimated

    def observe(self, estimate: float, accepted: float) -> None:
        if estimate <= 1.0:  # nothing was previewed: nothing to learn about the estimates
            return
        self.measured = self.decay * self.measured + (accepted - 1.0)
        self.estimated = self.decay * self.estimated + (estimate - 1.0)

    def expected(self, estimate: float) -> float:
        return 1.0 + self.ratio * (estimate - 1.0)


def verified_outcome(
    parents: list[int],  # [num_nodes] the step's tree before the trim
    tokens: list[int],  # [num_nodes]
    depths: list[int],  # [num_nodes]
    reach: list[float],  # [num_nodes] calibrated reach when the trim decided, 1 at the root
    kept: set[int],  # the non-root nodes the trim kept (verified)
    committed: list[int],  # [τ] the tokens the step committed
) -> tuple[float, float]:
    """(estimated, measured) gain of a weak step's tree, in accepted tokens beyond the root, over the nodes whose
    fate the step shows: every verified node (estimated at its reach) and every node the trim dropped under a
    verified parent that was accepted (estimated at its rate given the parent, ``reach / reach[parent]``). Such a
    node would have been accepted iff it holds the committed token at its depth, as a verified node is. Without
    the dropped nodes, a step trimmed to its root would show nothing, and a ρ below 1 that trims every tree to its
    root would never rise again."""
    on_path = committed_path(parents, tokens, depths, committed)
    estimated = measured = 0.0
    # a dropped node judged here hangs under a verified node: the path's only dropped node is the bonus's, at depth τ
    for node in range(1, len(parents)):
        parent = parents[node]
        if node in kept:
            estimated += reach[node]
        elif on_path[parent] and depths[node] <= len(committed) and reach[parent] > 0:
            estimated += reach[node] / reach[parent]
        else:
            continue
        measured += on_path[node]
    return estimated, measured


def chain_match(preview: WeakPreview, committed: torch.Tensor) -> int:
    """Accepted length the previewed root chains would have reached: 1 + their longest common prefix
    with ``committed`` ([τ] the tokens the step committed; a lower bound when a chain matches them all).
    The preview and ``committed`` are on the host."""
    if preview.tokens is None:
        return 1
    committed = host_value(committed)
    longest = 0
    chains = zip(*(host_value(t) for t in (preview.parents, preview.tokens, preview.logp)), strict=True)
    for parent, tokens, logps in chains:
        if parent == 0:
            pairs = zip(tokens, committed, logps, strict=False)  # a chain may run past the committed tokens
            matched = itertools.takewhile(lambda t: t[0] == t[1] and math.isfinite(t[2]), pairs)
            longest = max(longest, sum(1 for _ in matched))
    return 1 + longest


@dataclass
class StepKind:
    """One kind of step the rule can choose: the layers it calls at (none: weak) and what it measured."""

    name: str
    layers: tuple[int, ...]
    tau: float | None = None  # exponentially weighted accepted length (strong kinds); None: not yet measured
    ms: float = 0.0  # exponentially weighted wall ms (divide by ``weight``)
    modelled: float = 0.0  # exponentially weighted modelled verification ms of its trees (divide by ``weight``)
    weight: float = 0.0
    idle: int = 0  # steps since this kind was last chosen
    backoff: int = 1  # its explorations wait ``explore`` times this many steps (doubled by each one that lost)

    def mean_ms(self, otherwise: float) -> float:
        return self.ms / self.weight if self.weight > 0 else otherwise

    def record_time(self, ms: float, modelled: float, decay: float) -> None:
        self.ms = decay * self.ms + ms
        self.modelled = decay * self.modelled + modelled
        self.weight = decay * self.weight + 1.0

    def record_tau(self, tau: float, decay: float) -> None:
        self.tau = tau if self.tau is None else decay * self.tau + (1 - decay) * tau


def kind_layers(layers: tuple[int, ...], short_layers: tuple[int, ...], num_layers: int) -> dict[str, tuple[int, ...]]:
    """The step kinds and the layers each calls at: weak (none), short (``short_layers``, unless empty or the same
    as full) and full (``layers``, default 1..D−1)."""
    full = layers or tuple(range(1, num_layers))
    kinds = {"weak": (), "full": full}
    if short_layers and short_layers != full:
        kinds["short"] = short_layers
    return kinds


class StepRule(CallPolicy):
    name = "step"
    uses_costs = True
    # the rule measures what a weak step is worth at every step (its preview, ``WeakOutcomes``), taken or not
    explores_weak = False

    def __init__(
        self,
        call_budget: int,
        hit_rate: float,
        layers: tuple[int, ...] = (),  # a full strong step's called layers; () = 1..D−1
        short_layers: tuple[int, ...] = (1,),  # a short strong step's; () = no short steps
        explore: int = 8,
        explore_upside: float = 2.0,
        explore_limit: int = 64,
        max_lag: int = MAX_LAG,
        catch_up_horizon: float = CATCH_UP_HORIZON,
        strong_decay: float = 0.8,
        rate_decay: float = 0.95,
        clock: Callable[[], float] = time.perf_counter,  # seconds
        trim: bool = True,
    ):
        super().__init__(call_budget)
        self.trimming = trim
        self.layers = layers
        self.short_layers = short_layers
        self.hit_rate = hit_rate
        self.explore = explore
        self.explore_upside = explore_upside
        self.explore_limit = explore_limit
        self.exploring: StepKind | None = None  # the kind this step explores, if it does
        self.explored: StepKind | None = None  # the kind the last verified step explored, until the next decision
        self.max_lag = max_lag
        self.catch_up_horizon = catch_up_horizon
        self.catch_up_ms_per_token = 0.0  # measured on the catch-up steps
        self.strong_decay = strong_decay
        self.rate_decay = rate_decay
        self.clock = clock
        self.calibration = AcceptanceCalibration()
        self.weak_outcomes = WeakOutcomes()
        self.kinds: dict[str, StepKind] = {}  # weak, short, full: built once D is known
        self.tokens = 0.0  # exponentially weighted accepted length of the verified steps
        self.ms = 0.0  # and their wall time
        # this step's decision: the kind, its start, the preview and its estimate e, a catch-up
        self.choice: StepKind | None = None
        self.costs: CostModel | None = None  # the cost model and budget this step was decided under
        self.budget = 0
        self.catching_up = False
        self.lag = 0
        self.started = 0.0
        self.preview: WeakPreview | None = None
        self.estimate = 1.0
        self.measured: MeasuredValues | None = None  # what this step's decision weighed
        self.untrimmed: DraftTree | None = None  # this step's tree before the trim, when one was cut
        self.weak_judged: tuple[list[float], set[int]] | None = None  # a weak step's reach and kept nodes at its trim

    def previews(self, layer: int) -> bool:
        return layer == 1

    def decided_on(self) -> MeasuredValues | None:
        return self.measured

    def time_by(self, clock: Callable[[], float]) -> None:
        self.clock = clock

    def step_kinds(self, num_layers: int) -> dict[str, StepKind]:
        if not self.kinds:
            layers = kind_layers(self.layers, self.short_layers, num_layers)
            self.kinds = {name: StepKind(name, called) for name, called in layers.items()}
        return self.kinds

    def wants_call(self, state: SchedulerState) -> bool:
        if state.layer == 1:
            self.costs, self.budget = state.costs, state.budget
            self.choice = self.choose(state)
            self.lag = state.strong_lag
            self.catching_up = bool(self.choice.layers) and state.strong_lag > self.max_lag
            self.started = self.clock()
        return self.choice is not None and state.layer in self.choice.layers

    def planned_calls(self, num_layers: int) -> int:
        layers = self.choice.layers if self.choice is not None else ()
        return leading_layers(layers, num_layers, self.call_budget)

    def choose(self, state: SchedulerState) -> StepKind:
        kinds = self.step_kinds(state.num_layers)
        self.exploring = None
        self.preview = state.weak
        self.estimate, weak_nodes = self.weak_estimate(state)
        measured = self.measured = self.measured_values(state, weak_nodes)
        if measured is None:
            return kinds["full"]
        values = measured.values
        best = max(values, key=values.get)
        return self.explore_or(best, measured, state)

    def measured_values(self, state: SchedulerState, weak_nodes: int) -> MeasuredValues | None:
        """Each kind's τ − R·T from what this request measured (priors and the cost model where it has not yet);
        None before any rate, measured or modelled, exists."""
        kinds = self.step_kinds(state.num_layers)
        catch_up = state.strong_lag > self.max_lag
        costs = state.costs
        extra = state.strong_lag * self.catch_up_cost(state) / self.catch_up_horizon if catch_up else 0.0
        taus = {"weak": self.weak_outcomes.expected(self.estimate)}
        times = {"weak": self.weak_ms(costs, weak_nodes, state.budget)}
        for kind in kinds.values():
            if kind.layers:
                modelled = costs.verify_at(state.budget, state.budget) + len(kind.layers) * costs.strong_ms
                times[kind.name] = kind.mean_ms(modelled) + extra
                taus[kind.name] = self.strong_tau(kind)
        # R before any step is measured: the best modelled rate, so the first step takes the kind that
        # promises the most tokens per ms (a catch-up on the prompt priced in) instead of always a full one
        rate = self.rate if self.ms > 0 else max((taus[k] / times[k] for k in taus if times[k] > 0), default=0.0)
        if rate <= 0:
            return None
        return MeasuredValues(taus, times, rate)

    def explore_or(self, best: str, measured: MeasuredValues, state: SchedulerState) -> StepKind:
        """The kind to take: the stalest explorable kind whose wait is over (``explorable``), if even
        ``explore_upside`` times its τ could beat ``best``'s measured value; else ``best``."""
        kinds = self.step_kinds(state.num_layers)
        self.judge_exploration(best)
        due = [kind for kind in kinds.values() if self.explorable(kind, state)]
        if due:
            stale = max(due, key=lambda kind: kind.idle)
            upside = self.explore_upside * measured.taus[stale.name] - measured.rate * measured.times[stale.name]
            if upside > measured.values[best]:
                self.exploring = stale
                return stale
        return kinds[best]

    def explorable(self, kind: StepKind, state: SchedulerState) -> bool:
        """Whether ``kind``'s wait is over and it may be explored: a strong kind unless its call would catch up on
        the prompt; the weak kind only where ``explores_weak``."""
        if kind.idle < self.explore_interval(kind):
            return False
        return state.strong_lag <= self.max_lag if kind.layers else self.explores_weak

    def explore_interval(self, kind: StepKind) -> int:
        """Steps ``kind`` waits unchosen before it is explored: ``explore`` times its backoff, at most
        ``explore_limit`` (never below ``explore``)."""
        return max(self.explore, min(self.explore * kind.backoff, self.explore_limit))

    def judge_exploration(self, best: str) -> None:
        """After an exploration was verified and measured: its kind waits twice as long before the next one unless
        the measurement made it the best choice now (``best``, by value), which resets its wait. Judged once: a
        decision taken again for the same step (``collect`` rebuilds the real tree) finds nothing to judge."""
        kind, self.explored = self.explored, None
        if kind is None:
            return
        if kind.name == best:
            kind.backoff = 1
        elif self.explore * kind.backoff < self.explore_limit:
            kind.backoff *= 2

    def catch_up_cost(self, state: SchedulerState) -> float:
        """Ms per committed token a catch-up call costs: measured on this request's catch-up; else the drafter's own
        measured ms per token of a wide forward (``CostModel.strong_token_ms``); else a strong call's ms times what
        one more token adds to a forward, read off the target's verify curve (``CostModel.token_share``); on a flat
        cost model one strong call's ms per token it forwards. One call's ms spread over its few tokens prices a long
        catch-up several times over on a CPU (a forward of dozens of tokens is not dozens of small ones), and an
        overpriced catch-up keeps the strong drafter from ever being tried on a prompt just past ``max_lag``; the
        target's curve scaled to the drafter underprices it where the drafter's forward grows faster than the
        target's (a 0.5B drafter of a 1.5B target on one CPU core: 4.8 ms a token measured, 3.0-3.5 from the scaled
        curve, 4.2 in a 711-token catch-up)."""
        costs = state.costs
        if self.catch_up_ms_per_token > 0 or costs.strong_ms <= 0:
            return self.catch_up_ms_per_token
        if costs.strong_token_ms > 0:
            return costs.strong_token_ms
        share = costs.token_share(state.budget)
        return costs.strong_ms * share if share > 0 else costs.strong_ms / (2 * state.width)

    def weak_ms(self, costs: CostModel, nodes: int, budget: int) -> float:
        """T_weak for a tree of ``nodes``: its modelled verification plus what weak steps took beyond theirs (the
        mean of measured − modelled). Not the measured mean moved to ``nodes`` along the curve: on a CPU the curve
        bends (the first node after the root costs most), so the curve at the trees' mean size is not their mean
        modelled time, and root-only steps among a few large trees would be priced below what they take."""
        modelled = costs.verify_at(nodes, budget)
        weak = self.kinds.get("weak")
        if weak is None or weak.weight <= 0:
            return modelled
        return max(0.0, modelled + (weak.ms - weak.modelled) / weak.weight)

    def weak_estimate(self, state: SchedulerState) -> tuple[float, int]:
        """(e, nodes): the calibrated expected accepted length of the tree a weak step would verify (the previewed
        chains and what the tree holds, as ``trim`` would cut them) and its size."""
        if state.weak is None:
            return 1.0, 0
        reach = self.calibration.reach_list(state.tree)
        weak = state.weak.reach(reach, self.calibration.node_rate)
        best = sorted(reach[1:] + list(weak), reverse=True)[: state.budget]
        kept = self.verified(best, state.costs, state.budget, self.weak_outcomes.ratio)
        return 1.0 + sum(best[:kept]), kept

    def verified(self, reach: list[float], costs: CostModel, budget: int, ratio: float = 1.0) -> int:
        """How many of the nodes (reach best first) a step verifies: ``CostModel.verified_count`` at rate R, all
        when trimming is off or the cost model is flat. Before R is measured, the rate of verifying the root alone
        (plain decoding's, modelled) stands for it: a tree must at least beat decoding without one. A weak step
        weighs each node at ``ratio`` (ρ) times its reach, capped at 1 (a cap keeps the order: any prefix of the
        nodes stays prefix-closed)."""
        if not self.trimming or not costs.grows:
            return min(len(reach), budget)
        rate = self.rate if self.ms > 0 else 1.0 / max(costs.verify_at(0, budget), 1e-6)
        worth = reach if ratio == 1.0 else [min(1.0, ratio * value) for value in reach]
        return costs.verified_count(worth, rate, budget)

    @property
    def weak_step(self) -> bool:
        """This step calls nowhere: its tree is the n-gram chains', judged at ρ."""
        return self.choice is not None and not self.choice.layers

    def trim(self, tree: DraftTree, costs: CostModel, budget: int, called: tuple[int, ...] | None = None) -> DraftTree:
        """The tree cut to the nodes worth verifying at R; a weak step's (this step's choice, or a forced build's that
        called nowhere) weighed at ρ. A forced build (``collect``'s probe of a kind the rule did not choose) is trimmed
        as a step of that kind would be, else a probe of a strong kind on a weak step would be cut at ρ."""
        self.untrimmed, self.weak_judged = None, None
        if tree.size == 0:
            return tree
        weak = self.weak_step if called is None else not called
        reach = self.calibration.reach_list(tree)
        # best first, ties to the lower index: reach never grows down a path (every rate is at most 1), so any
        # prefix of this order is prefix-closed
        order = sorted(range(1, len(reach)), key=lambda node: (-reach[node], node))
        ratio = self.weak_outcomes.ratio if weak else 1.0
        kept = self.verified([reach[node] for node in order], costs, budget, ratio)
        if weak:
            self.weak_judged = (reach, set(order[:kept]))
        if kept >= len(order):
            return tree
        self.untrimmed = tree  # what ``observe`` calibrates on: the nodes trimmed away count too
        return tree.select_nodes([0, *sorted(order[:kept])])

    def strong_tau(self, kind: StepKind) -> float:
        """τ of a strong kind: measured, or the prior before its first step."""
        return kind.tau if kind.tau is not None else 1.0 + len(kind.layers) * self.hit_rate

    @property
    def rate(self) -> float:
        """R: accepted tokens per wall ms over the recent verified steps."""
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def observe(self, tree: DraftTree, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        untrimmed, self.untrimmed = self.untrimmed, None
        self.calibration.observe(untrimmed if untrimmed is not None else tree, next_tokens)
        kind = self.choice
        if kind is None:
            return
        ms = (self.clock() - self.started) * 1000.0
        tau = float(accepted.numel())  # the root stands for the bonus token
        if self.catching_up:
            excess = ms - kind.mean_ms(ms)
            self.catch_up_ms_per_token = max(0.0, excess) / max(1, self.lag)
        else:
            self.tokens = self.rate_decay * self.tokens + tau
            self.ms = self.rate_decay * self.ms + ms
            modelled = self.costs.verify_at(tree.size, self.budget) if self.costs is not None else ms
            kind.record_time(ms, modelled, self.rate_decay)
        for other in self.kinds.values():
            other.idle = 0 if other is kind else other.idle + 1
        self.explored, self.exploring = self.exploring, None
        if kind.layers:
            kind.record_tau(tau, self.strong_decay)
            if self.preview is not None:
                self.weak_outcomes.observe(self.estimate, chain_match(self.preview, next_tokens))
        elif self.weak_judged is not None:
            estimated, measured = self.judge_weak(untrimmed if untrimmed is not None else tree, next_tokens)
            self.weak_outcomes.observe(1.0 + estimated, 1.0 + measured)
        else:  # a tree this rule did not trim: judged on the preview's estimate
            self.weak_outcomes.observe(self.estimate, tau)

    def judge_weak(self, tree: DraftTree, committed: torch.Tensor) -> tuple[float, float]:  # tree: before the trim
        """``verified_outcome`` of this weak step (host lists of a host tree; one read for a device tree)."""
        reach, kept = self.weak_judged
        parents, tokens, depths = host_columns(tree, "parents", "tokens", "depths")
        return verified_outcome(parents, tokens, depths, reach, kept, host_value(committed))


class DistilledRule(StepRule):
    """The step rule with a distilled scheduler deciding where the strong drafter is called; measuring (R, each
    kind's τ and time, ρ), trimming and the catch-up accounting stay the rule's, so a learned scheduler verifies the
    trees the rule would. ``margin_fn`` maps the scheduler's inputs to its predicted margin in tokens; it calls only
    where that exceeds ``min_margin``."""

    def __init__(self, call_budget: int, hit_rate: float, margin_fn: Callable[[torch.Tensor], float],
                 feature_set: str = "paper", layers: tuple[int, ...] = (), trim: bool = True,
                 distilled_for: Mapping[str, Any] | None = None, source: str = "the scheduler",
                 min_margin: float = 0.0, residual: bool = False):
        super().__init__(call_budget, hit_rate, layers, trim=trim)
        self.min_margin = min_margin
        self.residual = residual  # the scheduler corrects the rule's margin: its last input (per-step schedulers)
        self.margin_fn = margin_fn
        self.feature_set = feature_set
        self.distilled_for = dict(distilled_for or {})  # the artifact's cost profile: identity, device, dtype, pair
        self.source = source

    def check_pair(self, pair: str) -> None:
        check_distilled_pair(self.distilled_for, self.source, pair)


class LearnedStepRule(DistilledRule):
    """A per-step scheduler (``treegraft distill`` of per-step rollouts, ``collect --decide step``) chooses each
    step's kind: the one whose predicted margin over a weak step is largest, a weak step when no margin exceeds
    ``min_margin`` tokens. Like the rule, it explores a strong kind it has not taken for a while
    (``StepRule.explore_or``, judged against its own choice): its history features and the rule's measurements
    only learn what strong steps are worth on this text from the strong steps it takes.

    It explores the weak kind too: its history features (``recent_tau_no_call``) keep what the last weak step
    measured, or the prior of 1 token before any, so a scheduler that took strong steps from a request's start
    would otherwise never learn that weak steps copy whole chains there.

    ``margin_fn`` maps ``[features, kind one-hot]`` (``STEP_KIND_NAMES`` order) to V_kind − V_weak. A residual
    scheduler (``residual``) reads the rule's own margin of the kind after those (``MeasuredValues.margins``) and
    predicts the margin as that plus its correction: where the rollouts taught it nothing, it decides as the rule.
    """

    name = "learned-step"
    explores_weak = True

    def choose(self, state: SchedulerState) -> StepKind:
        kinds = self.step_kinds(state.num_layers)
        self.exploring = None
        self.preview = state.weak  # the weak estimate and its outcomes stay measured, as the trim reads them
        self.estimate, weak_nodes = self.weak_estimate(state)
        measured = self.measured = self.measured_values(state, weak_nodes)
        if measured is None and self.residual:  # no rate yet, so no margin of the rule's to correct
            return kinds["full"]
        inputs = feature_vector(state, self.feature_set)
        rule = measured.margins() if self.residual else {}
        best, best_margin = kinds["weak"], self.min_margin
        for name in STEP_KIND_NAMES:
            if name in kinds:
                base = torch.tensor([rule[name]] if self.residual else [])
                margin = float(self.margin_fn(torch.cat([inputs, kind_one_hot(name), base])))
                if margin > best_margin:
                    best, best_margin = kinds[name], margin
        return best if measured is None else self.explore_or(best.name, measured, state)


class LearnedLayerRule(DistilledRule):
    """A per-layer scheduler (``collect --decide layer``, the paper's granularity) decides at every layer: call iff
    the predicted margin of calling over skipping (``margin_fn`` of the layer's features) exceeds ``min_margin``.

    The step's kind is the set of layers it called (a weak one when none), measured like the rule's kinds: its time
    feeds R, and whether it called decides if the trim weighs the tree at ρ. A step's first call catches up on
    what the strong drafter lags, as in the rule.
    """

    name = "learned-layer"

    def wants_call(self, state: SchedulerState) -> bool:
        if state.layer == 1:
            self.costs, self.budget = state.costs, state.budget
            self.preview = state.weak
            self.estimate, _ = self.weak_estimate(state)
            self.choice, self.catching_up, self.lag = self.kind(()), False, state.strong_lag
            self.started = self.clock()
        if float(self.margin_fn(feature_vector(state, self.feature_set))) <= self.min_margin:
            return False
        if not state.called:  # the step's first call: it catches the strong drafter up
            self.lag = state.strong_lag
            self.catching_up = state.strong_lag > self.max_lag
        self.choice = self.kind((*state.called, state.layer))
        return True

    def planned_calls(self, num_layers: int) -> int:
        return 0  # every layer reads the state

    def kind(self, layers: tuple[int, ...]) -> StepKind:
        """The step kind that calls at ``layers``, measured from its first step."""
        name = ",".join(str(layer) for layer in layers) or "weak"
        return self.kinds.setdefault(name, StepKind(name, layers))
