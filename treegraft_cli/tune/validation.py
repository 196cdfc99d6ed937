"""Validation of a tune study: the best search trials timed again on questions the search never saw.

A search that picks the best of many trials on a few questions also picks the trial that was luckiest on
those questions, so its search speedup is biased upwards. After the trials, the ``top`` best trials by
search speedup are timed on the *validation questions* (by default the next question of every benchmark
file after the search questions), interleaved per question with ``ar`` first, exactly as ``bench`` times
contenders; each trial's validation speedup is its pooled tokens/s over ``ar``'s on those questions.
The trial exported as the profile is the one best on validation.

Results live in the study (user attribute ``validation``): ``{"questions": [...], "max_new_tokens": n,
"speedups": {trial number: speedup}}``. A later run with the same validation questions only times the
trials not validated yet; other validation questions replace the record.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import optuna

from ..bench.contenders import build_contender
from ..bench.suites import Question
from ..config import DecodeConfig
from ..pipeline import Pipeline
from .space import SearchSpace, apply
from .study import VALIDATION_ATTR, recorded_validation, search_ranking, time_questions, validation_speedups

# (what is being timed, done, total)
ValidationProgress = Callable[[str, int, int], None]


def question_names(questions: Sequence[Question]) -> list[str]:
    return [f"{q.benchmark}/{q.question_id}" for q in questions]


def validate_trials(
    pipeline: Pipeline,
    study: optuna.Study,
    space: SearchSpace,
    base: DecodeConfig,  # what the study's trials were applied to
    questions: Sequence[Question],
    top: int,
    progress: ValidationProgress | None = None,
) -> dict[int, float]:
    """Time ``ar`` and the ``top`` best search trials on ``questions``; record and return speedups by trial."""
    record = recorded_validation(study)
    names = question_names(questions)
    same = record.get("questions") == names and record.get("max_new_tokens") == base.max_new_tokens
    known = validation_speedups(study) if same else {}
    todo = [t for t in search_ranking(study)[:top] if t.number not in known]
    if not todo or not questions:
        return known
    ar = build_contender(pipeline, dataclasses.replace(base, method="ar", method_options={}))
    contenders = [("ar", ar)] + [(f"trial {t.number}", build_contender(pipeline, apply(base, space.method, space.resolve(t.params))))
                                 for t in todo]
    tokens = [0] * len(contenders)
    seconds = [0.0] * len(contenders)
    total, done = len(questions) * len(contenders), 0
    for question in questions:  # interleaved: a load change moves ar and the trials alike
        for i, (label, contender) in enumerate(contenders):
            if progress is not None:
                progress(f"validating {label} on {question.benchmark} #{question.question_id}", done, total)
            (timing,) = time_questions(pipeline, contender, [question])
            tokens[i] += timing.tokens
            seconds[i] += timing.seconds
            done += 1
    ar_rate = tokens[0] / seconds[0] if seconds[0] > 0 else 0.0
    for trial, count, spent in zip(todo, tokens[1:], seconds[1:], strict=True):
        known[trial.number] = (count / spent) / ar_rate if spent > 0 and ar_rate > 0 else 0.0
    study.set_user_attr(VALIDATION_ATTR, {"questions": names, "max_new_tokens": base.max_new_tokens,
                                          "speedups": {str(n): v for n, v in sorted(known.items())}})
    return known
