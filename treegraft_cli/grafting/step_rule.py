"""StepRule: TreeGraft's call rule that decides once per step, from measured gains and measured times.

A per-layer rule weighs one call against one skip, but a strong call pays off through the calls and
weak expansions after it (a strong child gives the n-gram index a fresh suffix, the next call reaches
one level deeper). ``StepRule`` therefore chooses between two whole steps at layer 1:

- a *weak step*: every layer skips (the n-gram chains alone);
- a *strong step*: the strong drafter is called at ``layers`` (default 1..D−1), the other layers skip.

Decoding maximises accepted tokens per second. With R the rate achieved so far, an action a of the
current step is worth τ_a − R·T_a (its tokens minus what its time would have earned at the running
rate; choosing the larger per step drives R to its best fixed point, as in Dinkelbach's method for
ratio objectives). So the step is strong iff

    τ_strong − τ_weak  >  R · (T_strong − T_weak)

- τ_weak: what this step's n-gram match is worth. The weak chains previewed at layer 1 give an
  estimate e = 1 + Σ calibrated reach of their best N tokens (``AcceptanceCalibration``). Chain
  scores are the target's log-probs where the n-gram matched, which misjudge copying (a summary
  repeats its article with a confidence the article's first reading never had) and chance repeats
  alike, so e is discounted by how such estimates fared on the last steps (``WeakOutcomes``). A
  strong step measures it too: its previewed chains are matched against the tokens it committed.
- τ_strong: an exponential moving average of the accepted length of the strong steps (``strong_decay``
  per strong step; the prior is 1 + |layers| · ``hit_rate``).
- T: each kind's measured wall time from decision to verified step, an exponential moving average
  (``rate_decay``); until measured, the cost model's (verification of the tree + the calls). A weak
  step's time follows its size: the measured mean, moved along the cost model's verification slope
  by the nodes the preview adds (a step with no match verifies little more than the root).
- R: accepted tokens over wall time of the recent steps, both exponentially weighted.

A strong step whose first call catches the drafter up on more than ``max_lag`` committed tokens (the
prompt, at a generation's first call) pays a one-off cost: its time is kept out of T and R, and its
excess over T_strong, per token caught up, is measured instead. The decision to pay it charges the
step ``lag · ms_per_token / catch_up_horizon``: the catch-up is worth it only if about
``catch_up_horizon`` strong steps will follow, so a long prompt the n-gram chains copy well keeps the
strong drafter idle.

Measuring on this device and this text adapts the rule to both: the strong drafter runs where it is
right for long stretches (code), the n-gram chains where the text copies its context (summaries,
long-context QA), and a long context that slows verification shows in T. So that τ_strong keeps
tracking the text, a strong step is forced after ``explore`` weak steps in a row (unless it would
catch up on the prompt). T is wall time, so two runs may decide differently; what they output does
not differ, every tree is verified. Tests pass a fake ``clock``.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..tree import ORIGIN_MODEL, DraftTree
from .calibration import AcceptanceCalibration
from .scheduler import CallPolicy, CostModel, SchedulerState, WeakPreview, expected_accepted


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


def chain_match(preview: WeakPreview, committed: torch.Tensor) -> int:
    """Accepted length the previewed root chains would have reached: 1 + their longest common prefix
    with ``committed`` ([τ] the tokens the step committed; a lower bound when a chain matches them all)."""
    if preview.tokens is None or preview.parents.numel() == 0:
        return 1
    chains = preview.tokens[preview.parents == 0].cpu()  # [c, width]
    logp = preview.logp[preview.parents.cpu() == 0]
    width = min(chains.shape[1], committed.numel())
    same = (chains[:, :width] == committed[None, :width].cpu()) & torch.isfinite(logp[:, :width])
    return 1 + int(same.int().cumprod(dim=1).sum(dim=1).max()) if chains.numel() else 1


class StepRule(CallPolicy):
    name = "step"
    uses_costs = True

    def __init__(
        self,
        call_budget: int,
        hit_rate: float,
        layers: tuple[int, ...] = (),  # a strong step's called layers; () = 1..D−1
        explore: int = 8,
        max_lag: int = 64,
        catch_up_horizon: float = 8.0,
        strong_decay: float = 0.8,
        rate_decay: float = 0.95,
        clock: Callable[[], float] = time.perf_counter,  # seconds
    ):
        super().__init__(call_budget)
        self.layers = layers
        self.hit_rate = hit_rate
        self.explore = explore
        self.max_lag = max_lag
        self.catch_up_horizon = catch_up_horizon
        self.catch_up_ms_per_token = 0.0  # measured on the catch-up steps
        self.strong_decay = strong_decay
        self.rate_decay = rate_decay
        self.clock = clock
        self.calibration = AcceptanceCalibration()
        self.weak_outcomes = WeakOutcomes()
        self.measured_tau: float | None = None  # τ_strong once a strong step was verified
        self.step_ms = {False: 0.0, True: 0.0}  # weak / strong: exponentially weighted wall ms per step
        self.step_weight = {False: 0.0, True: 0.0}
        self.weak_nodes = 0.0  # exponentially weighted tree size of the weak steps (weight: step_weight)
        self.tokens = 0.0  # exponentially weighted accepted length of the verified steps
        self.ms = 0.0  # and their wall time
        self.weak_run = 0  # weak steps in a row
        # this step's decision: the choice, its start, the preview and its estimate e, a catch-up
        self.strong_step = False
        self.catching_up = False
        self.lag = 0
        self.started = 0.0
        self.preview: WeakPreview | None = None
        self.estimate = 1.0

    def previews(self, layer: int) -> bool:
        return layer == 1

    def called_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.layers or tuple(range(1, num_layers))

    def wants_call(self, state: SchedulerState) -> bool:
        if state.layer == 1:
            self.strong_step = self.choose_strong(state)
            self.lag = state.strong_lag
            self.catching_up = self.strong_step and state.strong_lag > self.max_lag
            self.started = self.clock()
        return self.strong_step and state.layer in self.called_layers(state.num_layers)

    def choose_strong(self, state: SchedulerState) -> bool:
        self.preview = state.weak
        self.estimate, weak_nodes = self.weak_estimate(state)
        catch_up = state.strong_lag > self.max_lag
        if self.ms <= 0 or (self.weak_run >= self.explore and not catch_up):
            return True
        costs, calls = state.costs, len(self.called_layers(state.num_layers))
        strong_ms = self.measured_ms(True, costs.verify_at(state.budget, state.budget) + calls * costs.strong_ms)
        if catch_up:
            strong_ms += state.strong_lag * self.catch_up_ms_per_token / self.catch_up_horizon
        gain = self.strong_tau(state.num_layers) - self.weak_outcomes.expected(self.estimate)
        return gain > self.rate * (strong_ms - self.weak_ms(costs, weak_nodes, state.budget))

    def weak_ms(self, costs: CostModel, nodes: int, budget: int) -> float:
        """T_weak for a tree of ``nodes``: the measured mean moved along the modelled verification slope."""
        modelled = costs.verify_at(nodes, budget)
        weight = self.step_weight[False]
        if weight <= 0:
            return modelled
        mean_nodes = self.weak_nodes / weight
        return max(0.0, self.step_ms[False] / weight + modelled - costs.verify_at(round(mean_nodes), budget))

    def weak_estimate(self, state: SchedulerState) -> tuple[float, int]:
        """(e, nodes): the previewed chains' calibrated expected accepted length and the nodes they add."""
        if state.weak is None:
            return 1.0, 0
        reach = self.calibration.reach(state.tree)
        weak = state.weak.reach(reach, self.calibration.rate)
        return expected_accepted(torch.cat([reach[1:], weak]), state.budget), min(weak.numel(), state.budget)

    def strong_tau(self, num_layers: int) -> float:
        """τ_strong: measured, or the prior before the first strong step."""
        if self.measured_tau is not None:
            return self.measured_tau
        return 1.0 + len(self.called_layers(num_layers)) * self.hit_rate

    def measured_ms(self, strong: bool, modelled: float) -> float:
        """T of a weak or strong step: measured, else ``modelled``."""
        weight = self.step_weight[strong]
        return self.step_ms[strong] / weight if weight > 0 else modelled

    @property
    def rate(self) -> float:
        """R: accepted tokens per wall ms over the recent verified steps."""
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def observe(self, tree: DraftTree, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.calibration.observe(tree, accepted)
        ms = (self.clock() - self.started) * 1000.0
        tau = float(accepted.numel())  # the root stands for the bonus token
        strong = bool((tree.origins == ORIGIN_MODEL).any())
        if strong and self.catching_up:
            excess = ms - self.measured_ms(True, ms)
            self.catch_up_ms_per_token = max(0.0, excess) / max(1, self.lag)
        else:
            self.tokens = self.rate_decay * self.tokens + tau
            self.ms = self.rate_decay * self.ms + ms
            self.step_ms[strong] = self.rate_decay * self.step_ms[strong] + ms
            self.step_weight[strong] = self.rate_decay * self.step_weight[strong] + 1.0
            if not strong:
                self.weak_nodes = self.rate_decay * self.weak_nodes + tree.size
        if strong:
            last = self.measured_tau
            self.measured_tau = tau if last is None else self.strong_decay * last + (1 - self.strong_decay) * tau
            self.weak_run = 0
            if self.preview is not None:
                self.weak_outcomes.observe(self.estimate, chain_match(self.preview, next_tokens))
        else:
            self.weak_run += 1
            self.weak_outcomes.observe(self.estimate, tau)
