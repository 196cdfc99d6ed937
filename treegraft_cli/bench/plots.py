"""PNG plots of a bench run: speedup per benchmark and τ per benchmark, one bar group per method."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..atomic import save_figure  # noqa: E402


def _bars(results: dict[str, Any], metric: str, title: str, path: Path) -> Path:
    benchmarks = results["benchmarks"]
    methods = list(results["methods"])
    width = 0.8 / max(1, len(methods))
    figure, axis = plt.subplots(figsize=(max(6, 1.4 * len(benchmarks) + 2), 4))
    for i, method in enumerate(methods):
        per = results["methods"][method]["per_benchmark"]
        values = [per.get(b, {}).get(metric, 0.0) for b in benchmarks]
        axis.bar([x + i * width for x in range(len(benchmarks))], values, width, label=method)
    axis.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(benchmarks))], benchmarks)
    if metric == "speedup":
        axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel(metric)
    axis.set_title(f"{title} — {results.get('pair', '')}")
    axis.legend(fontsize="small", ncol=min(4, len(methods)))
    figure.tight_layout()
    return save_figure(figure, path)


def write_plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _bars(results, "speedup", "speedup over ar", out_dir / "speedup.png"),
        _bars(results, "tau", "mean accepted length τ", out_dir / "tau.png"),
    ]
