"""The bench's resume journal: ``DIR/resume.jsonl``, one JSON line per finished question run.

The first line is a header with the run's *fingerprint* (pair, dtype, device, tie tolerance, state rule,
treegraft version): a journal written under another fingerprint is *stale* and replaced at the first new
question run. Every other line holds one question run (a question at one repeat, every contender):
per contender its config and, per turn, the answer text, the output ids, the timings, the per-step
statistics (column lists) and the lossless verdict. Prompt ids are not stored; they follow from the
question and the earlier answers. Lines are appended and flushed to disk as each run finishes, so even
a killed process keeps what it finished; a torn last line is skipped when read.

A rerun restores a question run only when the journal holds it for every contender with the same config
(so ``ar`` and the methods of one question were timed together), and the bench removes the journal once
its ``results.json`` is written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..config import DecodeConfig
from ..engine import Generation, StepStats
from .lossless import TurnCheck
from .records import QuestionRecord, TurnRecord
from .suites import Question

JOURNAL_NAME = "resume.jsonl"
FORMAT = "treegraft.bench.resume/1"
STEP_FIELDS = ("accepted_length", "nodes_verified", "draft_s", "verify_s", "host_s", "drafter_forward_s")
# step fields an older journal may lack: they read back with StepStats' defaults
OPTIONAL_STEP_FIELDS = ("syncs", "node_origins", "node_depths", "accepted_nodes")


def config_dict(config: DecodeConfig) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    values["method_options"] = dict(config.method_options)
    return values


def config_key(config: DecodeConfig) -> str:
    return json.dumps(config_dict(config), sort_keys=True, default=str)


def _plain(value: Any) -> Any:
    """``value`` as it reads back from JSON (tuples become lists)."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def _question_key(repeat: int, question: Question) -> tuple[int, str, str, str]:
    digest = hashlib.sha256(json.dumps(list(question.turns)).encode()).hexdigest()[:16]
    return repeat, question.benchmark, str(question.question_id), digest


def turn_to_json(turn: TurnRecord) -> dict[str, Any]:
    g = turn.generation
    steps: dict[str, Any] = {name: [getattr(s, name) for s in g.steps] for name in STEP_FIELDS + OPTIONAL_STEP_FIELDS}
    drafters = sorted({d for s in g.steps for d in s.drafter_calls})
    steps["drafter_calls"] = {d: [s.drafter_calls.get(d, 0) for s in g.steps] for d in drafters}
    check = dataclasses.asdict(turn.check)
    return {"text": turn.text, "output_ids": g.output_ids, "prompt_length": g.prompt_length,
            "prefill_s": g.prefill_s, "wall_s": g.wall_s, "steps": steps, "check": check}


def _step_value(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def turn_from_json(data: Mapping[str, Any]) -> TurnRecord:
    steps = data["steps"]
    calls = steps["drafter_calls"]
    count = len(steps["accepted_length"])
    generation = Generation(
        prompt_length=data["prompt_length"], output_ids=list(data["output_ids"]),
        prefill_s=data["prefill_s"], wall_s=data["wall_s"],
        steps=[StepStats(**{name: steps[name][i] for name in STEP_FIELDS},
                         **{name: _step_value(steps[name][i]) for name in OPTIONAL_STEP_FIELDS if name in steps},
                         drafter_calls={d: calls[d][i] for d in calls if calls[d][i]}) for i in range(count)],
    )
    check = dict(data["check"])
    for key in ("distances", "ranks"):
        check[key] = tuple(check[key]) if check.get(key) is not None else None
    return TurnRecord(prompt_ids=None, generation=generation, text=data["text"], check=TurnCheck(**check))


class Journal:
    """Finished question runs of one bench output directory (see the module docstring)."""

    def __init__(self, path: Path, fingerprint: Mapping[str, Any]):
        self.path = Path(path)
        self.fingerprint = _plain(dict(fingerprint))
        self.runs: dict[tuple[int, str, str, str], dict[str, Any]] = {}
        self.stale = False  # the file held another run's work: it is replaced at the first append
        self.skipped_lines = 0  # unreadable lines (a torn write)
        self._header_written = False
        self._torn_tail = False  # the file ends inside a line: the next append starts a new one
        self._load()

    def _load(self) -> None:
        if not self.path.is_file():
            return
        text = self.path.read_text(encoding="utf-8")
        lines = text.splitlines()
        self._torn_tail = bool(text) and not text.endswith("\n")
        header = self._parse(lines[0]) if lines else None
        if not header or header.get("format") != FORMAT or header.get("fingerprint") != self.fingerprint:
            self.stale = bool(lines)
            return
        self._header_written = True
        for line in lines[1:]:
            entry = self._parse(line)
            if entry is None:
                continue
            key = (entry["repeat"], entry["benchmark"], entry["question_id"], entry["digest"])
            self.runs[key] = entry["contenders"]

    def _parse(self, line: str) -> dict[str, Any] | None:
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            self.skipped_lines += 1
            return None
        return value if isinstance(value, dict) else None

    def finished(self, repeat: int, question: Question, configs: Sequence[DecodeConfig]) -> list[list[TurnRecord]] | None:
        """Per contender (in ``configs`` order) the turns of this question run, if every one finished it."""
        entry = self.runs.get(_question_key(repeat, question))
        if entry is None:
            return None
        found = []
        for config in configs:
            saved = entry.get(config.method)
            if saved is None or saved["config"] != config_key(config):
                return None
            found.append([turn_from_json(t) for t in saved["turns"]])
        return found

    def append(self, repeat: int, question: Question, group: Sequence[tuple[DecodeConfig, QuestionRecord]]) -> None:
        """Record one finished question run (every contender), durably."""
        if not self._header_written:
            atomic_write_text(self.path, json.dumps({"format": FORMAT, "fingerprint": self.fingerprint}) + "\n")
            self._header_written, self.stale, self._torn_tail = True, False, False
        run, benchmark, question_id, digest = _question_key(repeat, question)
        contenders = {config.method: {"config": config_key(config), "turns": [turn_to_json(t) for t in record.turns]}
                      for config, record in group}
        line = {"repeat": run, "benchmark": benchmark, "question_id": question_id, "digest": digest,
                "contenders": contenders}
        with self.path.open("a", encoding="utf-8") as stream:
            stream.write(("\n" if self._torn_tail else "") + json.dumps(line, ensure_ascii=False) + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        self._torn_tail = False
        self.runs[(run, benchmark, question_id, digest)] = contenders

    def discard(self) -> None:
        """Forget the journal (the run it served is complete)."""
        self.path.unlink(missing_ok=True)
        self.runs.clear()
