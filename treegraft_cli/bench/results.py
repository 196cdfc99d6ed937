"""Bench results: the ``results.json`` document (schema below) built from the contenders' records.

``results.json`` (schema ``treegraft.bench/1``; keys are only ever added, never renamed)::

    schema, created, pair, profile, dtype, device, benchmarks, num_questions, max_new_tokens,
    temperature, tie_tolerance, thinking (the chat template's enable_thinking; null: its default), baseline ("ar"),
    linear              the linear kernels: "default" | "packed" (``--linear``; models/packed_linear.py)
    repeats             question runs per question (each: ar, then every other contender)
    question_runs       finished question runs (questions × repeats when complete)
    resumed_question_runs  of those, restored from an interrupted earlier process (timed there)
    state_between_questions  "reset" (every contender forgets earlier questions) | "carry"
    bootstrap           {resamples, seed, level}: how the speedup intervals were drawn (bench/stats.py)
    environment         {python, torch, transformers, treegraft, device_name, cpu_count, torch_threads,
                         cpus_available, cpu_native_dtypes (low-precision dtypes the CPU multiplies natively;
                         null: unknown), machine_load: {start, end}: {torch_threads, cpus, load_average,
                         busy: [{pid, name, cores}], free_cores}}
    partial             true only in results.partial.json (an interrupted run), with ``interrupted``
    lossless            all contenders lossless (null at temperature > 0: not checked)
    lossless_basis      how losslessness is established: by comparison with ar (greedy), or by the sampling tests (T > 0)
    failures            [{method, benchmark, question_id, turn, position, gap, distances, ranks, near_best}] mismatches
    ties                the same fields for every turn judged a tie (bench/lossless.py): gap is the target's
                        top-1 minus top-2 logit, distances / ranks are ar's and the method's token's,
                        near_best how many tokens lie within the tie tolerance of the best logit
    methods: {NAME: {
        kind            "method" (a registered treegraft method) | "peer" (transformers' own)
        config          the DecodeConfig it ran with
        carried_state   what it keeps between questions ("" nothing); reset per question unless "carry"
        speedup         pooled tokens/s over ar's pooled tokens/s (same questions, interleaved)
        speedup_ci      [low, high] 95 % bootstrap interval of speedup over questions (null: no data)
        speedup_same_text     speedup over only the turns whose text equals ar's (null: none)
        speedup_same_text_ci  its interval; same_text_turns / turns: how many turns that is, of all
        tau             mean accepted length per step (accepted draft tokens + bonus; ar: 1)
        tokens_per_s    new tokens / wall seconds, over all turns
        new_tokens, wall_s, steps
        lossless        true | false | null (sampling)
        ties, mismatches, after_divergence   turn counts by verdict (see bench/lossless.py)
        acceptance_by_depth  [a_1, a_2, ...]: share of steps that accepted at least d draft tokens
        acceptance_by_origin  {ORIGIN: {verified, accepted, rate}}: per drafter that proposed nodes (model, ngram,
                        adjacency), lists by tree depth 1, 2, ...: its nodes verified, those accepted, and
                        accepted / verified (null where none was verified); peers: {}
        drafter_calls_per_step  {drafter: calls / steps}
        syncs_per_step  host-device synchronisations per step outside model forwards (StepStats.syncs; peers: 0)
        time_split      {prefill_s, draft_s, verify_s, host_s} summed over turns, plus host_overhead_s
                        (step time outside any model forward; overlaps draft_s and host_s)
        peak_memory_mb  CUDA peak allocated (reset per question run, max kept); CPU: process peak RSS so far
        per_benchmark: {BENCHMARK: {speedup, speedup_ci, speedup_same_text, same_text_turns, turns, tau,
                                    tokens_per_s, new_tokens, wall_s, steps, lossless, ties, mismatches,
                                    acceptance_by_depth, acceptance_by_origin, drafter_calls_per_step}}
    }}
"""

from __future__ import annotations

import os
import platform
import time
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import transformers

from .. import __version__
from ..engine import StepStats
from ..tree import ORIGIN_NAMES
from .journal import config_dict
from .lossless import AFTER_DIVERGENCE, MISMATCH, TIE
from .machine import cpu_flags, native_dtypes, usable_cpus
from .records import ContenderRecord, QuestionRecord, TurnRecord
from .runner import BASELINE
from .stats import LEVEL, RESAMPLES, SEED, PerQuestion, bootstrap_interval, pooled_speedup

SCHEMA = "treegraft.bench/1"
LOSSLESS_BY_COMPARISON = "every turn compared with ar's greedy output (bench/lossless.py)"
# Two samplers that are both exact still draw different texts, so at T > 0 comparing texts proves nothing.
LOSSLESS_BY_TESTS = ("not checked by comparing texts at temperature > 0: the output distribution is proven equal to "
                     "the target's by the statistical tests tests/test_sampling_methods.py and tests/test_sampling_lossless.py")

Pairs = Sequence[tuple[QuestionRecord, QuestionRecord]]  # (the method's, ar's) per question run


def _steps(turns: Iterable[TurnRecord]) -> list[StepStats]:
    return [step for turn in turns for step in turn.generation.steps]


def acceptance_by_depth(steps: Sequence[StepStats], depth: int) -> list[float]:
    """Share of steps whose accepted path reached depth d (accepted_length > d), d = 1..depth."""
    if not steps:
        return []
    deepest = max(depth, max(s.accepted_length for s in steps) - 1)
    return [sum(s.accepted_length > d for s in steps) / len(steps) for d in range(1, deepest + 1)]


def acceptance_by_origin(steps: Sequence[StepStats]) -> dict[str, dict[str, list]]:
    """Per drafter that proposed nodes: its verified and accepted nodes by depth (index d - 1 for depth d) and
    their ratio, so a drafter's nodes that fill slots but are rarely accepted show at the depth they sit."""
    verified: dict[int, Counter] = defaultdict(Counter)
    accepted: dict[int, Counter] = defaultdict(Counter)
    for step in steps:
        for origin, depth in zip(step.node_origins, step.node_depths, strict=True):
            verified[origin][depth] += 1
        for node in step.accepted_nodes:
            accepted[step.node_origins[node]][step.node_depths[node]] += 1
    result = {}
    for origin in sorted(verified):
        depths = range(1, max(verified[origin]) + 1)
        counts = [verified[origin][d] for d in depths]
        hits = [accepted[origin][d] for d in depths]
        result[ORIGIN_NAMES.get(origin, str(origin))] = {
            "verified": counts, "accepted": hits, "rate": [h / c if c else None for h, c in zip(hits, counts, strict=True)]}
    return result


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
        "acceptance_by_origin": acceptance_by_origin(steps),
        "drafter_calls_per_step": drafter_calls_per_step(steps),
    }


def drafter_calls_per_step(steps: Sequence[StepStats]) -> dict[str, float]:
    """{drafter: calls / steps} ({} without steps)."""
    calls: dict[str, int] = defaultdict(int)
    for step in steps:
        for drafter, n in step.drafter_calls.items():
            calls[drafter] += n
    return {k: v / len(steps) for k, v in sorted(calls.items())} if steps else {}


def per_question(pairs: Pairs, same_text: bool = False) -> PerQuestion:
    """The method's and ar's sums per question (turns and repeats pooled); ``same_text``: only turns whose
    text equals ar's."""
    sums: dict[tuple[str, str], list[float]] = {}
    for mine, base in pairs:
        row = sums.setdefault((mine.question.benchmark, str(mine.question.question_id)), [0.0, 0.0, 0.0, 0.0])
        for a, b in zip(mine.turns, base.turns, strict=True):
            if same_text and a.text != b.text:
                continue
            for i, value in enumerate((a.generation.new_tokens, a.generation.wall_s,
                                       b.generation.new_tokens, b.generation.wall_s)):
                row[i] += value
    return PerQuestion.of(list(sums.values()))


def speedups(pairs: Pairs) -> dict[str, Any]:
    """speedup with its interval, and the same over the turns whose text equals ar's."""
    everything, same = per_question(pairs), per_question(pairs, same_text=True)
    same_turns = sum(a.text == b.text for mine, base in pairs for a, b in zip(mine.turns, base.turns, strict=True))
    same_speedup = pooled_speedup(same) if same_turns else 0.0
    return {
        "speedup": pooled_speedup(everything),
        "speedup_ci": _rounded(bootstrap_interval(everything)),
        "speedup_same_text": same_speedup or None,
        "speedup_same_text_ci": _rounded(bootstrap_interval(same)) if same_turns else None,
        "same_text_turns": same_turns,
        "turns": sum(len(mine.turns) for mine, _ in pairs),
    }


def _rounded(interval: tuple[float, float] | None) -> list[float] | None:
    return [round(interval[0], 6), round(interval[1], 6)] if interval else None


def method_result(record: ContenderRecord, baseline: ContenderRecord) -> dict[str, Any]:
    greedy = record.config.sampling.greedy
    depth = record.config.tree.depth
    turns = [t for q in record.questions for t in q.turns]
    pairs = list(zip(record.questions, baseline.questions, strict=True))
    result = {"kind": record.kind, "config": config_dict(record.config), "carried_state": record.carried_state}
    result.update(_aggregate(turns, depth, greedy))
    result.update(speedups(pairs))
    steps = _steps(turns)
    result["syncs_per_step"] = sum(step.syncs for step in steps) / len(steps) if steps else 0.0
    split = defaultdict(float)
    for turn in turns:
        for key, seconds in turn.generation.time_split().items():
            split[key] += seconds
    result["time_split"] = dict(split)
    result["peak_memory_mb"] = record.peak_memory_bytes / 2**20
    result["per_benchmark"] = {}
    for benchmark in dict.fromkeys(q.question.benchmark for q in record.questions):
        mine = [(a, b) for a, b in pairs if a.question.benchmark == benchmark]
        entry = _aggregate([t for a, _ in mine for t in a.turns], depth, greedy)
        entry.update(speedups(mine))
        entry.pop("speedup_same_text_ci")
        result["per_benchmark"][benchmark] = entry
    return result


def divergences(records: Sequence[ContenderRecord], status: str) -> list[dict[str, Any]]:
    """Every turn with verdict ``status``: where it diverged from ``ar`` and how far each token was from the best."""
    return [
        {"method": r.name, "benchmark": q.question.benchmark, "question_id": q.question.question_id, "turn": i,
         "repeat": q.repeat, "position": t.check.position, "gap": t.check.gap,
         "distances": list(t.check.distances) if t.check.distances else None,
         "ranks": list(t.check.ranks) if t.check.ranks else None, "near_best": t.check.near_best}
        for r in records for q in r.questions for i, t in enumerate(q.turns) if t.check.status == status
    ]


def build_results(records: Sequence[ContenderRecord], meta: Mapping[str, Any]) -> dict[str, Any]:
    """The results.json document; ``meta`` carries pair, profile, dtype, device, tie_tolerance, repeats,
    state_between_questions, machine_load ..."""
    meta = dict(meta)
    machine_load = meta.pop("machine_load", {})
    baseline = next(r for r in records if r.name == BASELINE)
    methods = {r.name: method_result(r, baseline) for r in records}
    verdicts = [m["lossless"] for m in methods.values()]
    first = records[0].config
    return {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **meta,
        "benchmarks": list(dict.fromkeys(q.question.benchmark for q in baseline.questions)),
        "num_questions": len({(q.question.benchmark, str(q.question.question_id)) for q in baseline.questions}),
        "question_runs": len(baseline.questions),
        "resumed_question_runs": sum(q.resumed for q in baseline.questions),
        "max_new_tokens": first.max_new_tokens,
        "temperature": first.sampling.temperature,
        "baseline": BASELINE,
        "bootstrap": {"resamples": RESAMPLES, "seed": SEED, "level": LEVEL},
        "environment": environment(meta.get("device", "cpu"), machine_load),
        "lossless": None if None in verdicts else all(verdicts),
        "lossless_basis": LOSSLESS_BY_COMPARISON if first.sampling.greedy else LOSSLESS_BY_TESTS,
        "failures": divergences(records, MISMATCH),
        "ties": divergences(records, TIE),
        "methods": methods,
    }


def environment(device: str, machine_load: Mapping[str, Any] | None = None) -> dict[str, Any]:
    name = torch.cuda.get_device_name(0) if device != "cpu" and torch.cuda.is_available() else platform.processor()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "treegraft": __version__, "device_name": name or platform.machine(), "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "cpus_available": usable_cpus(),
            "cpu_native_dtypes": native_dtypes(cpu_flags()),
            "machine_load": dict(machine_load or {})}


def summary(results: dict[str, Any], path: Any) -> dict[str, Any]:
    """The compact one-line summary bench prints last."""
    return {
        "results": str(path),
        "lossless": results["lossless"],
        "methods": {
            name: {"speedup": round(m["speedup"], 4), "speedup_ci": m.get("speedup_ci"), "tau": round(m["tau"], 4),
                   "lossless": m["lossless"]}
            for name, m in results["methods"].items()
        },
    }
