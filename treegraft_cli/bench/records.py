"""What a bench run produced: per contender, per question run, per turn."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..config import DecodeConfig
from ..engine import Generation
from .lossless import UNCHECKED, TurnCheck
from .suites import Question


@dataclass
class TurnRecord:
    prompt_ids: torch.Tensor  # [prompt_length]
    generation: Generation
    text: str
    check: TurnCheck = field(default_factory=lambda: TurnCheck(UNCHECKED))


@dataclass
class QuestionRecord:
    question: Question
    turns: list[TurnRecord]
    repeat: int = 0
    resumed: bool = False  # timed by an earlier, interrupted process (restored from the journal)


@dataclass
class ContenderRecord:
    """Everything one contender produced on the suite."""

    name: str
    kind: str  # method | peer
    config: DecodeConfig
    questions: list[QuestionRecord] = field(default_factory=list)
    peak_memory_bytes: int = 0
    carried_state: str = ""  # what it keeps between questions ("": nothing)
