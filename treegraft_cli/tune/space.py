"""Search spaces for ``treegraft tune``, read from ``tuning/<method>.yaml``.

A space file::

    method: dense
    params:                                  # what Optuna samples
      tree.budget: {type: int, low: 8, high: 96, step: 4}
      options.thresholds.0: {type: float, low: 0.05, high: 0.9, log: false}
      options.template: {type: categorical, choices: {paper: [8, 10, 8], flat: [6, 6, 6]}}
    fixed:                                   # set on every trial, not searched
      options.checkpoints: [0, 1, 5]
    defaults:                                # enqueued as the first trial (the paper's settings)
      tree.budget: 60

Keys: ``tree.FIELD`` and ``sampling.FIELD`` (DecodeConfig fields), ``options.NAME`` (the method's own
option, passed in ``DecodeConfig.method_options``) and ``options.NAME.I`` (element I of a list option).
Categorical choices may be a list of plain values, or a mapping name → value (Optuna stores the name).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..config import DecodeConfig
from ..errors import ConfigError
from ..profiles import decode_config_from_mapping

TUNING_ENV = "TREEGRAFT_TUNING"
KINDS = ("int", "float", "categorical")
_KEY = re.compile(r"^(tree|sampling)\.\w+$|^options\.\w+(\.\d+)?$")


@dataclass(frozen=True)
class Param:
    key: str
    kind: str  # int | float | categorical
    low: float = 0
    high: float = 0
    step: float | None = None
    log: bool = False
    choices: Mapping[str, Any] | tuple[Any, ...] = ()

    def suggest(self, trial) -> Any:
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), step=int(self.step or 1), log=self.log)
        if self.kind == "float":
            return trial.suggest_float(self.key, float(self.low), float(self.high), step=self.step, log=self.log)
        if isinstance(self.choices, Mapping):
            return self.choices[trial.suggest_categorical(self.key, list(self.choices))]
        return trial.suggest_categorical(self.key, list(self.choices))


@dataclass(frozen=True)
class SearchSpace:
    method: str
    params: tuple[Param, ...]
    fixed: Mapping[str, Any] = field(default_factory=dict)
    defaults: Mapping[str, Any] = field(default_factory=dict)  # Optuna param values (choice names for mappings)
    source: str = ""

    def suggest(self, trial) -> dict[str, Any]:
        """Flat key → value for one trial (fixed values included)."""
        values = dict(self.fixed)
        values.update({p.key: p.suggest(trial) for p in self.params})
        return values

    def resolve(self, optuna_params: Mapping[str, Any]) -> dict[str, Any]:
        """Optuna's stored params (choice names) → flat key → value, fixed values included."""
        values = dict(self.fixed)
        for p in self.params:
            if p.key in optuna_params:
                raw = optuna_params[p.key]
                values[p.key] = p.choices[raw] if p.kind == "categorical" and isinstance(p.choices, Mapping) else raw
        return values


def tuning_dir() -> Path:
    override = os.environ.get(TUNING_ENV)
    return Path(override).expanduser() if override else Path(__file__).resolve().parents[2] / "tuning"


def space_names() -> list[str]:
    root = tuning_dir()
    return sorted(p.stem for p in root.glob("*.yaml")) if root.is_dir() else []


def _param(key: str, spec: Any, where: str) -> Param:
    if not _KEY.match(key):
        raise ConfigError(f"{where}: params.{key}: unknown key form", "use tree.FIELD, sampling.FIELD, options.NAME or options.NAME.I")
    if not isinstance(spec, Mapping) or spec.get("type") not in KINDS:
        raise ConfigError(f"{where}: params.{key}.type must be one of {', '.join(KINDS)}", "write {type: int, low: 1, high: 8}")
    unknown = sorted(set(spec) - {"type", "low", "high", "step", "log", "choices"})
    if unknown:
        raise ConfigError(f"{where}: params.{key}: unknown field(s) {', '.join(unknown)}", "fields are type, low, high, step, log, choices")
    if spec["type"] == "categorical":
        choices = spec.get("choices")
        if not isinstance(choices, (list, Mapping)) or not choices:
            raise ConfigError(f"{where}: params.{key}.choices must be a non-empty list or mapping", "list the values to try")
        return Param(key, "categorical", choices=dict(choices) if isinstance(choices, Mapping) else tuple(choices))
    for bound in ("low", "high"):
        if isinstance(spec.get(bound), bool) or not isinstance(spec.get(bound), (int, float)):
            raise ConfigError(f"{where}: params.{key}.{bound} must be a number", f"give {key} a numeric {bound}")
    if spec["low"] > spec["high"]:
        raise ConfigError(f"{where}: params.{key}: low {spec['low']} > high {spec['high']}", "swap low and high")
    return Param(key, spec["type"], spec["low"], spec["high"], spec.get("step"), bool(spec.get("log", False)))


def load_space(method: str, path: Path | None = None) -> SearchSpace:
    """The search space of ``method`` (``tuning/<method>.yaml``, or ``path``); errors name the field."""
    path = Path(path) if path else tuning_dir() / f"{method}.yaml"
    if not path.is_file():
        raise ConfigError(f"no search space for method {method!r} ({path} does not exist)",
                          f"spaces exist for: {', '.join(space_names()) or '(none)'}; or pass --space FILE.yaml")
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})", "fix the YAML syntax") from None
    where = str(path)
    if not isinstance(document, Mapping) or not isinstance(document.get("params"), Mapping) or not document["params"]:
        raise ConfigError(f"{where}: field 'params' must be a non-empty mapping", "see tuning/dense.yaml for the format")
    unknown = sorted(set(document) - {"method", "params", "fixed", "defaults"})
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}", "fields are method, params, fixed, defaults")
    params = tuple(_param(str(k), v, where) for k, v in document["params"].items())
    for section in ("fixed", "defaults"):
        if not isinstance(document.get(section) or {}, Mapping):
            raise ConfigError(f"{where}: {section} must be a mapping", f"write {section} as key: value lines")
    for key in document.get("fixed") or {}:
        if not _KEY.match(str(key)):
            raise ConfigError(f"{where}: fixed.{key}: unknown key form", "use tree.FIELD, sampling.FIELD, options.NAME or options.NAME.I")
    keys = {p.key for p in params}
    stray = sorted(set(document.get("defaults") or {}) - keys)
    if stray:
        raise ConfigError(f"{where}: defaults.{stray[0]} is not a searched param", f"searched params: {', '.join(sorted(keys))}")
    return SearchSpace(str(document.get("method", method)), params, dict(document.get("fixed") or {}),
                       dict(document.get("defaults") or {}), where)


def apply(base: DecodeConfig, method: str, values: Mapping[str, Any]) -> DecodeConfig:
    """``base`` with flat ``values`` applied, built through ``decode_config_from_mapping`` like a profile."""
    mapping = dataclasses.asdict(base)
    mapping["method"] = method
    options = dict(base.method_options)
    lists: dict[str, dict[int, Any]] = {}
    for key, value in values.items():
        head, name, *index = key.split(".")
        if head == "options" and index:
            lists.setdefault(name, {})[int(index[0])] = value
        elif head == "options":
            options[name] = value
        else:
            mapping[head] = {**mapping[head], name: value}
    for name, items in lists.items():
        options[name] = [items[i] for i in sorted(items)]
    mapping["method_options"] = options
    return decode_config_from_mapping(mapping, f"tuned {method} config")
