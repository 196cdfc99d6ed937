"""The interface every decoding method implements, and the registry that names them.

A method is a tree builder: the engine asks it for a draft tree each step and tells it what the
target decided. Methods register themselves by name; nothing else branches on method names.
"""

from __future__ import annotations

import dataclasses
import typing
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..config import DecodeConfig, describe_type, from_mapping
from ..errors import ConfigError
from ..hostlists import longs
from ..lm import CausalLM
from ..tree import DraftTree
from ..verify import StepVerdict


@dataclass(frozen=True)
class Prefill:
    """The target's pass over the prompt, offered to methods that learn from it."""

    prompt_ids: torch.Tensor  # [prompt_length]
    logits: torch.Tensor  # [prompt_length, vocab] target logits at every prompt position
    first_token: int | None = None  # the target's token after the prompt (the first root), read by the engine

    def context(self) -> list[int]:
        """The committed tokens when the first step starts, on the host (the prompt, then the first token)."""
        ids = self.prompt_ids.tolist()
        return ids if self.first_token is None else [*ids, self.first_token]


@dataclass(frozen=True)
class Observation:
    """One verified step, offered to drafters that learn online.

    ``num_accepted``, ``new_tokens`` and ``host`` were read to the host once, with the verdict: methods
    learn from them without another synchronisation.
    """

    tree: DraftTree
    logits: torch.Tensor  # [num_nodes, vocab] target logits at every tree node
    committed: torch.Tensor  # [length] all committed tokens after this step, new root last
    num_accepted: int
    new_tokens: list[int]  # the tokens this step committed: the accepted ones, then the bonus
    accepted_nodes: list[int]  # their node indices (root excluded): ``path`` on the host
    host: tuple[torch.Tensor, ...] = ()  # host copies of what ``Method.readback`` asked for; () when not read

    @property
    def path(self) -> torch.Tensor:
        """Accepted node indices, root excluded: ``[num_accepted]`` on the host."""
        return longs(self.accepted_nodes)

    @property
    def root_path(self) -> torch.Tensor:
        """The root and the accepted node indices, root first: ``[num_accepted + 1]`` on the host."""
        return longs([0, *self.accepted_nodes])


@dataclass(frozen=True)
class Models:
    """The models a method may use: the target and, for model-drafting methods, the drafter."""

    target: CausalLM
    drafter: CausalLM | None = None
    vocab_size: int = 0
    measurements: dict[Any, Any] = field(default_factory=dict)  # methods' measurements of these models, by key
    pair: str = ""  # DRAFTER:TARGET as the user named it ("" when the models were built some other way)


@dataclass(frozen=True)
class OptionField:
    """One ``-o KEY=VALUE`` setting of a method, as ``treegraft methods`` lists it."""

    key: str
    type: str  # "a list of numbers"
    default: Any


class Method(ABC):
    """Base tree builder. Subclasses set ``name`` and override ``draft``; the rest is optional."""

    name: ClassVar[str] = ""
    needs_drafter: ClassVar[bool] = False
    description: ClassVar[str] = ""
    argument: ClassVar[str] = ""  # what may follow ``NAME:`` (``fixed:L[,L...]``); "" when nothing may
    argument_help: ClassVar[str] = ""  # what the argument means
    needs_argument: ClassVar[bool] = False  # runs only when told its argument (or the option it stands for)
    options_class: ClassVar[type | None] = None  # frozen dataclass of the method's own settings
    # What the method keeps from one request to the next ("": nothing); ``reset`` forgets it. A server keeps
    # it (later requests profit); a benchmark may reset it per question so results do not depend on order.
    carried_state: ClassVar[str] = ""

    def __init__(self, models: Models, config: DecodeConfig):
        self.models = models
        self.config = config
        self.options = self.parse_options(config.method_options)  # None for methods without settings

    def start(self, prefill: Prefill) -> None:
        """Called once per request after the target's prefill."""

    @abstractmethod
    def draft(self, committed: torch.Tensor) -> DraftTree:  # committed: [length], root last
        """The draft tree for this step, hanging from ``committed[-1]`` (the root)."""

    def readback(self, tree: DraftTree, verdict: StepVerdict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device tensors ``observe`` wants on the host (``Observation.host``): read with the verdict, in the
        step's one synchronisation. ``logits``: ``[num_nodes, vocab]``; ``verdict.path_rows`` finds the accepted
        nodes on the device, for rows along the path."""
        return ()

    def observe(self, observation: Observation) -> None:
        """Called after every verification: commit drafter caches, update online tables."""

    def reset(self) -> None:
        """Forget what earlier requests taught the method (``carried_state``), as if just built.

        Measurements of the hardware (``Models.measurements``) are kept: they describe the device, not the text.
        """

    def drafter_calls(self) -> dict[str, int]:
        """Drafter invocations in the last step, by drafter name."""
        return {}

    @classmethod
    def parse_options(cls, options: Mapping[str, Any], where: str = "") -> Any:
        """The method's settings built from ``options`` (ConfigError naming ``where`` on a bad key or value)."""
        if cls.options_class is None:
            if options:
                prefix = f"{where}: " if where else ""
                raise ConfigError(f"{prefix}method {cls.name!r} takes no options (got {', '.join(map(str, options))})",
                                  "remove them; `treegraft methods` lists the methods that take options")
            return None
        return from_mapping(cls.options_class, options, where or cls.name)

    @classmethod
    def syntax(cls) -> str:
        """How ``--method`` spells it: ``dense``, ``fixed:L[,L...]``, ``treegraft[:POLICY]``."""
        if not cls.argument:
            return cls.name
        return f"{cls.name}:{cls.argument}" if cls.needs_argument else f"{cls.name}[:{cls.argument}]"

    @classmethod
    def option_fields(cls) -> list[OptionField]:
        """The ``-o KEY=VALUE`` settings of the method, with their types and defaults (none without options)."""
        if cls.options_class is None:
            return []
        hints = typing.get_type_hints(cls.options_class)
        return [
            OptionField(f.name, describe_type(hints[f.name]), f.default if f.default is not dataclasses.MISSING else f.default_factory())
            for f in dataclasses.fields(cls.options_class)
        ]

    @classmethod
    def check_options(cls, options: Any) -> None:
        """Checks of the parsed options as a whole that need no model (``check_method`` runs them before loading)."""

    @classmethod
    def options_from_argument(cls, argument: str) -> dict[str, Any]:
        """The method options a ``NAME:ARGUMENT`` method spec stands for (``fixed:1,3``); none by default."""
        raise ConfigError(f"method {cls.name!r} takes no ':{argument}' argument", f"use --method {cls.name}")


METHODS: dict[str, type[Method]] = {}


def register(cls: type[Method]) -> type[Method]:
    METHODS[cls.name] = cls
    return cls


def method_names() -> list[str]:
    return sorted(METHODS)


def bare_method_names(has_drafter: bool) -> list[str]:
    """The methods that run as a bare name with these models: what a bench runs when not told which."""
    return [n for n in method_names() if not METHODS[n].needs_argument and (has_drafter or not METHODS[n].needs_drafter)]


def method_class(spec: str) -> tuple[type[Method], str]:
    """``NAME`` or ``NAME:ARGUMENT`` → (the registered class, ARGUMENT), or a ConfigError naming the methods."""
    name, _, argument = spec.partition(":")
    cls = METHODS.get(name)
    if cls is None:
        raise ConfigError(f"unknown method {spec!r}", f"choose one of: {', '.join(method_names())} (see `treegraft methods`)")
    return cls, argument


def _resolve(config: DecodeConfig, has_drafter: bool) -> tuple[type[Method], DecodeConfig]:
    cls, argument = method_class(config.method)
    if argument:
        options = {**config.method_options, **cls.options_from_argument(argument)}
        config = dataclasses.replace(config, method_options=options)
    if cls.needs_drafter and not has_drafter:
        raise ConfigError(f"method {config.method!r} needs a model drafter", "pass --pair DRAFTER:TARGET")
    return cls, config


def check_method(config: DecodeConfig, has_drafter: bool) -> None:
    """Everything about ``config.method`` that needs no model: its name, argument, options and drafter.

    Commands call it before loading models, so a typo fails in a second instead of after a download.
    """
    cls, config = _resolve(config, has_drafter)
    cls.check_options(cls.parse_options(config.method_options))


def create_method(config: DecodeConfig, models: Models) -> Method:
    """Build the method ``config.method`` names (``NAME`` or ``NAME:ARGUMENT``), or raise a ConfigError."""
    cls, config = _resolve(config, models.drafter is not None)
    return cls(models, config)
