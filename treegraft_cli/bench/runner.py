"""Run contenders side by side in one process, interleaved per question so machine drift hits them alike.

Order of work::

    warm-up: every contender once on a short decode (ar twice: its second run times the estimate)
    for repeat in 1..R:
        for question in the suite:
            ar, then every other contender, each on the whole question (all its turns)
            check every contender's turns against ar's (greedy)      -> one finished "question run"

A load change during the run (another process, a thermal step) then moves ``ar`` and the methods on the
same questions together instead of moving one contender's ratio. With ``reset_per_question`` every
contender forgets what earlier questions taught it (``reset()``) before each question, so its results do
not depend on the order of the questions; otherwise state is carried as a server would carry it.

A question run is the unit of progress and of resumption: finished runs are appended to the journal
(``bench/journal.py``) as they finish, a KeyboardInterrupt stops the bench between or inside one (the
unfinished run is dropped whole, so ``ar`` and the methods of a question are always timed together), and
a rerun restores the finished runs from the journal and does the rest.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..config import DecodeConfig
from ..engine import Generation
from ..methods import bare_method_names
from ..pipeline import Pipeline, chat_messages
from .contenders import PEERS, PairShape, build_contender, check_config, check_names
from .journal import Journal
from .lossless import AFTER_DIVERGENCE, EXACT, UNCHECKED, TurnCheck, check_turn
from .records import ContenderRecord, QuestionRecord, TurnRecord
from .suites import Question

BASELINE = "ar"
# A real drafter/target pair that fits a laptop: the quick suite with the default methods takes minutes on
# 2 CPU cores, with acceptance high enough to show what tree methods do (a self-drafter reaches τ ≈ 1.05–1.5).
DEFAULT_BENCH_PAIR = "qwen2.5-coder-0.5b:qwen2.5-coder-1.5b"
PAPER_METHODS = ("graft", "treegraft")  # the default set: the two papers' methods ...
DEFAULT_PEER = "hf-assisted"  # ... and the transformers peer that uses the pair's drafter

# (description, done, total): what the runner reports as it goes
Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class BenchPlan:
    """What a bench runs: contenders (``ar`` first), questions, repeats, and the state rule."""

    configs: tuple[DecodeConfig, ...]
    questions: tuple[Question, ...]
    tie_tolerance: float
    repeats: int = 1
    reset_per_question: bool = True
    warmup_tokens: int = 8

    @property
    def question_runs(self) -> int:
        return self.repeats * len(self.questions)


@dataclass(frozen=True)
class Estimate:
    """Seconds the timed run should take, from the warm-up (answers that stop early make it shorter)."""

    seconds: float
    per_contender: Mapping[str, float]


@dataclass(frozen=True)
class Interruption:
    """Where a KeyboardInterrupt stopped the bench."""

    question: Question | None  # the question run cut short (None: stopped between runs)
    repeat: int
    finished: tuple[str, ...]  # contenders that had finished that question (their timings are dropped)
    not_started: int  # question runs never started


@dataclass
class BenchRun:
    records: list[ContenderRecord]
    done: int  # finished question runs, resumed ones included
    total: int
    resumed: int = 0
    interrupted: Interruption | None = None


def plan_configs(
    base: DecodeConfig, methods: Sequence[str], method_options: Mapping[str, Mapping[str, Any]] | None = None
) -> list[DecodeConfig]:
    """One config per contender, ``ar`` first; each gets the ``method_options`` of its base name (``fixed`` for
    ``fixed:1,3``), then those of its full name."""
    names = [BASELINE] + [m for m in dict.fromkeys(methods) if m != BASELINE]
    check_names(names)
    options = method_options or {}

    def own(name: str) -> dict[str, Any]:
        base_name = name.partition(":")[0]
        return {**options.get(base_name, {}), **(options.get(name, {}) if name != base_name else {})}

    return [replace(base, method=name, method_options=own(name)) for name in names]


def check_plan(configs: Sequence[DecodeConfig], shape: PairShape) -> None:
    """Fail on any contender that cannot run with this pair, before a model loads."""
    for config in configs:
        check_config(config, shape)


def default_methods(shape: PairShape, greedy: bool = True, everything: bool = False) -> list[str]:
    """The contenders bench runs when ``--methods`` is not given.

    With a model drafter: the two papers' methods and the transformers peer using the same drafter (a
    first run that shows what the toolkit is for, in minutes). ``everything`` (``--methods all``), or a
    pair without a drafter: every registered method and peer the run can use.
    """
    usable = bare_method_names(shape.has_drafter)
    peers = [n for n, peer in sorted(PEERS.items()) if greedy and (shape.lm_drafter or not peer.needs_drafter)]
    if everything or not shape.has_drafter:
        return usable + peers
    return [m for m in PAPER_METHODS if m in usable] + [p for p in (DEFAULT_PEER,) if p in peers]


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


def check_group(pipeline: Pipeline, group: Sequence[tuple[Any, QuestionRecord]], tolerance: float) -> None:
    """Lossless verdicts of one question run: ``ar`` (first) is exact, the rest are checked against it."""
    (_, reference), *others = group
    greedy = group[0][0].config.sampling.greedy
    for turn in reference.turns:
        turn.check = TurnCheck(EXACT if greedy else UNCHECKED)
    for contender, record in others:
        if contender.config.sampling.greedy:
            check_question(pipeline, reference, record, tolerance)


class Bench:
    """One bench run: ``warm_up()`` (returns the time estimate), then ``run()``."""

    def __init__(self, pipeline: Pipeline, plan: BenchPlan, journal: Journal | None = None,
                 build: Callable[[Pipeline, DecodeConfig], Any] | None = None):
        self.pipeline = pipeline
        self.plan = plan
        self.journal = journal
        self.build = build or build_contender
        self.contenders = [self.build(pipeline, config) for config in plan.configs]  # bad options fail before timing

    def warm_up(self, progress: Progress | None = None) -> Estimate:
        """Decode a few tokens with every contender (one-time costs paid outside the timed run)."""
        report = progress or (lambda description, done, total: None)
        warm_prompt = self.pipeline.encode_chat(chat_messages(self.plan.questions[0].turns[:1]))
        timings: dict[str, Generation] = {}
        for i, config in enumerate(self.plan.configs):
            report(f"warm-up {config.method}", i, len(self.plan.configs))
            warm = self.build(self.pipeline, replace(config, max_new_tokens=self.plan.warmup_tokens))
            timings[config.method] = warm.generate(warm_prompt)
            if config.method == BASELINE:
                timings[config.method] = warm.generate(warm_prompt)  # the first run paid the one-time costs
        return self._estimate(timings)

    def _estimate(self, timings: Mapping[str, Generation]) -> Estimate:
        """Per turn: the prompt at ar's prefill rate plus max_new_tokens at the contender's warm-up decode rate."""
        base = timings[BASELINE]
        prefill_per_token = base.prefill_s / max(1, base.prompt_length)

        def per_token(g: Generation) -> float:
            return (g.wall_s - g.prefill_s) / (g.new_tokens - 1) if g.new_tokens > 1 else 0.0

        answer = self.plan.configs[0].max_new_tokens  # an earlier turn's answer, at its longest
        prompt_tokens = [
            self.pipeline.encode_chat(chat_messages(q.turns[: k + 1], [""] * k)).numel() + k * answer
            for q in self.plan.questions for k in range(len(q.turns))
        ]
        per_contender = {}
        for config in self.plan.configs:
            decode = per_token(timings[config.method]) or per_token(base)
            turns = sum(p * prefill_per_token + (config.max_new_tokens - 1) * decode for p in prompt_tokens)
            per_contender[config.method] = self.plan.repeats * turns
        return Estimate(sum(per_contender.values()), per_contender)

    def run(self, progress: Progress | None = None) -> BenchRun:
        """Every question run, interleaved; stops cleanly on KeyboardInterrupt (``BenchRun.interrupted``)."""
        report = progress or (lambda description, done, total: None)
        records = [ContenderRecord(c.name, c.kind, c.config, carried_state=getattr(c, "carried_state", ""))
                   for c in self.contenders]
        run = BenchRun(records, 0, self.plan.question_runs)
        total_units = self.plan.question_runs * len(self.contenders)
        current: tuple[Question | None, int] = (None, 0)
        finished: list[str] = []  # contenders done with the current question run
        try:
            for repeat in range(self.plan.repeats):
                for question in self.plan.questions:
                    current, finished = (question, repeat), []
                    if self._restore(repeat, question, records):
                        run.done, run.resumed = run.done + 1, run.resumed + 1
                        continue
                    group = []
                    for contender, record in zip(self.contenders, records, strict=True):
                        units = run.done * len(self.contenders) + len(finished)
                        report(self._describe(contender.name, question, repeat), units, total_units)
                        group.append((contender, self._unit(contender, record, question, repeat)))
                        finished.append(contender.name)
                    check_group(self.pipeline, group, self.plan.tie_tolerance)
                    self._keep(group, records, repeat, question)
                    run.done, current = run.done + 1, (None, repeat)
        except KeyboardInterrupt:
            question, repeat = current
            not_started = run.total - run.done - (question is not None)
            run.interrupted = Interruption(question, repeat, tuple(finished) if question else (), not_started)
            return run
        report("done", total_units, total_units)
        return run

    def _keep(self, group: Sequence[tuple[Any, QuestionRecord]], records: list[ContenderRecord], repeat: int,
              question: Question) -> None:
        """A finished question run: into the journal first (durable), then into the records."""
        if self.journal is not None:
            self.journal.append(repeat, question, [(c.config, r) for c, r in group])
        for (_, question_record), record in zip(group, records, strict=True):
            record.questions.append(question_record)

    def _unit(self, contender, record: ContenderRecord, question: Question, repeat: int) -> QuestionRecord:
        """One contender on one question: reset if asked, decode every turn, track peak memory."""
        device = self.pipeline.device
        if self.plan.reset_per_question:
            contender.reset()
        reset_peak_memory(device)
        turns = run_conversation_turns(self.pipeline, contender, question)
        record.peak_memory_bytes = max(record.peak_memory_bytes, peak_memory_bytes(device))
        return QuestionRecord(question, turns, repeat)

    def _restore(self, repeat: int, question: Question, records: list[ContenderRecord]) -> bool:
        """Append a question run finished by an earlier process, when the journal holds it for every contender."""
        if self.journal is None:
            return False
        found = self.journal.finished(repeat, question, self.plan.configs)
        if found is None:
            return False
        for record, turns in zip(records, found, strict=True):
            record.questions.append(QuestionRecord(question, self._with_prompts(question, turns), repeat, True))
        return True

    def _with_prompts(self, question: Question, turns: list[TurnRecord]) -> list[TurnRecord]:
        """Journal turns carry no prompt ids: they follow from the question and the earlier answers."""
        answers: list[str] = []
        for i, turn in enumerate(turns):
            turn.prompt_ids = self.pipeline.encode_chat(chat_messages(question.turns[: i + 1], answers))
            answers.append(turn.text)
        return turns

    def _describe(self, name: str, question: Question, repeat: int) -> str:
        where = f"{name} · {question.benchmark} #{question.question_id}"
        return where + (f" · repeat {repeat + 1}/{self.plan.repeats}" if self.plan.repeats > 1 else "")


def run_bench(
    pipeline: Pipeline,
    configs: Sequence[DecodeConfig],
    questions: Sequence[Question],
    tie_tolerance: float,
    warmup_tokens: int = 8,
    progress: Progress | None = None,
    repeats: int = 1,
    reset_per_question: bool = True,
    journal: Journal | None = None,
    build: Callable[[Pipeline, DecodeConfig], Any] | None = None,
) -> BenchRun:
    """Warm up, then every question run interleaved (see the module docstring)."""
    plan = BenchPlan(tuple(configs), tuple(questions), tie_tolerance, repeats, reset_per_question, warmup_tokens)
    bench = Bench(pipeline, plan, journal, build)
    bench.warm_up(progress)
    return bench.run(progress)


__all__ = ["BASELINE", "DEFAULT_BENCH_PAIR", "Bench", "BenchPlan", "BenchRun", "ContenderRecord", "Estimate", "Interruption",
           "QuestionRecord", "TurnRecord", "check_plan", "default_methods", "plan_configs", "run_bench"]
