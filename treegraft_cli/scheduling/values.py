"""The value of a scheduler decision (defined in ``rollouts``): V = τ − R·T, R the policy's running rate.

Rows come from one or more generations; each row of a generation carries the outcome of that step's real
tree (``tau_real`` …), so R is priced under any cost profile from the rows alone. Rollouts collected
before the real outcome was stored have no R: their value falls back to the one-step rate τ / T.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

REAL_COLUMNS = ("tau_real", "nodes_real", "calls_real", "weak_real")
LAG_COLUMN = "strong_lag"  # committed tokens the strong drafter had not forwarded when the step was decided

# A strong call first forwards what the strong drafter has not seen of the committed text: the tokens since its last
# call, or the prompt at a generation's first call. ``step_rule.StepRule`` pays up to MAX_LAG of them as part of a
# step's time and prices more as an investment about CATCH_UP_HORIZON later strong steps share.
MAX_LAG = 64
CATCH_UP_HORIZON = 8.0


# The share of a strong call's catch-up time (forwarding the unseen committed tokens) a label charges its step, whatever
# the lag. Every committed token is forwarded before the strong drafter's next call, whenever that comes, and a
# forward's time grows about linearly with its tokens: calling now or later moves that work, it does not add to it.
# What calling now changes is that the strong steps after it start from a short lag; a step's label sees only its own
# step, so it is charged a share, as the step rule charges a prompt's catch-up. Charged in full up to MAX_LAG, a lag
# made calling look dearer after every weak step, and a scheduler learned to stop calling once it had skipped a few.
CATCH_UP_SHARE = 1.0 / CATCH_UP_HORIZON


def running_rates(
    generations: Sequence,  # [n] one hashable per row: the generation (prompt key, turn) it belongs to
    steps: Sequence[int],  # [n] the row's step within its generation
    tau_real: torch.Tensor,  # [n] the real step's accepted length
    ms_real: torch.Tensor,  # [n] the real step's modelled ms
) -> torch.Tensor:  # [n] tokens per ms
    """R of each row: Σ τ_real / Σ T_real over the distinct probed steps of the row's generation."""
    tokens: dict = {}
    ms: dict = {}
    seen = set()
    for i, (generation, step) in enumerate(zip(generations, steps, strict=True)):
        if (generation, step) in seen:  # a step's layers share one real outcome
            continue
        seen.add((generation, step))
        tokens[generation] = tokens.get(generation, 0.0) + float(tau_real[i])
        ms[generation] = ms.get(generation, 0.0) + float(ms_real[i])
    return torch.tensor([tokens[g] / ms[g] if ms[g] > 0 else 0.0 for g in generations], dtype=torch.float32)


def decision_values(
    tau: torch.Tensor,  # [n] accepted length of the action's tree
    ms: torch.Tensor,  # [n] its modelled step time
    rate: torch.Tensor | None,  # [n] running rate R (tokens per ms), None for old rollouts
) -> torch.Tensor:  # [n]
    """V = τ − R·T in tokens, or 1000·τ/T (tokens per modelled second) without a running rate."""
    if rate is None:
        return 1000.0 * tau / ms
    return tau - rate * ms
