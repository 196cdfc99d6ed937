"""TreeGraftConfig: TreeGraft's settings (its layer loop's and its call policy's), built from
``DecodeConfig.method_options``; the tree builder (``grafting``) and the policies read them."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError


def parse_layers(value) -> tuple[int, ...]:
    """``"1,3"``, ``3`` or ``[1, 3]`` → ``(1, 3)``."""
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        parts = [part.strip() for part in value.split(",") if part.strip()]
        try:
            return tuple(int(part) for part in parts)
        except ValueError as error:
            raise ConfigError(f"bad layer list {value!r}", "give layers as 1,3 (1-based tree layers)") from error
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class TreeGraftConfig:
    """Settings of the TreeGraft layer loop (tree shape K, D, N comes from ``TreeConfig``).

    - policy: the call policy ("" = the method's own): all-small | all-mid | fixed:1,3 | cost-aware |
      step[:1,2,3] | learned[:FILE].
    - layers: the called layers of ``fixed``, and of ``step``'s strong steps (default 1..D−1).
    - call_budget: strong calls per step at most.
    - max_n: longest n-gram suffix matched (it shrinks by one per layer, down to 1).
    - min_n: shortest n-gram suffix whose matches give continuations (at most the layer's longest). A parent's K
      continuations come from its longest matches first; with 1, matches of its last token alone fill the rest.
      Such a continuation is whatever once followed that token somewhere, rarely what follows here; where every
      verified node costs time (a CPU) the fills cost more verification than they return (README, TreeGraft),
      hence 2. ``ngram`` (one chain) still falls back to 1, as prompt lookup does.
    - top_w / fallback_penalty: the target log-prob cache width and the penalty below its W-th entry.
    - lookback: depths (counted back from the layer's parent depth) in which a strong call may
      reselect grafting positions.
    - max_depth: no node deeper (n-gram chains run ahead of the layer loop).
    - pool: unforwarded leaves the strong call forwards as grafting candidates once the tree holds n-gram
      chains (0: 2·K); before that K are all a call can pick (``LayerLoop.pool_at``).
    - hit_rate: the rules' prior on the share of a position's probability mass the strong drafter's
      top-K children capture.
    - verify_ms / strong_ms: measured costs (0: measure at warm-up when the policy needs them).
    - trim: the step rule verifies only the nodes whose calibrated reach pays for their share of the
      verification (``StepRule.trim``); false: every node of the cut tree.
    - chain_length: tokens per chain of the ``ngram`` baseline.
    - device_layers: strong layers the policy calls from layer 1 on whatever the tree holds (``all-mid``,
      ``fixed:1,2``) run on the strong drafter's device and are read back once (``grafting.strong_run``); false:
      each strong layer reads its lookup back.
    - look_ahead: a policy that calls the strong drafter alone at layer 1 of every step (``fixed:1,3``) makes that
      call before the step before it is read, over the tokens that step commits padded to its depth, and reads its
      answer with that step's verdict (``grafting.builder``): one read a step fewer for a forward of a few more rows.
    - min_margin: a distilled scheduler calls only where its predicted margin over not calling exceeds this
      many tokens (0: wherever it is positive); a margin for the value system's error.
    - clock: a cost profile (``treegraft profile``'s YAML) on whose modelled step times the call policy measures its
      steps instead of the wall clock ("" = the wall clock), as ``collect`` decides (``scheduling.clock``): decisions,
      trees and accepted lengths that repeat from run to run whatever else the machine is doing, at the price of
      deciding from the profile's times rather than this run's.
    - scheduler: a distilled scheduler artifact (``treegraft distill``); with no ``policy`` given,
      ``treegraft`` then decides with it (policy ``learned``).
    """

    policy: str = ""
    layers: tuple[int, ...] = ()
    call_budget: int = 5
    max_n: int = 5
    min_n: int = 2
    top_w: int = 10
    fallback_penalty: float = 5.0
    lookback: int = 5
    max_depth: int = 10
    pool: int = 0
    hit_rate: float = 0.8
    verify_ms: float = 0.0
    strong_ms: float = 0.0
    trim: bool = True
    chain_length: int = 10
    scheduler: str = ""
    min_margin: float = 0.0
    device_layers: bool = True
    look_ahead: bool = True
    clock: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", parse_layers(self.layers))
        checks = [
            (self.call_budget >= 0, "call_budget must be >= 0"),
            (self.max_n >= 1, "max_n must be >= 1"),
            (1 <= self.min_n <= self.max_n, "min_n must be in 1..max_n"),
            (self.top_w >= 1, "top_w must be >= 1"),
            # a score is a log-prob: no node may score above its parent (the cut to the budget relies on it)
            (self.fallback_penalty >= 0, "fallback_penalty must be >= 0"),
            (self.lookback >= 1, "lookback must be >= 1"),
            (self.max_depth >= 1, "max_depth must be >= 1"),
            (self.pool >= 0, "pool must be >= 0"),
            (0 < self.hit_rate <= 1, "hit_rate must be in (0, 1]"),
            (self.verify_ms >= 0 and self.strong_ms >= 0, "costs must be >= 0"),
            (self.chain_length >= 1, "chain_length must be >= 1"),
            (all(layer >= 1 for layer in self.layers), "layers are 1-based"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message, "see TreeGraftConfig in treegraft_cli/scheduling/options.py")
