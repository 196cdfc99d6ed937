"""Frozen configuration dataclasses.

The CLI, YAML profiles and the tuner all build these the same way: ``from_mapping(Cls, dict)``,
which rejects unknown keys and runs each class's ``__post_init__`` validation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from .errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``values``; an unknown key names the valid ones."""
    values = dict(values or {})
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(names))
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}unknown setting(s) {', '.join(unknown)}",
            f"valid settings are: {', '.join(sorted(names))}",
        )
    for key, value in list(values.items()):
        default = names[key].default
        if isinstance(default, tuple) and isinstance(value, list):
            values[key] = tuple(tuple(v) if isinstance(v, list) else v for v in value)
    return cls(**values)


def parse_options(pairs: Sequence[str]) -> dict[str, Any]:
    """``["key=value", ...]`` → ``{key: value}``, each value read as YAML (``8``, ``[0,1,5]``, ``0.3``)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"method option {pair!r} is not KEY=VALUE", "e.g. --option thresholds=[0.3,0.2,0.05]")
        try:
            options[key.strip()] = yaml.safe_load(text)
        except yaml.YAMLError as failure:
            raise ConfigError(f"method option {key}: cannot read {text!r}", f"give a YAML value ({failure})") from None
    return options


def _require(condition: bool, message: str, hint: str) -> None:
    if not condition:
        raise ConfigError(message, hint)


@dataclass(frozen=True)
class SamplingConfig:
    """How the target's distribution is turned into tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0  # 1.0: no nucleus filter

    def __post_init__(self) -> None:
        _require(self.temperature >= 0, f"temperature {self.temperature} < 0", "use --temperature 0 for greedy")
        _require(self.top_k >= 0, f"top-k {self.top_k} < 0", "use 0 to disable top-k")
        _require(0 < self.top_p <= 1, f"top-p {self.top_p} outside (0, 1]", "use 1.0 to disable top-p")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TreeConfig:
    """Shape of the draft tree shared by every tree builder.

    budget: N, non-root nodes per verification. depth: D, deepest layer drafted. top_k: K, frontier
    width and children per expanded node.
    """

    budget: int = 60
    depth: int = 5
    top_k: int = 8

    def __post_init__(self) -> None:
        _require(self.budget >= 1, f"tree budget {self.budget} < 1", "pass --budget 1 or more")
        _require(self.depth >= 1, f"tree depth {self.depth} < 1", "pass --depth 1 or more")
        _require(self.top_k >= 1, f"tree top-k {self.top_k} < 1", "pass --top-k 1 or more")


@dataclass(frozen=True)
class DecodeConfig:
    """Everything one generation needs besides the models and the prompt."""

    method: str = "dense"
    tree: TreeConfig = field(default_factory=TreeConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_new_tokens: int = 128
    seed: int = 0
    kernels: str = "auto"  # auto | torch | triton: which backend runs tree verification
    compile: str = "off"  # off | static | compile | cudagraphs: the verify forward's shapes and capture (capture.py)
    method_options: Mapping[str, Any] = field(default_factory=dict)  # method-specific settings

    def __post_init__(self) -> None:
        _require(self.max_new_tokens >= 1, f"max new tokens {self.max_new_tokens} < 1", "pass --max-new-tokens 1 or more")
        _require(
            self.kernels in ("auto", "torch", "triton"),
            f"unknown kernel backend {self.kernels!r}",
            "use --kernels auto, torch or triton",
        )
        _require(
            self.compile in ("off", "static", "compile", "cudagraphs"),
            f"unknown --compile mode {self.compile!r}",
            "use --compile off, static, compile or cudagraphs",
        )
