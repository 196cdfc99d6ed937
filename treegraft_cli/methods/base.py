"""The interface every decoding method implements, and the registry that names them.

A method is a tree builder: the engine asks it for a draft tree each step and tells it what the
target decided. Methods register themselves by name; nothing else branches on method names.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ..config import DecodeConfig, from_mapping
from ..errors import ConfigError
from ..lm import CausalLM
from ..tree import DraftTree
from ..verify import Verdict


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
    verdict: Verdict  # batch 1
    logits: torch.Tensor  # [num_nodes, vocab] target logits at every tree node
    committed: torch.Tensor  # [length] all committed tokens after this step, new root last
    num_accepted: int
    new_tokens: list[int]  # the tokens this step committed: the accepted ones, then the bonus
    accepted_nodes: list[int]  # their node indices (root excluded): ``path`` on the host
    host: tuple[torch.Tensor, ...] = ()  # host copies of what ``Method.readback`` asked for; () when not read

    @property
    def path(self) -> torch.Tensor:
        """Accepted node indices, root excluded: ``[num_accepted]``."""
        return self.verdict.path[0, 1 : self.num_accepted + 1]


@dataclass(frozen=True)
class Models:
    """The models a method may use: the target and, for model-drafting methods, the drafter."""

    target: CausalLM
    drafter: CausalLM | None = None
    vocab_size: int = 0
    measurements: dict[Any, Any] = field(default_factory=dict)  # methods' measurements of these models, by key


class Method(ABC):
    """Base tree builder. Subclasses set ``name`` and override ``draft``; the rest is optional."""

    name: ClassVar[str] = ""
    needs_drafter: ClassVar[bool] = False
    description: ClassVar[str] = ""
    options_class: ClassVar[type | None] = None  # frozen dataclass of the method's own settings

    def __init__(self, models: Models, config: DecodeConfig):
        self.models = models
        self.config = config
        self.options = self.parse_options(config.method_options)  # None for methods without settings

    def start(self, prefill: Prefill) -> None:
        """Called once per request after the target's prefill."""

    @abstractmethod
    def draft(self, committed: torch.Tensor) -> DraftTree:  # committed: [length], root last
        """The draft tree for this step, hanging from ``committed[-1]`` (the root)."""

    def readback(self, tree: DraftTree, verdict: Verdict, logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Device tensors ``observe`` wants on the host (``Observation.host``): read with the verdict, in the
        step's one synchronisation. ``logits``: ``[num_nodes, vocab]``."""
        return ()

    def observe(self, observation: Observation) -> None:
        """Called after every verification: commit drafter caches, update online tables."""

    def drafter_calls(self) -> dict[str, int]:
        """Drafter invocations in the last step, by drafter name."""
        return {}

    @classmethod
    def parse_options(cls, options: Mapping[str, Any], where: str = "") -> Any:
        """The method's settings built from ``options`` (ConfigError naming ``where`` on a bad key or value)."""
        if cls.options_class is None:
            if options:
                raise ConfigError(f"{where or cls.name}: method {cls.name!r} takes no options", "remove them")
            return None
        return from_mapping(cls.options_class, options, where or f"{cls.name} options")

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


def create_method(config: DecodeConfig, models: Models) -> Method:
    """Build the method ``config.method`` names (``NAME`` or ``NAME:ARGUMENT``), or raise a ConfigError."""
    name, _, argument = config.method.partition(":")
    cls = METHODS.get(name)
    if cls is None:
        raise ConfigError(f"unknown method {config.method!r}", f"choose one of: {', '.join(method_names())}")
    if argument:
        options = {**config.method_options, **cls.options_from_argument(argument)}
        config = dataclasses.replace(config, method_options=options)
    if cls.needs_drafter and models.drafter is None:
        raise ConfigError(
            f"method {config.method!r} needs a model drafter", "pass --pair DRAFTER:TARGET"
        )
    return cls(models, config)

