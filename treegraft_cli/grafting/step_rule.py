"""StepRule: TreeGraft's call rule that decides once per step, from measured costs and measured gains.

A per-layer rule weighs one call against one skip, but a strong call pays off through the calls and
weak expansions after it (a strong child gives the n-gram index a fresh suffix, the next call reaches
one level deeper). ``StepRule`` therefore chooses between two whole steps at layer 1:

- a *weak step*: every layer skips (the n-gram chains alone);
- a *strong step*: the strong drafter is called at ``layers`` (default 1..D−1), the other layers skip.

Decoding maximises accepted tokens per millisecond. With R the rate achieved so far, an action a of
the current step is worth τ_a − R·T_a (its tokens minus what its time would have earned at the
running rate; maximising this per step drives R to its best fixed point, as in Dinkelbach's method
for ratio objectives). So the step is strong iff

    τ_strong − τ_weak  >  R · (T_strong − T_weak)

- τ_weak: 1 + Σ calibrated reach (``AcceptanceCalibration``) of the weak chains previewed at layer 1,
  the best N of them: what this step's n-gram match is worth.
- τ_strong: an exponential moving average of the accepted length of the strong steps verified so far
  (``strong_decay`` per strong step; the prior is 1 + |layers| · ``hit_rate``).
- T: modelled verification of the tree (``CostModel.verify_at``) plus |layers| strong calls for a
  strong step.
- R: tokens over modelled ms of the verified steps, both exponentially weighted (``rate_decay``).

All of it is measured on this device and this generation: a code prompt where the strong drafter is
right for long stretches gets strong steps, a summary that copies its article gets weak ones. So that
τ_strong keeps tracking the text, a strong step is forced after ``explore`` weak steps in a row.
"""

from __future__ import annotations

import torch

from ..tree import ORIGIN_MODEL, DraftTree
from .calibration import AcceptanceCalibration
from .scheduler import CallPolicy, CostModel, SchedulerState, expected_accepted


class StepRule(CallPolicy):
    name = "step"
    uses_costs = True

    def __init__(
        self,
        call_budget: int,
        hit_rate: float,
        layers: tuple[int, ...] = (),  # strong step's called layers; () = 1..D−1
        explore: int = 8,
        strong_decay: float = 0.8,
        rate_decay: float = 0.95,
    ):
        super().__init__(call_budget)
        self.layers = layers
        self.explore = explore
        self.strong_decay = strong_decay
        self.rate_decay = rate_decay
        self.hit_rate = hit_rate
        self.calibration = AcceptanceCalibration()
        self.measured_tau: float | None = None  # τ_strong once a strong step was verified
        self.tokens = 0.0  # exponentially weighted accepted length of verified steps
        self.ms = 0.0  # and their modelled time
        self.weak_run = 0  # weak steps in a row
        self.strong_step = False  # this step's choice, made at layer 1
        self.costs, self.budget, self.num_layers = CostModel(0.0, 0.0), 0, 0  # the last decision's

    def previews(self, layer: int) -> bool:
        return layer == 1

    def called_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.layers or tuple(range(1, num_layers))

    def wants_call(self, state: SchedulerState) -> bool:
        if state.layer == 1:
            self.strong_step = self.choose_strong(state)
        return self.strong_step and state.layer in self.called_layers(state.num_layers)

    def strong_tau(self, num_layers: int) -> float:
        """τ_strong: measured, or the prior before the first strong step."""
        if self.measured_tau is not None:
            return self.measured_tau
        return 1.0 + len(self.called_layers(num_layers)) * self.hit_rate

    def choose_strong(self, state: SchedulerState) -> bool:
        costs, layers = state.costs, self.called_layers(state.num_layers)
        self.costs, self.budget, self.num_layers = costs, state.budget, state.num_layers
        if self.weak_run >= self.explore or self.ms <= 0 or costs.strong_ms <= 0:
            return True
        weak_tau, weak_nodes = self.weak_value(state)
        weak_ms = costs.verify_at(weak_nodes, state.budget)
        strong_ms = costs.verify_at(state.budget, state.budget) + len(layers) * costs.strong_ms
        return self.strong_tau(state.num_layers) - weak_tau > self.rate * (strong_ms - weak_ms)

    def weak_value(self, state: SchedulerState) -> tuple[float, int]:
        """(τ_weak, nodes): the previewed chains' expected accepted length and how many nodes they add."""
        if state.weak is None:
            return 1.0, 0
        reach = self.calibration.reach(state.tree)
        weak = state.weak.reach(reach, self.calibration.rate)
        return expected_accepted(torch.cat([reach[1:], weak]), state.budget), min(weak.numel(), state.budget)

    @property
    def rate(self) -> float:
        """R: accepted tokens per modelled ms over the recent verified steps."""
        return self.tokens / self.ms if self.ms > 0 else 0.0

    def observe(self, tree: DraftTree, accepted: torch.Tensor, next_tokens: torch.Tensor) -> None:
        self.calibration.observe(tree, accepted)
        tau = float(accepted.numel())  # the root stands for the bonus token
        strong = bool((tree.origins == ORIGIN_MODEL).any())
        calls = len(self.called_layers(self.num_layers)) if strong else 0
        ms = self.costs.verify_at(tree.size, self.budget) + calls * self.costs.strong_ms
        self.tokens = self.rate_decay * self.tokens + tau
        self.ms = self.rate_decay * self.ms + ms
        if strong:
            last = self.measured_tau
            self.measured_tau = tau if last is None else self.strong_decay * last + (1 - self.strong_decay) * tau
            self.weak_run = 0
        else:
            self.weak_run += 1
