"""`treegraft bench`: methods and transformers peers side by side; results.json, answers, plots, CI gate."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from ..bench import (
    check_against,
    default_methods,
    load_baseline,
    plan_configs,
    run_bench,
    suite_questions,
    summary,
    write_outputs,
)
from ..bench.contenders import check_names
from ..bench.lossless import TIE_TOLERANCE
from ..bench.plots import write_plots
from ..bench.results import build_results
from ..bench.suites import BENCHMARKS
from ..pipeline import Pipeline
from . import console
from .options import Compile, Thinking
from .resolve import resolve_run

QUICK_MAX_NEW_TOKENS = 64  # the quick suite's default: about 10 minutes on 2 CPU cores for the default pair


def bench(
    pair: Annotated[str | None, typer.Option("--pair", help="DRAFTER:TARGET; a bundled profile for it supplies settings.")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Profile name (profiles/NAME.yaml) or YAML path.")] = None,
    methods: Annotated[str | None, typer.Option("--methods", help="Comma list of methods and peers (default: all the pair can run).")] = None,
    suite: Annotated[str, typer.Option("--suite", help=f"quick | full | comma list of {', '.join(BENCHMARKS)}.")] = "quick",
    prompts: Annotated[list[Path] | None, typer.Option("--prompts", help="FastChat question file(s); replace --suite.")] = None,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", help="Questions per benchmark file.")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n", help=f"Tokens per turn (quick: {QUICK_MAX_NEW_TOKENS}).")] = None,
    temperature: Annotated[float | None, typer.Option("--temperature", "-t", help="0 is greedy (lossless is checked only then).")] = None,
    budget: Annotated[int | None, typer.Option("--budget", "-N", help="Tree budget override.")] = None,
    depth: Annotated[int | None, typer.Option("--depth", "-D", help="Tree depth override.")] = None,
    tree_top_k: Annotated[int | None, typer.Option("--tree-top-k", "-K", help="Frontier width override.")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: profile's, else bf16).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda | auto (default: profile's, else cpu).")] = None,
    out: Annotated[Path, typer.Option("--out", help="Output directory.")] = Path("runs/bench"),
    tie_tolerance: Annotated[float | None, typer.Option("--tie-tolerance", help="Top-2 logit gap still a tie (default per dtype: fp32 0, bf16 0.5, fp16 0.125).")] = None,
    baseline: Annotated[Path | None, typer.Option("--check-against", help="Baseline results.json: exit 1 on a regression.")] = None,
    tolerance: Annotated[float, typer.Option("--tolerance", help="Allowed fractional drop in speedup and τ vs the baseline.")] = 0.1,
    plots: Annotated[bool, typer.Option("--plots/--no-plots", help="Write speedup.png and tau.png.")] = True,
    scheduler: Annotated[Path | None, typer.Option("--scheduler", help="Distilled scheduler (`treegraft distill`) the treegraft method decides with.")] = None,
    thinking: Thinking = None,
    compile: Compile = None,
) -> None:
    """Run methods side by side (ar first) on a suite; table, results.json, Spec-Bench answers, plots."""
    default_tokens = QUICK_MAX_NEW_TOKENS if suite == "quick" and not prompts else None
    run = resolve_run(pair, profile, dtype, device, max_new_tokens or default_tokens, temperature, budget, depth, tree_top_k,
                      thinking, compile)
    chosen = split_methods(methods) if methods else None
    if chosen:
        check_names(chosen)  # before the data and the models load
    questions = suite_questions(suite, prompts or (), num_prompts)
    reference = load_baseline(baseline) if baseline else None
    with console.fetch_progress() as progress:
        pipeline = Pipeline.load(run.pair, run.dtype, run.device, progress, run.thinking)
    names = chosen or default_methods(pipeline, run.config.sampling.greedy)
    method_options = dict(run.method_options)
    if scheduler is not None:
        method_options["treegraft"] = {**method_options.get("treegraft", {}), "scheduler": str(scheduler)}
    configs = plan_configs(run.config, names, method_options)
    tolerance_ties = TIE_TOLERANCE[run.dtype] if tie_tolerance is None else tie_tolerance
    with console.counter_progress() as update:
        records = run_bench(pipeline, configs, questions, tolerance_ties, progress=update)
    meta = {"pair": run.pair, "profile": run.profile_name, "dtype": run.dtype, "device": run.device,
            "tie_tolerance": tolerance_ties, "thinking": run.thinking}
    results = build_results(records, meta)
    path = write_outputs(out, results, records)
    if plots:
        write_plots(out, results)
    console.bench_report(results)
    failed = False
    for failure in results["failures"]:
        console.error(f"not lossless: {failure['method']} on {failure['benchmark']} question {failure['question_id']} "
                      f"turn {failure['turn'] + 1}, token {failure['position']} (top-2 gap {failure['gap']})",
                      "a real mismatch with ar: the method is not lossless on this prompt")
        failed = True
    line = summary(results, path)
    if reference is not None:
        regressions, compared = check_against(results, reference, tolerance)
        line["regressions"] = [r.describe() for r in regressions]
        line["compared"] = compared
        for regression in regressions:
            console.error(f"performance regression: {regression.describe()}", f"baseline {baseline}, tolerance {tolerance}")
        failed = failed or bool(regressions)
    console.json_line(line)
    if failed:
        raise typer.Exit(1)


def split_methods(methods: str) -> list[str]:
    """``"dense,fixed:1,3,graft"`` → ``["dense", "fixed:1,3", "graft"]``: a comma before a digit continues a method argument."""
    return [m.strip() for m in re.split(r",(?!\s*\d)", methods) if m.strip()]
