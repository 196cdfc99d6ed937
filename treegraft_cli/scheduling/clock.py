"""Modelled time: a step's time under a cost profile, and a clock a call policy can measure steps with.

A policy that measures its steps' times (the step rule, and a distilled scheduler inside it) reads a clock at
each step. The wall clock makes its decisions follow whatever else the machine is doing: two runs of the same
questions then take different step kinds and verify different trees. A ``ModelledClock`` advances by each decoded
step's ``Outcome.ms`` under a cost profile instead, so the decisions are the ones the profile's hardware would make,
whatever the load: ``collect`` decides on it, and ``treegraft -o clock=PROFILE`` decodes on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..tree import DraftTree
from .cost_profile import CostProfile


class ModelledClock:
    """Seconds of modelled time, advanced by each decoded step's modelled time."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self) -> float:
        return self.seconds

    def advance(self, ms: float) -> None:
        self.seconds += ms / 1000.0


class CalledLayer(Protocol):
    """What an outcome reads of a layer's record (``grafting.builder.LayerRecord``)."""

    called: bool
    forwarded: int  # tree nodes the layer's strong call forwarded


@dataclass(frozen=True)
class Outcome:
    tau: int  # accepted draft tokens + the bonus
    nodes: int  # non-root nodes verified
    calls: int  # strong drafter calls
    weak: int  # weak n-gram layers
    forwarded: tuple[int, ...] = ()  # [calls] tree nodes each strong call forwarded

    @classmethod
    def of_build(cls, tau: int, tree: DraftTree, records: Sequence[CalledLayer]) -> Outcome:
        """The counts of one build of a step: its tree and its layers' records."""
        forwarded = tuple(r.forwarded for r in records if r.called)
        return cls(tau, tree.size, len(forwarded), len(records) - len(forwarded), forwarded)

    def columns(self, action: str) -> dict[str, Any]:
        """The outcome as rollout columns named after ``action`` (``call``, ``skip`` or ``real``)."""
        return {f"tau_{action}": self.tau, f"nodes_{action}": self.nodes, f"calls_{action}": self.calls,
                f"weak_{action}": self.weak, f"forwarded_{action}": list(self.forwarded)}

    def ms(self, costs: CostProfile, width: int, context: int, lag: int) -> float:
        """The step's modelled time under ``costs`` (the root verified with the nodes)."""
        return costs.step_ms(self.nodes + 1, self.calls, self.weak, width, context, lag, self.forwarded)
