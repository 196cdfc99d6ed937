"""Bench results: the ``results.json`` schema, Spec-Bench answer files, and atomic writes.

``results.json`` (schema ``treegraft.bench/1``; keys are only ever added, never renamed)::

    schema, created, pair, profile, dtype, device, benchmarks, num_questions, max_new_tokens,
    temperature, tie_tolerance, thinking (the chat template's enable_thinking; null: its default), baseline ("ar"), environment {python, torch, transformers, treegraft, device_name},
    lossless            all contenders lossless (null at temperature > 0: not checked)
    failures            [{method, benchmark, question_id, turn, position, gap}] mismatches, each a failure
    methods: {NAME: {
        kind            "method" (a registered treegraft method) | "peer" (transformers' own)
        config          the DecodeConfig it ran with
        speedup         tokens_per_s / ar's tokens_per_s (same questions, same process)
        tau             mean accepted length per step (accepted draft tokens + bonus; ar: 1)
        tokens_per_s    new tokens / wall seconds, over all turns
        new_tokens, wall_s, steps
        lossless        true | false | null (sampling)
        ties, mismatches, after_divergence   turn counts by verdict (see bench/lossless.py)
        acceptance_by_depth  [a_1, a_2, ...]: share of steps that accepted at least d draft tokens
        drafter_calls_per_step  {drafter: calls / steps}
        syncs_per_step  host-device synchronisations per step outside model forwards (StepStats.syncs; peers: 0)
        time_split      {prefill_s, draft_s, verify_s, host_s} summed over turns, plus host_overhead_s
                        (step time outside any model forward; overlaps draft_s and host_s)
        peak_memory_mb  CUDA peak allocated (reset per contender); CPU: process peak RSS so far
        per_benchmark: {BENCHMARK: {speedup, tau, tokens_per_s, new_tokens, wall_s, steps, lossless,
                                    ties, mismatches, acceptance_by_depth}}
    }}
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
import transformers

from .. import __version__
from ..atomic import atomic_write_text
from ..engine import StepStats
from .lossless import AFTER_DIVERGENCE, MISMATCH, TIE, UNCHECKED
from .runner import BASELINE, ContenderRecord, TurnRecord

SCHEMA = "treegraft.bench/1"


def _steps(turns: Iterable[TurnRecord]) -> list[StepStats]:
    return [step for turn in turns for step in turn.generation.steps]


def acceptance_by_depth(steps: Sequence[StepStats], depth: int) -> list[float]:
    """Share of steps whose accepted path reached depth d (accepted_length > d), d = 1..depth."""
    if not steps:
        return []
    deepest = max(depth, max(s.accepted_length for s in steps) - 1)
    return [sum(s.accepted_length > d for s in steps) / len(steps) for d in range(1, deepest + 1)]


def _aggregate(turns: list[TurnRecord], depth: int, greedy: bool) -> dict[str, Any]:
    steps = _steps(turns)
    new_tokens = sum(t.generation.new_tokens for t in turns)
    wall = sum(t.generation.wall_s for t in turns)
    statuses = [t.check.status for t in turns]
    return {
        "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
        "tau": sum(s.accepted_length for s in steps) / len(steps) if steps else 0.0,
        "new_tokens": new_tokens,
        "wall_s": wall,
        "steps": len(steps),
        "lossless": (MISMATCH not in statuses) if greedy else None,
        "ties": statuses.count(TIE),
        "mismatches": statuses.count(MISMATCH),
        "after_divergence": statuses.count(AFTER_DIVERGENCE),
        "acceptance_by_depth": acceptance_by_depth(steps, depth),
    }


def _config_dict(config) -> dict[str, Any]:
    values = dataclasses.asdict(config)
    values["method_options"] = dict(config.method_options)
    return values


def method_result(record: ContenderRecord, baseline: ContenderRecord) -> dict[str, Any]:
    greedy = record.config.sampling.greedy
    depth = record.config.tree.depth
    turns = [t for q in record.questions for t in q.turns]
    result = {"kind": record.kind, "config": _config_dict(record.config)}
    result.update(_aggregate(turns, depth, greedy))
    base = _aggregate([t for q in baseline.questions for t in q.turns], depth, greedy)
    result["speedup"] = result["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else 0.0
    steps = _steps(turns)
    calls: dict[str, int] = defaultdict(int)
    for step in steps:
        for drafter, n in step.drafter_calls.items():
            calls[drafter] += n
    result["drafter_calls_per_step"] = {k: v / len(steps) for k, v in sorted(calls.items())} if steps else {}
    result["syncs_per_step"] = sum(step.syncs for step in steps) / len(steps) if steps else 0.0
    split = defaultdict(float)
    for turn in turns:
        for key, seconds in turn.generation.time_split().items():
            split[key] += seconds
    result["time_split"] = dict(split)
    result["peak_memory_mb"] = record.peak_memory_bytes / 2**20
    result["per_benchmark"] = {}
    for benchmark in dict.fromkeys(q.question.benchmark for q in record.questions):
        mine = [t for q in record.questions if q.question.benchmark == benchmark for t in q.turns]
        theirs = [t for q in baseline.questions if q.question.benchmark == benchmark for t in q.turns]
        entry = _aggregate(mine, depth, greedy)
        base_tps = _aggregate(theirs, depth, greedy)["tokens_per_s"]
        entry["speedup"] = entry["tokens_per_s"] / base_tps if base_tps else 0.0
        result["per_benchmark"][benchmark] = entry
    return result


def failures(records: Sequence[ContenderRecord]) -> list[dict[str, Any]]:
    return [
        {"method": r.name, "benchmark": q.question.benchmark, "question_id": q.question.question_id, "turn": i,
         "position": t.check.position, "gap": t.check.gap}
        for r in records for q in r.questions for i, t in enumerate(q.turns) if t.check.status == MISMATCH
    ]


def build_results(records: Sequence[ContenderRecord], meta: dict[str, Any]) -> dict[str, Any]:
    """The results.json document; ``meta`` carries pair, profile, dtype, device, tie_tolerance ..."""
    baseline = next(r for r in records if r.name == BASELINE)
    methods = {r.name: method_result(r, baseline) for r in records}
    verdicts = [m["lossless"] for m in methods.values()]
    first = records[0].config
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **meta,
        "benchmarks": list(dict.fromkeys(q.question.benchmark for q in baseline.questions)),
        "num_questions": len(baseline.questions),
        "max_new_tokens": first.max_new_tokens,
        "temperature": first.sampling.temperature,
        "baseline": BASELINE,
        "environment": environment(meta.get("device", "cpu")),
        "lossless": None if None in verdicts else all(verdicts),
        "failures": failures(records),
        "methods": methods,
    }


def environment(device: str) -> dict[str, Any]:
    name = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else platform.processor()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "treegraft": __version__, "device_name": name or platform.machine(), "cpu_count": os.cpu_count()}


def answer_lines(record: ContenderRecord) -> list[dict[str, Any]]:
    """Spec-Bench answer records: one per question, ``choices[0]`` with per-turn lists."""
    lines = []
    for q in record.questions:
        gens = [t.generation for t in q.turns]
        lines.append({
            "question_id": q.question.question_id,
            "benchmark": q.question.benchmark,
            "category": q.question.category,
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


def write_outputs(out_dir: Path, results: dict[str, Any], records: Sequence[ContenderRecord]) -> Path:
    """``DIR/results.json`` and ``DIR/answers/<method>.jsonl``, each written atomically."""
    out_dir = Path(out_dir)
    for record in records:
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in answer_lines(record))
        atomic_write_text(out_dir / "answers" / f"{record.name}.jsonl", text)
    path = out_dir / "results.json"
    atomic_write_text(path, json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    return path


def summary(results: dict[str, Any], path: Path) -> dict[str, Any]:
    """The compact one-line summary bench prints last."""
    return {
        "results": str(path),
        "lossless": results["lossless"],
        "methods": {
            name: {"speedup": round(m["speedup"], 4), "tau": round(m["tau"], 4), "lossless": m["lossless"]}
            for name, m in results["methods"].items()
        },
    }
