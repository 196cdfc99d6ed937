"""Bench output files: ``results.json``, Spec-Bench answer files, ``results.partial.json``; all written atomically.

Answers (``DIR/answers/<method>.jsonl``, repeats after the first in ``DIR/answers/repeat-R/``, as Spec-Bench
keeps one directory per run) hold one line per question in Spec-Bench / FastChat answer format:
``question_id``, ``category``, ``answer_id``, ``model_id``, ``choices[0]`` with per-turn ``turns``,
``new_tokens``, ``wall_time``, the flat ``accept_lengths`` list, plus ``decoding_steps`` and ``lossless``.
So that Spec-Bench's ``evaluation/speed.py`` keeps the six benchmarks apart: ``question_id`` is
``BENCHMARK/ID`` (unique across files; the file's own id is in ``source_question_id``) and ``category``
is the Spec-Bench task name (``suites.spec_bench_category``; the file's own in ``source_category``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from .lossless import UNCHECKED
from .records import ContenderRecord
from .suites import spec_bench_category

RESULTS_NAME = "results.json"
PARTIAL_NAME = "results.partial.json"


def answer_lines(record: ContenderRecord, repeat: int = 0) -> list[dict[str, Any]]:
    """Spec-Bench answer records of one repeat: one per question, ``choices[0]`` with per-turn lists."""
    lines = []
    for q in record.questions:
        if q.repeat != repeat:
            continue
        gens = [t.generation for t in q.turns]
        lines.append({
            "question_id": f"{q.question.benchmark}/{q.question.question_id}",
            "source_question_id": q.question.question_id,
            "benchmark": q.question.benchmark,
            "category": spec_bench_category(q.question),
            "source_category": q.question.category,
            "answer_id": uuid.uuid4().hex,
            "model_id": record.name,
            "choices": [{
                "index": 0,
                "turns": [t.text for t in q.turns],
                "decoding_steps": [len(g.steps) for g in gens],
                "new_tokens": [g.new_tokens for g in gens],
                "wall_time": [g.wall_s for g in gens],
                "accept_lengths": [s.accepted_length for g in gens for s in g.steps],
                "lossless": [t.check.status for t in q.turns if t.check.status != UNCHECKED],
            }],
            "tstamp": time.time(),
        })
    return lines


def answers_dir(out_dir: Path, repeat: int) -> Path:
    return Path(out_dir) / "answers" / ("" if repeat == 0 else f"repeat-{repeat + 1}")


def write_outputs(out_dir: Path, results: Mapping[str, Any], records: Sequence[ContenderRecord]) -> Path:
    """``DIR/results.json`` and the answer files, each written atomically; a stale partial file is removed."""
    out_dir = Path(out_dir)
    repeats = sorted({q.repeat for r in records for q in r.questions})
    for record in records:
        for repeat in repeats:
            text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in answer_lines(record, repeat))
            atomic_write_text(answers_dir(out_dir, repeat) / f"{record.name}.jsonl", text)
    path = out_dir / RESULTS_NAME
    atomic_write_text(path, json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    (out_dir / PARTIAL_NAME).unlink(missing_ok=True)
    return path


def write_partial(out_dir: Path, document: Mapping[str, Any]) -> Path:
    """``DIR/results.partial.json``: what an interrupted run finished, never under the name results.json."""
    path = Path(out_dir) / PARTIAL_NAME
    atomic_write_text(path, json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    return path
