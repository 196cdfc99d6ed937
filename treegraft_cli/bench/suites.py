"""Benchmark suites: the six prompt files shipped in the package (``treegraft_cli/bench/data``, or
``$TREEGRAFT_DATA``), any FastChat / Spec-Bench question file, and datasets (``hf:NAME[:split]``, ``bench/hub.py``).

A prompt file holds one JSON object a line, ``{"question_id", "category", "turns": [str, ...]}``.
Multi-turn questions (MT-Bench) are decoded as one conversation: turn 2 sees turn 1 and its answer.
A Spec-Bench ``question.jsonl`` is such a file; its categories are kept as they are.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from ..errors import ConfigError

BENCHMARKS = ("mt_bench", "gsm8k", "humaneval", "alpaca", "cnn_dm", "qa")
QUICK_PROMPTS = 1  # prompts per benchmark in the `quick` suite: the quick start stays under 10 minutes on 2 cores
DATA_ENV = "TREEGRAFT_DATA"
HUB_PREFIX = "hf:"


# Spec-Bench's evaluation/speed.py selects a task by category: MT-Bench's eight categories (writing, math,
# coding, ...) form its task "mt_bench", every other task is one category. Each shipped benchmark gets the
# Spec-Bench task name where one exists, else its own name, so that no two benchmarks share a task.
SPEC_BENCH_CATEGORY = {"gsm8k": "math_reasoning", "cnn_dm": "summarization", "qa": "qa",
                       "humaneval": "humaneval", "alpaca": "alpaca"}


@dataclass(frozen=True)
class Question:
    """One benchmark question: a conversation of user turns."""

    benchmark: str
    question_id: int | str
    category: str
    turns: tuple[str, ...]


def spec_bench_category(question: Question) -> str:
    """The category Spec-Bench's speed.py files this question under (MT-Bench keeps its own eight)."""
    return SPEC_BENCH_CATEGORY.get(question.benchmark) or question.category or question.benchmark


def data_dir() -> Path:
    """``$TREEGRAFT_DATA``, else the six files shipped in the package; a clear error if missing."""
    override = os.environ.get(DATA_ENV)
    path = Path(override).expanduser() if override else Path(str(resources.files(__package__) / "data"))
    if not path.is_dir():
        raise ConfigError(
            f"benchmark data directory {path} does not exist",
            f"set {DATA_ENV}=/path/to/data (the six FastChat .jsonl files), or pass --prompts FILE.jsonl",
        )
    return path


def load_questions(path: Path, benchmark: str | None = None, limit: int | None = None, skip: int = 0) -> list[Question]:
    """Read a FastChat question file: ``limit`` questions after the first ``skip``. Every line needs ``question_id``
    and a non-empty ``turns`` list (all lines are checked, also those not taken, so a bad file fails now rather
    than in a later, longer run)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"prompt file {path} does not exist", "pass an existing FastChat .jsonl question file")
    name = benchmark or path.stem
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"prompt file {path} is not UTF-8 text", "pass a FastChat .jsonl question file") from None
    questions = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not JSON ({error.msg})", "one JSON object a line (FastChat format)") from None
        turns = record.get("turns") if isinstance(record, dict) else None
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise ConfigError(f"{path}:{number}: field 'turns' must be a non-empty list of strings",
                              'write {"question_id": ..., "turns": ["user message", ...]}')
        if "question_id" not in record:
            raise ConfigError(f"{path}:{number}: field 'question_id' is missing", "give every question an id")
        questions.append(Question(name, record["question_id"], str(record.get("category", "")), tuple(turns)))
    if not questions:
        raise ConfigError(f"prompt file {path} holds no questions", "one JSON object a line (FastChat format)")
    return questions[skip:] if limit is None else questions[skip : skip + limit]


class NoQuestionsError(ConfigError):
    """The question files end before the first question asked for."""


def suite_questions(
    suite: str = "quick", prompt_files: Sequence[Path] = (), num_prompts: int | None = None, first_prompt: int = 1
) -> list[Question]:
    """The questions of a suite: ``quick`` (QUICK_PROMPTS per benchmark), ``full`` (all), ``NAME,NAME``, or
    ``hf:NAME[@CONFIG][:SPLIT]`` (a dataset, ``bench/hub.py``).

    ``prompt_files`` replace the suite. From each file (benchmark, dataset) the questions are taken from the
    ``first_prompt``-th on (1-based), ``num_prompts`` of them: questions 5-8 are ``first_prompt=5, num_prompts=4``,
    so a run can keep to questions that tuning and development never saw.
    """
    if num_prompts is not None and num_prompts < 1:
        raise ConfigError(f"--num-prompts {num_prompts} < 1", "pass --num-prompts 1 or more")
    if first_prompt < 1:
        raise ConfigError(f"--first-prompt {first_prompt} < 1", "questions are counted from 1: pass --first-prompt 1 or more")
    skip = first_prompt - 1
    if prompt_files:
        questions = [q for path in prompt_files for q in load_questions(Path(path), limit=num_prompts, skip=skip)]
    elif suite.startswith(HUB_PREFIX):
        from .hub import dataset_questions  # imports `datasets`: only when asked for

        questions = dataset_questions(suite[len(HUB_PREFIX):], num_prompts, skip)
    else:
        names = suite_benchmarks(suite)
        limit = num_prompts if num_prompts is not None else (QUICK_PROMPTS if suite == "quick" else None)
        root = data_dir()
        questions = [q for name in names for q in load_questions(root / f"{name}.jsonl", name, limit, skip)]
    if not questions:
        raise NoQuestionsError(f"no questions from question {first_prompt} on", "pass a smaller --first-prompt")
    return questions


def suite_benchmarks(suite: str) -> list[str]:
    if suite in ("quick", "full"):
        return list(BENCHMARKS)
    names = [n.strip() for n in suite.split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown or not names:
        raise ConfigError(
            f"unknown suite or benchmark {', '.join(unknown) or repr(suite)}",
            f"use quick, full, hf:DATASET[:SPLIT], or a comma list of: {', '.join(BENCHMARKS)}",
        )
    return names
