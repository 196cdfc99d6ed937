"""PNG of a tuning study: speedup per trial with the best so far, or the Pareto front for two objectives."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import optuna  # noqa: E402

from ..atomic import save_figure  # noqa: E402
from .study import completed  # noqa: E402


def write_study_plot(study: optuna.Study, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    trials = completed(study)
    figure, axis = plt.subplots(figsize=(7, 4))
    if len(study.directions) > 1:
        front = {t.number for t in study.best_trials}
        axis.scatter([t.values[1] for t in trials], [t.values[0] for t in trials], c=["C3" if t.number in front else "C0" for t in trials])
        axis.set_xlabel("peak memory (MiB)")
        axis.set_title(f"{study.study_name}: speedup vs memory (red: Pareto front)")
    else:
        numbers = [t.number for t in trials]
        values = [t.values[0] for t in trials]
        best = [max(values[: i + 1]) for i in range(len(values))]
        axis.scatter(numbers, values, label="trial")
        axis.step(numbers, best, where="post", color="C3", label="best so far")
        pruned = [t.number for t in study.trials if t.state == optuna.trial.TrialState.PRUNED]
        if pruned:
            axis.scatter(pruned, [0] * len(pruned), marker="x", color="grey", label="pruned")
        axis.set_xlabel("trial")
        axis.legend()
        axis.set_title(f"{study.study_name}: speedup over ar")
    axis.set_ylabel("speedup")
    figure.tight_layout()
    return save_figure(figure, path)
