"""`treegraft bench`: methods and transformers peers side by side; results.json, answers, plots, CI gate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import __version__
from ..atomic import ensure_writable_dir
from ..bench import (
    SCHEMA,
    Bench,
    BenchPlan,
    PairShape,
    build_results,
    check_against,
    check_plan,
    default_methods,
    load_baseline,
    plan_configs,
    suite_questions,
    summary,
    write_outputs,
    write_partial,
)
from ..bench.journal import JOURNAL_NAME, Journal
from ..bench.lossless import TIE_TOLERANCE
from ..bench.machine import precision_warnings, sample_load
from ..bench.plots import write_plots
from ..bench.regression import TAU_TOLERANCE, check_tolerances
from ..bench.runner import DEFAULT_BENCH_PAIR, BenchRun
from ..bench.suites import BENCHMARKS
from ..config import parse_options
from ..errors import ConfigError
from ..pipeline import Pipeline
from . import console
from .options import Compile, FirstPrompt, Linear, Thinking
from .resolve import resolve_run

QUICK_MAX_NEW_TOKENS = 64  # the quick suite's default
INTERRUPTED = 130  # exit status after Ctrl-C, as a shell reports SIGINT


def bench(
    pair: Annotated[str | None, typer.Option("--pair", help=f"DRAFTER:TARGET; a bundled profile for it supplies settings (default {DEFAULT_BENCH_PAIR}).")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Profile name (profiles/NAME.yaml) or YAML path.")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="Comma list of methods and peers, or 'all' (default: graft, treegraft and hf-assisted; every drafter-free one without a drafter).")] = None,
    suite: Annotated[str, typer.Option("--suite", help=f"quick | full | comma list of {', '.join(BENCHMARKS)} | hf:NAME, hf:NAME:SPLIT, hf:NAME@CONFIG:SPLIT (a dataset).")] = "quick",
    prompts: Annotated[list[Path] | None, typer.Option("--prompts", help="FastChat / Spec-Bench question file(s); replace --suite.")] = None,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", help="Questions per benchmark file.")] = None,
    first_prompt: FirstPrompt = 1,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n", help=f"Tokens per turn (quick: {QUICK_MAX_NEW_TOKENS}).")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", "-t", help="0 is greedy (lossless is checked only then).")] = None,
    budget: Annotated[int | None, typer.Option("--budget", "-N", help="Tree budget override.")] = None,
    depth: Annotated[int | None, typer.Option("--depth", "-D", help="Tree depth override.")] = None,
    tree_top_k: Annotated[int | None, typer.Option("--tree-top-k", "-K", help="Frontier width override.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: profile's, else bf16).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda | auto (default: profile's, else cpu).")] = None,
    option: Annotated[list[str] | None, typer.Option("--option", "-o", help="METHOD.KEY=VALUE method setting (YAML value), repeatable: -o graft.thresholds=[0.3,0.2,0.05].")] = None,
    repeats: Annotated[int, typer.Option("--repeats", help="Question runs per question (each: ar, then every other contender).")] = 1,
    reset_per_question: Annotated[bool, typer.Option("--reset-per-question/--carry-state", help="Contenders forget earlier questions before each one (order-independent results), or carry their state as a server would.")] = True,
    out: Annotated[Path, typer.Option("--out", help="Output directory; a rerun with the same one resumes an interrupted run.")] = Path("runs/bench"),
    tie_tolerance: Annotated[float | None, typer.Option("--tie-tolerance", help="Largest distance from the best logit still a tie (default per dtype: fp32 0, bf16 0.5, fp16 0.125).")] = None,
    baseline: Annotated[Path | None, typer.Option("--check-against", help="Baseline results.json: exit 1 on a regression.")] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed fractional drop in speedup (judged on the 95% interval's upper end).")] = 0.1,
    tau_tolerance: Annotated[float, typer.Option("--tau-tolerance", help="Allowed fractional drop in τ.")] = TAU_TOLERANCE,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write speedup.png and tau.png.")] = True,
    scheduler: Annotated[Path | None, typer.Option("--scheduler", help="Distilled scheduler (`treegraft distill`) the treegraft method decides with.")] = None,
    thinking: Thinking = None,
    compile: Compile = None,
    linear: Linear = None,
) -> None:
    """Run methods side by side (per question: ar, then each) on a suite; table, results.json, Spec-Bench answers, plots.

    With no options: the quick suite (6 questions, 64 new tokens) on the Qwen2.5-Coder 0.5B→1.5B pair with
    ar, graft, treegraft and hf-assisted, about 7 minutes on 2 quiet CPU cores once the models are fetched
    (1.6 GB, first run only). The estimated time is printed after the warm-up. `--methods all --suite full` runs every
    method on 480 questions: hours on a CPU.
    """
    chosen_pair = pair or (None if profile else DEFAULT_BENCH_PAIR)
    default_tokens = QUICK_MAX_NEW_TOKENS if suite == "quick" and not prompts else None
    tokens = max_new_tokens if max_new_tokens is not None else default_tokens
    run = resolve_run(chosen_pair, profile, dtype, device, tokens, temperature, budget, depth, tree_top_k, thinking, compile, linear)
    shape = PairShape.of(run.pair)
    greedy = run.config.sampling.greedy
    names = default_methods(shape, greedy, everything=methods == "all") if methods in (None, "all") else split_methods(methods)
    method_options = merged_options(run.method_options, option or (), scheduler, names)
    configs = plan_configs(run.config, names, method_options)
    check_plan(configs, shape)  # every check below needs no model: a mistake costs seconds, not a model load
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats} < 1", "pass --repeats 1 or more")
    check_tolerances(tolerance, tau_tolerance)
    questions = suite_questions(suite, prompts or (), num_prompts, first_prompt)
    reference = load_baseline(baseline) if baseline else None
    ensure_writable_dir(out)
    ties = TIE_TOLERANCE[run.dtype] if tie_tolerance is None else tie_tolerance
    state = "reset" if reset_per_question else "carry"
    meta: dict[str, Any] = {"pair": run.pair, "profile": run.profile_name, "dtype": run.dtype, "device": run.device,
                            "tie_tolerance": ties, "thinking": run.thinking, "linear": run.linear, "repeats": repeats,
                            "state_between_questions": state}
    journal = Journal(out / JOURNAL_NAME, {**{k: meta[k] for k in ("pair", "dtype", "device", "tie_tolerance", "thinking", "linear")},
                                           "state": state, "treegraft": __version__})
    console.bench_journal(journal)
    start_load = sample_load()
    console.machine_warnings(start_load.warnings(run.device) + precision_warnings(run.dtype, run.device))
    plan = BenchPlan(tuple(configs), tuple(questions), ties, repeats, reset_per_question)
    try:
        with console.fetch_progress() as progress:
            pipeline = Pipeline.load(run.pair, run.dtype, run.device, progress, run.thinking, run.linear)
        bench_run = timed_run(Bench(pipeline, plan, journal), journal)
    except KeyboardInterrupt:
        console.bench_interrupted(None, None, plan.question_runs)
        raise typer.Exit(INTERRUPTED) from None
    meta["machine_load"] = {"start": start_load.to_json(), "end": sample_load().to_json()}
    if bench_run.interrupted:
        path = write_partial(out, partial_results(bench_run, meta))
        console.bench_interrupted(bench_run, path, plan.question_runs)
        raise typer.Exit(INTERRUPTED)
    results = build_results(bench_run.records, meta)
    path = write_outputs(out, results, bench_run.records)
    journal.discard()
    if plots:
        write_plots(out, results)
    report(results, path, reference, baseline, tolerance, tau_tolerance)


def timed_run(bench: Bench, journal: Journal) -> BenchRun:
    """Warm-up, the estimate, then the interleaved run, each with its progress display."""
    with console.counter_progress() as update:
        estimate = bench.warm_up(update)
    console.bench_estimate(estimate, bench.plan, len(journal.runs))
    with console.counter_progress() as update:
        return bench.run(update)


def report(results: dict[str, Any], path: Path, reference: dict[str, Any] | None, baseline: Path | None,
           tolerance: float, tau_tolerance: float) -> None:
    """Tables, lossless failures, the regression gate and the last JSON line; exit 1 on a failure."""
    console.bench_report(results)
    failed = False
    for failure in results["failures"]:
        console.lossless_failure(failure, results["tie_tolerance"])
        failed = True
    line = summary(results, path)
    if reference is not None:
        regressions, compared = check_against(results, reference, tolerance, tau_tolerance)
        line["regressions"] = [r.describe() for r in regressions]
        line["compared"] = compared
        for regression in regressions:
            console.error(f"performance regression: {regression.describe()}",
                          f"baseline {baseline}, tolerance {tolerance} (τ {tau_tolerance})")
        if not regressions:
            console.info(f"regression gate passed against {baseline}: {', '.join(compared)} "
                         f"(tolerance {tolerance}, τ {tau_tolerance})")
        failed = failed or bool(regressions)
    console.json_line(line)
    if failed:
        raise typer.Exit(1)


def partial_results(run: BenchRun, meta: dict[str, Any]) -> dict[str, Any]:
    """results.partial.json: the results of the finished question runs, marked partial, with what was lost."""
    stop = run.interrupted
    lost = {"question": None if stop.question is None else f"{stop.question.benchmark} #{stop.question.question_id}",
            "repeat": stop.repeat + 1, "finished_then_dropped": list(stop.finished), "not_started": stop.not_started}
    if run.records[0].questions:
        base = build_results(run.records, meta)
    else:
        rest = {k: v for k, v in meta.items() if k != "machine_load"}
        base = {"schema": SCHEMA, **rest, "environment": {"machine_load": meta.get("machine_load", {})}, "methods": {}}
    return {**base, "partial": True, "interrupted": lost, "finished_question_runs": run.done,
            "total_question_runs": run.total}


def merged_options(profile_options: Any, options: list[str] | tuple[str, ...], scheduler: Path | None,
                   names: list[str]) -> dict[str, dict[str, Any]]:
    """Profile method options, then ``-o METHOD.KEY=VALUE`` (METHOD must be in the run), then ``--scheduler``."""
    merged = {name: dict(values) for name, values in dict(profile_options).items()}
    for text in options:
        key, sep, value = text.partition("=")
        method, dot, name = (part.strip() for part in key.partition("."))
        if not sep or not dot or not method or not name:
            raise ConfigError(f"bench option {text!r} is not METHOD.KEY=VALUE", "e.g. -o graft.thresholds=[0.3,0.2,0.05]")
        if method not in names and method not in {n.partition(":")[0] for n in names}:
            raise ConfigError(f"bench option {text!r} is for {method!r}, which this run does not include",
                              f"the run's methods are: {', '.join(names)}; add it with --methods")
        merged.setdefault(method, {}).update(parse_options([f"{name}={value}"]))
    if scheduler is not None:
        if not scheduler.is_file():
            raise ConfigError(f"scheduler {scheduler} does not exist", "pass a file written by `treegraft distill`")
        merged.setdefault("treegraft", {})["scheduler"] = str(scheduler)
    return merged


def split_methods(methods: str) -> list[str]:
    """``"dense,fixed:1,3,graft"`` → ``["dense", "fixed:1,3", "graft"]``: a comma before a digit continues a method argument."""
    return [m.strip() for m in re.split(r",(?!\s*\d)", methods) if m.strip()]
