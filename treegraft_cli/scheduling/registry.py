"""Call policies by name: ``make_policy("step:1,2", options)``, as ``-o policy=SPEC`` and ``collect --policy`` spell them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from ..errors import ConfigError
from .artifact import load_scheduler
from .options import TreeGraftConfig, parse_layers
from .policies import AllMid, AllSmall, CallPolicy, CostAwareRule, FixedLayers
from .step_rule import StepRule


def _learned(argument: str, options: TreeGraftConfig) -> CallPolicy:
    """``learned`` / ``learned:FILE``: the distilled MLP of ``treegraft distill`` (``scheduler`` option or FILE)."""
    path = argument or options.scheduler
    if not path:
        raise ConfigError("call policy 'learned' needs a scheduler artifact", "pass -o scheduler=FILE (from treegraft distill)")
    return load_scheduler(path).policy(options, str(path))


def _step(argument: str, options: TreeGraftConfig) -> CallPolicy:
    layers = parse_layers(argument) if argument else options.layers
    return StepRule(options.call_budget, options.hit_rate, layers, trim=options.trim)


def _fixed(argument: str, options: TreeGraftConfig) -> CallPolicy:
    layers = parse_layers(argument) if argument else options.layers
    if not layers:  # no layers would silently be all-small
        raise ConfigError("'fixed' needs the tree layers at which to call the strong drafter",
                          "write fixed:1,3 (1-based layers), or add -o layers=1,3")
    return FixedLayers(options.call_budget, layers)


LEARNED = "learned"

# policy name → factory(argument after ':', settings)
POLICY_FACTORIES: Mapping[str, Callable[[str, TreeGraftConfig], CallPolicy]] = MappingProxyType(
    {
        AllSmall.name: lambda argument, options: AllSmall(options.call_budget),
        AllMid.name: lambda argument, options: AllMid(options.call_budget),
        FixedLayers.name: _fixed,
        CostAwareRule.name: lambda argument, options: CostAwareRule(options.call_budget, options.hit_rate),
        LEARNED: _learned,
        "step": _step,
    }
)


def make_policy(spec: str, options: TreeGraftConfig) -> CallPolicy:
    """A policy from its spec: ``all-small``, ``all-mid``, ``fixed`` / ``fixed:1,3``, ``cost-aware``, ``step`` / ``step:1,2,3``, ``learned[:FILE]``."""
    name, _, argument = spec.partition(":")
    factory = POLICY_FACTORIES.get(name)
    if factory is None:
        raise ConfigError(f"unknown call policy {spec!r}", f"choose one of: {', '.join(POLICY_FACTORIES)}")
    return factory(argument, options)
