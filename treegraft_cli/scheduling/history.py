"""StepHistory: what the last verified steps of a request measured, for the scheduler's extended features.

The paper's 17 features describe the tree being built; what the step rule has shown to matter is what the
recent steps *achieved*: the accepted length of steps by how often they called the strong drafter, how often
each drafter's nodes were accepted, and the rate the request is running at. Every value is an exponentially
weighted mean (``decay`` per step) that starts from a prior worth ``prior_steps`` steps, so the first steps of
a request read as the prior and an action not taken lately keeps its last measurement.

    recent_tau_no_call      accepted length of steps without a strong call
    recent_tau_one_call     ... with one strong call
    recent_tau_more_calls   ... with two or more
    recent_ngram_acceptance share of verified n-gram nodes (whose parent was accepted) that were accepted
    recent_model_acceptance the same for the strong drafter's nodes
    recent_rate             accepted tokens per modelled step time, in root verifications (τ · verify_root / T):
                            a dimensionless rate, so it reads the same on faster and slower hardware
"""

from __future__ import annotations

import torch

from ..tree import ORIGIN_MODEL, ORIGIN_NGRAM, DraftTree
from .policies import CostModel


class RunningMean:
    """An exponentially weighted mean with a prior worth ``prior_weight`` observations."""

    def __init__(self, prior: float, prior_weight: float, decay: float):
        self.prior, self.prior_weight, self.decay = prior, prior_weight, decay
        self.total, self.weight = 0.0, 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.decay * self.total + value * weight
        self.weight = self.decay * self.weight + weight

    @property
    def value(self) -> float:
        return (self.total + self.prior * self.prior_weight) / (self.weight + self.prior_weight)


class StepHistory:
    def __init__(self, decay: float = 0.8, prior_steps: float = 1.0):
        self.tau_by_calls = [RunningMean(1.0, prior_steps, decay) for _ in range(3)]
        self.acceptance = {origin: RunningMean(0.5, prior_steps, decay) for origin in (ORIGIN_NGRAM, ORIGIN_MODEL)}
        self.rate = RunningMean(1.0, prior_steps, decay)

    def observe(
        self,
        tree: DraftTree,  # the verified tree (host)
        accepted: torch.Tensor,  # [a] root and accepted node indices
        calls: int,  # strong calls of the step
        costs: CostModel,
        budget: int,
    ) -> None:
        tau = accepted.numel()  # accepted nodes + the bonus (the root stands for the bonus)
        self.tau_by_calls[min(calls, 2)].add(float(tau))
        mask = torch.zeros(tree.num_nodes, dtype=torch.bool)
        mask[accepted] = True
        parents, origins = tree.parents, tree.origins
        judged = mask[parents.clamp(min=0)]  # verified nodes whose parent was accepted
        judged[0] = False
        for origin, mean in self.acceptance.items():
            nodes = judged & (origins == origin)
            count = int(nodes.sum())
            if count:
                mean.add(float(mask[nodes].float().mean()), count)
        step_ms = costs.verify_at(tree.size, budget) + calls * costs.strong_ms
        unit = costs.verify_root_ms or costs.verify_ms
        if step_ms > 0 and unit > 0:
            self.rate.add(tau * unit / step_ms)

    def values(self) -> tuple[float, ...]:
        """The extended features, in ``policies.HISTORY_FEATURE_NAMES`` order."""
        return (*(m.value for m in self.tau_by_calls), self.acceptance[ORIGIN_NGRAM].value,
                self.acceptance[ORIGIN_MODEL].value, self.rate.value)
