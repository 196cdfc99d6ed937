"""CI performance-regression gate: compare a bench run against a stored baseline results.json.

Speedup is measured on a noisy machine, so a method regresses in speedup only when the whole 95 %
interval of the current run lies below the allowed floor: ``speedup_ci[1] < baseline speedup × (1 −
tolerance)`` (a run without an interval is judged by its point value). Accepted length τ does not depend on
the machine's speed for methods with fixed decisions (greedy fp32 makes it deterministic), so it is judged
by its value: ``tau < baseline tau × (1 − tau_tolerance)``. ``tau_tolerance`` (default 0.05) leaves room for
methods that decide on measured times (the step rule of ``treegraft``) and for bf16 ties that change
texts. Methods missing on either side are reported, not failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

METRICS = ("speedup", "tau")


TAU_TOLERANCE = 0.05


@dataclass(frozen=True)
class Regression:
    method: str
    metric: str
    baseline: float
    current: float
    floor: float  # baseline × (1 − tolerance)
    interval: tuple[float, float] | None = None  # the current run's 95 % interval, when it has one

    def describe(self) -> str:
        if self.interval:
            low, high = self.interval
            return (f"{self.method} {self.metric} {self.current:.3f} (95% interval {low:.3f}–{high:.3f}) lies below "
                    f"{self.floor:.3f} (baseline {self.baseline:.3f})")
        return f"{self.method} {self.metric} {self.current:.3f} < {self.floor:.3f} (baseline {self.baseline:.3f})"


def load_baseline(path: Path) -> dict[str, Any]:
    """A baseline results.json, checked before the run: it must hold ``methods.NAME.speedup`` / ``tau`` numbers."""
    path = Path(path)
    fix = "pass a results.json written by `treegraft bench`"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"baseline {path} does not exist", fix) from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"baseline {path} is not JSON ({error.msg}, line {error.lineno})", fix) from None
    except UnicodeDecodeError:
        raise ConfigError(f"baseline {path} is not JSON (not UTF-8 text)", fix) from None
    except OSError as error:
        raise ConfigError(f"cannot read baseline {path} ({error.strerror or error})", fix) from None
    if not isinstance(document, dict) or not isinstance(document.get("methods"), dict):
        raise ConfigError(f"baseline {path} has no 'methods' object", fix)
    for name, entry in document["methods"].items():
        if not isinstance(entry, dict):
            raise ConfigError(f"baseline {path}: methods.{name} is not an object", fix)
        for metric in METRICS:
            if metric in entry and not _is_number(entry[metric]):
                raise ConfigError(f"baseline {path}: methods.{name}.{metric} is not a number ({entry[metric]!r})", fix)
    if not any(_is_number(entry.get(metric)) for entry in document["methods"].values() for metric in METRICS):
        raise ConfigError(f"baseline {path} holds no method with a speedup or tau: the gate would compare nothing", fix)
    return document


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _interval(method: dict[str, Any]) -> tuple[float, float] | None:
    value = method.get("speedup_ci")
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(_is_number(v) for v in value):
        return float(value[0]), float(value[1])
    return None


def check_tolerances(tolerance: float, tau_tolerance: float = TAU_TOLERANCE) -> None:
    for name, value in (("--tolerance", tolerance), ("--tau-tolerance", tau_tolerance)):
        if not 0 <= value < 1:
            raise ConfigError(f"{name} {value} outside [0, 1)", f"pass {name} as a fraction, e.g. 0.1 for 10 %")


def check_against(
    results: dict[str, Any], baseline: dict[str, Any], tolerance: float, tau_tolerance: float = TAU_TOLERANCE
) -> tuple[list[Regression], list[str]]:
    """(regressions, methods compared); the rules are in the module docstring."""
    check_tolerances(tolerance, tau_tolerance)
    regressions, compared = [], []
    for method, base in baseline["methods"].items():
        current = results["methods"].get(method)
        if current is None or not isinstance(base, dict):
            continue
        compared.append(method)
        if _is_number(base.get("speedup")):
            floor = float(base["speedup"]) * (1 - tolerance)
            interval = _interval(current)
            if (interval[1] if interval else float(current["speedup"])) < floor:
                regressions.append(Regression(method, "speedup", float(base["speedup"]), float(current["speedup"]),
                                              floor, interval))
        if _is_number(base.get("tau")):
            floor = float(base["tau"]) * (1 - tau_tolerance)
            if float(current["tau"]) < floor:
                regressions.append(Regression(method, "tau", float(base["tau"]), float(current["tau"]), floor))
    return regressions, compared
