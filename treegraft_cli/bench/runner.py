"""Run contenders side by side in one process: warm-up, then ``ar``, then each method, on the same questions."""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..config import DecodeConfig
from ..engine import Generation
from ..methods import bare_method_names
from ..pipeline import Pipeline, chat_messages
from .contenders import PEERS, build_contender, check_names
from .lossless import AFTER_DIVERGENCE, EXACT, UNCHECKED, TurnCheck, check_turn
from .suites import Question

BASELINE = "ar"

# (description, done, total): what the runner reports as it goes
Progress = Callable[[str, int, int], None]


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


@dataclass
class ContenderRecord:
    """Everything one contender produced on the suite."""

    name: str
    kind: str  # method | peer
    config: DecodeConfig
    questions: list[QuestionRecord] = field(default_factory=list)
    peak_memory_bytes: int = 0


def plan_configs(
    base: DecodeConfig, methods: Sequence[str], method_options: Mapping[str, Mapping[str, Any]] | None = None
) -> list[DecodeConfig]:
    """One config per contender, ``ar`` first; each method gets its own ``method_options``."""
    names = [BASELINE] + [m for m in dict.fromkeys(methods) if m != BASELINE]
    check_names(names)
    options = method_options or {}
    return [replace(base, method=name, method_options=dict(options.get(name, {}))) for name in names]


def default_methods(pipeline: Pipeline, greedy: bool = True) -> list[str]:
    """Every registered method and peer this run can use: drafter methods need a pair, peers run greedy only."""
    methods = bare_method_names(pipeline.drafter is not None)
    peers = [n for n, peer in sorted(PEERS.items()) if greedy and peer.usable(pipeline)]
    return methods + peers


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        for index in range(torch.cuda.device_count()):
            torch.cuda.reset_peak_memory_stats(index)


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA: peak allocated bytes since the last reset, summed over GPUs. CPU: the process's peak RSS so far
    (``getrusage``; it cannot be reset, so on CPU it only grows from one contender to the next)."""
    if device.type == "cuda":
        return sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def run_conversation_turns(pipeline: Pipeline, contender, question: Question) -> list[TurnRecord]:
    """Decode every turn of a question as one conversation; turn k sees turns < k and their answers."""
    answers: list[str] = []
    records = []
    for i in range(len(question.turns)):
        prompt_ids = pipeline.encode_chat(chat_messages(question.turns[: i + 1], answers))
        generation = contender.generate(prompt_ids)
        text = pipeline.decode(generation.output_ids)
        answers.append(text)
        records.append(TurnRecord(prompt_ids, generation, text))
    return records


def check_question(
    pipeline: Pipeline, reference: QuestionRecord, candidate: QuestionRecord, tolerance: float
) -> None:
    """Set each candidate turn's lossless verdict against the reference (greedy only)."""
    for ref, turn in zip(reference.turns, candidate.turns, strict=True):
        if not torch.equal(ref.prompt_ids, turn.prompt_ids):
            turn.check = TurnCheck(AFTER_DIVERGENCE)
            continue
        turn.check = check_turn(pipeline.target.model, turn.prompt_ids, ref.generation.output_ids,
                                turn.generation.output_ids, tolerance)


def run_bench(
    pipeline: Pipeline,
    configs: Sequence[DecodeConfig],
    questions: Sequence[Question],
    tie_tolerance: float,
    warmup_tokens: int = 8,
    progress: Progress | None = None,
) -> list[ContenderRecord]:
    """Warm up every contender, then run each (``ar`` first) over all questions and check losslessness."""
    contenders = [build_contender(pipeline, config) for config in configs]  # fail on bad options before timing
    report = progress or (lambda description, done, total: None)
    total = len(contenders) * (len(questions) + 1)
    done = 0
    warm_prompt = pipeline.encode_chat(chat_messages(questions[0].turns[:1]))
    for config in configs:
        report(f"warm-up {config.method}", done, total)
        build_contender(pipeline, replace(config, max_new_tokens=warmup_tokens)).generate(warm_prompt)
        done += 1
    records = []
    for contender in contenders:
        record = ContenderRecord(contender.name, contender.kind, contender.config)
        reset_peak_memory(pipeline.device)
        for question in questions:
            report(f"{contender.name} · {question.benchmark} #{question.question_id}", done, total)
            record.questions.append(QuestionRecord(question, run_conversation_turns(pipeline, contender, question)))
            done += 1
        record.peak_memory_bytes = peak_memory_bytes(pipeline.device)
        records.append(record)
    report("checking losslessness", done, total)
    reference = records[0]
    for record in records:
        for ref, candidate in zip(reference.questions, record.questions, strict=True):
            if record is reference:
                for turn in candidate.turns:
                    turn.check = TurnCheck(EXACT if record.config.sampling.greedy else UNCHECKED)
            elif record.config.sampling.greedy:
                check_question(pipeline, ref, candidate, tie_tolerance)
    report("done", total, total)
    return records
