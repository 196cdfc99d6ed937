"""CI performance-regression gate: compare a bench run against a stored baseline results.json.

A method regresses when its speedup or τ is below the baseline's by more than ``tolerance`` (a
fraction: 0.1 allows 10 % less). Methods missing on either side are reported, not failed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError

METRICS = ("speedup", "tau")


@dataclass(frozen=True)
class Regression:
    method: str
    metric: str
    baseline: float
    current: float
    floor: float  # baseline × (1 − tolerance)

    def describe(self) -> str:
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


def check_tolerance(tolerance: float) -> None:
    if not 0 <= tolerance < 1:
        raise ConfigError(f"tolerance {tolerance} outside [0, 1)", "pass --tolerance as a fraction, e.g. 0.1 for 10 %")


def check_against(results: dict[str, Any], baseline: dict[str, Any], tolerance: float) -> tuple[list[Regression], list[str]]:
    """(regressions, methods compared). Each metric must be >= baseline × (1 − tolerance)."""
    check_tolerance(tolerance)
    regressions, compared = [], []
    for method, base in baseline["methods"].items():
        current = results["methods"].get(method)
        if current is None or not isinstance(base, dict):
            continue
        compared.append(method)
        for metric in METRICS:
            if not isinstance(base.get(metric), (int, float)):
                continue
            floor = float(base[metric]) * (1 - tolerance)
            if float(current[metric]) < floor:
                regressions.append(Regression(method, metric, float(base[metric]), float(current[metric]), floor))
    return regressions, compared
