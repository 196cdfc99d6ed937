"""Frozen configuration dataclasses.

The CLI, YAML profiles and the tuner all build these the same way: ``from_mapping(Cls, dict)``,
which rejects unknown keys, checks every value against the field's type and runs each class's
``__post_init__`` validation.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import yaml

from .errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], values: Mapping[str, Any] | None, where: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``values``: an unknown key names the valid ones, a value of the
    wrong type names the expected one, and the class's own ``__post_init__`` checks run; errors start with ``where``."""
    values = dict(values or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields), key=str)
    if unknown:
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}unknown setting(s) {', '.join(map(str, unknown))}",
            f"valid settings are: {', '.join(sorted(fields))}",
        )
    hints = typing.get_type_hints(cls)
    checked = {key: check_value(value, hints[key], _label(where, key), fields[key].default) for key, value in values.items()}
    try:
        return cls(**checked)
    except ConfigError as error:
        if not where or error.message.startswith(where):
            raise
        raise ConfigError(f"{where}: {error.message}", error.hint) from None


class _Mismatch(Exception):
    """A value does not fit an annotation (turned into a ConfigError naming the whole field)."""


def check_value(value: Any, annotation: Any, label: str, default: Any = dataclasses.MISSING) -> Any:
    """``value`` checked against the type ``annotation`` (converted where that is lossless: an int for a float,
    a list or ``"1,3"`` for a tuple); a ConfigError naming ``label`` and the expected type otherwise."""
    try:
        return _convert(value, annotation, label)
    except _Mismatch:
        key = label.rpartition(".")[2].rpartition(": ")[2]
        shown = "" if default is dataclasses.MISSING else f"; the default is {_flow(default)}"
        raise ConfigError(
            f"{label} must be {describe_type(annotation)}, not {_shown(value)}",
            f"give {key} as {describe_type(annotation)}{shown}",
        ) from None


def _convert(value: Any, annotation: Any, label: str) -> Any:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for member in (a for a in args if a is not type(None)):
            try:
                return _convert(value, member, label)
            except _Mismatch:
                continue
        raise _Mismatch
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if isinstance(value, Mapping):
            return from_mapping(annotation, value, label)
        raise _Mismatch
    if origin is tuple:
        return _convert_tuple(value, args, label)
    if origin in (Mapping, dict):
        if not isinstance(value, Mapping):
            raise _Mismatch
        return value
    return _convert_scalar(value, annotation)


def _convert_tuple(value: Any, args: tuple[Any, ...], label: str) -> tuple[Any, ...]:
    element = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
    if isinstance(value, str) and element in _SCALARS:
        value = [part.strip() for part in value.split(",") if part.strip()]  # "1,3": the CLI's short form
    elif isinstance(value, (bool, int, float)) and element in _SCALARS:
        value = [value]  # one layer, one threshold
    if not isinstance(value, (list, tuple)):
        raise _Mismatch
    return tuple(_convert(item, element, label) for item in value)


_SCALARS = (bool, int, float, str)


def _convert_scalar(value: Any, annotation: Any) -> Any:
    if annotation not in _SCALARS:
        return value  # a type this checker does not know: the class's own validation decides
    if isinstance(value, str) and annotation in (int, float):
        try:
            return annotation(value)  # an element of "1,3"
        except ValueError:
            raise _Mismatch from None
    if isinstance(value, bool) and annotation is not bool:
        raise _Mismatch
    if annotation is float and isinstance(value, int):
        return float(value)
    if not isinstance(value, annotation):
        raise _Mismatch
    return value


def describe_type(annotation: Any, plural: bool = False) -> str:
    """``tuple[float, ...]`` → "a list of numbers" (``plural``: "lists of numbers")."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe_type(a, plural) for a in args)
    if origin is tuple:
        element = args[0] if len(args) == 2 and args[1] is Ellipsis else Any
        inner = "values" if element is Any else describe_type(element, plural=True)
        return f"{'lists' if plural else 'a list'} of {inner}"
    if dataclasses.is_dataclass(annotation) or origin in (Mapping, dict):
        return "mappings" if plural else "a mapping"
    names = {bool: ("true or false", "booleans"), int: ("an integer", "integers"), float: ("a number", "numbers"),
             str: ("a string", "strings")}
    singular, many = names.get(annotation, (getattr(annotation, "__name__", str(annotation)),) * 2)
    return many if plural else singular


def _shown(value: Any) -> str:
    """``the string "notalist"``, ``the list [0.3, "x"]``, ``null``: the value and what it was read as."""
    if value is None:
        return "null"
    kinds = {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", tuple: "list", dict: "mapping"}
    return f"the {kinds.get(type(value), type(value).__name__)} {_flow(value)}"


def _flow(value: Any) -> str:
    """A value as the user would type it: JSON, which is also YAML flow style."""
    return json.dumps(value, default=str)


def _label(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


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
