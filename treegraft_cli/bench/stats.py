"""Speedup over ``ar`` as a ratio of pooled tokens/s, with a bootstrap interval over questions.

For a method M and the baseline ``ar`` on the same questions (every turn and repeat of a question summed)::

    speedup = (Σ tokens_M / Σ wall_M) / (Σ tokens_ar / Σ wall_ar)

Pooling weights every token alike, so a long answer counts more than a short one, as it does for a user.
The interval resamples *questions* with replacement (a question's turns and repeats stay together, and
M's and ``ar``'s sums of one question are drawn together, since they share its text and the machine's state
at that moment) ``RESAMPLES`` times with a fixed seed, and takes the 2.5 and 97.5 percentiles of the
resampled ratio: a 95 % interval for the speedup on questions like these. It says how much the number
depends on which questions were asked; run-to-run noise of the machine enters through the per-question
timings. With one question the interval is the point itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RESAMPLES = 2000
SEED = 0
LEVEL = 0.95


@dataclass(frozen=True)
class PerQuestion:
    """A method's and the baseline's sums per question (``[questions]`` each), in the same question order."""

    tokens: np.ndarray
    wall: np.ndarray
    base_tokens: np.ndarray
    base_wall: np.ndarray

    @classmethod
    def of(cls, rows: Sequence[tuple[float, float, float, float]]) -> PerQuestion:
        """From ``(tokens, wall, base_tokens, base_wall)`` rows, one per question."""
        columns = np.asarray(rows, dtype=np.float64).reshape(-1, 4)
        return cls(*(columns[:, i] for i in range(4)))

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def pooled_speedup(data: PerQuestion) -> float:
    """Pooled tokens/s of the method over pooled tokens/s of the baseline (0 when either is empty)."""
    wall, base_wall, base_tokens = data.wall.sum(), data.base_wall.sum(), data.base_tokens.sum()
    if wall <= 0 or base_wall <= 0 or base_tokens <= 0:
        return 0.0
    return float((data.tokens.sum() / wall) / (base_tokens / base_wall))


def bootstrap_interval(
    data: PerQuestion, resamples: int = RESAMPLES, seed: int = SEED, level: float = LEVEL
) -> tuple[float, float] | None:
    """The percentile bootstrap interval of ``pooled_speedup`` over questions; None without questions."""
    n = len(data)
    if n == 0 or pooled_speedup(data) == 0.0:
        return None
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n, size=(resamples, n))  # [resamples, n] question indices
    sums = [column[picks].sum(axis=1) for column in (data.tokens, data.wall, data.base_tokens, data.base_wall)]
    tokens, wall, base_tokens, base_wall = sums
    valid = (wall > 0) & (base_wall > 0) & (base_tokens > 0)
    ratios = (tokens[valid] / wall[valid]) / (base_tokens[valid] / base_wall[valid])
    if ratios.size == 0:
        return None
    tail = (1 - level) / 2
    low, high = np.quantile(ratios, [tail, 1 - tail])
    return float(low), float(high)
