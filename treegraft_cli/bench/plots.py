"""PNG plots of a bench run: speedup and τ per benchmark (plus "all"), one bar group per benchmark.

Every contender gets its own colour (``ar`` grey, the rest drawn evenly from a qualitative palette, as many
distinct colours as there are contenders); speedup bars carry the 95 % bootstrap interval as error bars;
a contender that failed the lossless check is hatched and labelled "NOT LOSSLESS" in the legend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import colormaps  # noqa: E402

from ..atomic import save_figure  # noqa: E402

ALL = "all"
BASELINE_COLOUR = "#7f7f7f"


def series_colours(names: list[str], baseline: str = "ar") -> dict[str, Any]:
    """A distinct colour per series: the baseline grey; the others from tab10 (its grey left out), then Dark2
    (its grey left out), then the light half of tab20; past 25 series, evenly spaced hues."""
    others = [n for n in names if n != baseline]
    palette = ([colormaps["tab10"](i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)]
               + [colormaps["Dark2"](i) for i in range(7)]
               + [colormaps["tab20"](i) for i in (1, 3, 5, 7, 9, 11, 13, 17, 19)])
    if len(others) > len(palette):
        palette = [colormaps["hsv"](i / len(others)) for i in range(len(others))]
    colours = {name: palette[i] for i, name in enumerate(others)}
    if baseline in names:
        colours[baseline] = BASELINE_COLOUR
    return colours


def _values(method: dict[str, Any], metric: str, benchmark: str) -> tuple[float, list[float] | None]:
    entry = method if benchmark == ALL else method["per_benchmark"].get(benchmark, {})
    interval = entry.get(f"{metric}_ci") if metric == "speedup" else None
    return float(entry.get(metric) or 0.0), interval


def _bars(results: dict[str, Any], metric: str, title: str, path: Path) -> Path:
    benchmarks = [*results["benchmarks"], ALL]
    methods = list(results["methods"])
    colours = series_colours(methods, results.get("baseline", "ar"))
    width = 0.8 / max(1, len(methods))
    figure, axis = plt.subplots(figsize=(max(6, 1.4 * len(benchmarks) + 2) + 2.5, 4.5))
    for i, name in enumerate(methods):
        method = results["methods"][name]
        values, errors = [], [[], []]
        for benchmark in benchmarks:
            value, interval = _values(method, metric, benchmark)
            values.append(value)
            errors[0].append(max(0.0, value - interval[0]) if interval else 0.0)
            errors[1].append(max(0.0, interval[1] - value) if interval else 0.0)
        failed = method.get("lossless") is False
        axis.bar([x + i * width for x in range(len(benchmarks))], values, width, color=colours[name],
                 hatch="xx" if failed else None, edgecolor="black" if failed else None,
                 yerr=errors if any(errors[0] + errors[1]) else None, capsize=2, ecolor="black",
                 label=f"{name} (NOT LOSSLESS)" if failed else name)
    axis.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(benchmarks))], benchmarks)
    if metric == "speedup":
        axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_ylabel(metric + (" (bars: 95% interval)" if metric == "speedup" else ""))
    axis.set_title(f"{title} — {results.get('pair', '')}")
    axis.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.tight_layout()
    return save_figure(figure, path)


def write_plots(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        _bars(results, "speedup", "speedup over ar", out_dir / "speedup.png"),
        _bars(results, "tau", "mean accepted length τ", out_dir / "tau.png"),
    ]
