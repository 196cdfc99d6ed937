"""`treegraft tune`: Optuna search over a method's space; writes the best configuration as a profile."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import ensure_writable_dir
from ..bench.contenders import check_names
from ..bench.machine import precision_warnings
from ..bench.suites import BENCHMARKS, NoQuestionsError, Question, suite_questions
from ..errors import ConfigError
from ..methods import check_method
from ..pipeline import Pipeline
from ..tune import (
    TuneSettings,
    completed,
    export_profile,
    hide_password,
    load_space,
    open_study,
    run_tune,
    selected_trial,
    validate_trials,
    validation_speedups,
    worker_id,
)
from ..tune.plots import write_study_plot
from . import console
from .options import Compile, FirstPrompt, Linear, Thinking
from .resolve import has_drafter, resolve_run


def tune(
    pair: Annotated[str | None, typer.Option("--pair", help="DRAFTER:TARGET (default: the local default pair).")] = None,
    method: Annotated[str, typer.Option("--method", "-m", help="Method to tune; its space is tuning/METHOD.yaml.")] = "dense",
    trials: Annotated[int, typer.Option("--trials", help="Trials to run now (0: export the best).")] = 20,
    storage: Annotated[str | None, typer.Option("--storage", help="sqlite:///FILE.db (default runs/tune/STUDY.db) | postgresql://...")] = None,
    study: Annotated[str | None, typer.Option("--study", help="Study name (default: PAIR--METHOD).")] = None,
    suite: Annotated[str, typer.Option("--suite", help=f"quick | full | comma list of {', '.join(BENCHMARKS)}.")] = "quick",
    prompts: Annotated[list[Path] | None, typer.Option("--prompts", help="FastChat question file(s); replace --suite.")] = None,
    num_prompts: Annotated[int, typer.Option("--num-prompts", help="Search questions per benchmark file.")] = 1,
    first_prompt: FirstPrompt = 1,
    validation_prompts: Annotated[int, typer.Option("--validation-prompts", help="Validation questions per benchmark file, the ones right after the search questions (0: no validation).")] = 1,
    validate_top: Annotated[int, typer.Option("--validate-top", help="Best search trials timed again on the validation questions; the best of them there is exported.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens per turn.")] = 64,
    dtype: Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda | auto.")] = None,
    space: Annotated[Path | None, typer.Option("--space", help="Search-space YAML (default tuning/METHOD.yaml).")] = None,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Second objective: peak memory (Pareto front).")] = False,
    seed: Annotated[int, typer.Option("--seed", help="TPE sampler seed (mixed with the worker's identity).")] = 0,
    heartbeat: Annotated[int, typer.Option("--heartbeat", help="Trial heartbeat, seconds (2 missed: retried).")] = 60,
    out: Annotated[Path | None, typer.Option("--out", help="Profile YAML to write (default runs/tune/STUDY.yaml).")] = None,
    thinking: Thinking = None,
    compile: Compile = None,
    linear: Linear = None,
) -> None:
    """Search tree budget, depth, top-k and the method's options for the best speedup over ar; the best trials
    are timed again on validation questions the search never saw, and the best there is exported."""
    if trials < 0:
        raise ConfigError(f"--trials {trials} < 0", "pass --trials 1 or more, or 0 to only export the study's best")
    if validation_prompts < 0 or validate_top < 1:
        raise ConfigError(f"--validation-prompts {validation_prompts}, --validate-top {validate_top}",
                          "pass --validation-prompts 0 or more and --validate-top 1 or more")
    check_names([method])  # an unregistered method fails here, naming the registered ones
    search = load_space(method, space)
    run = resolve_run(pair, None, dtype, device, max_new_tokens, 0.0, None, None, None, thinking, compile, linear)
    name = study or re.sub(r"[^\w.-]+", "_", f"{run.pair}--{method}")
    out = out or Path("runs/tune") / f"{name}.yaml"
    base = dataclasses.replace(run.config, method=method, method_options=dict(run.method_options.get(method, {})))
    check_method(base, has_drafter(run.pair))
    questions = suite_questions(suite, prompts or (), num_prompts, first_prompt) if trials else []
    held_out = validation_questions(suite, prompts or (), validation_prompts, first_prompt + num_prompts) if trials else []
    ensure_writable_dir(out.parent)
    if storage is None:
        out.parent.mkdir(parents=True, exist_ok=True)
        storage = f"sqlite:///{out.with_suffix('.db')}"
    settings = TuneSettings(run.pair, run.dtype, run.device, base, trials, storage, name, seed, memory, heartbeat,
                            run.linear)
    result = open_study(settings, search)  # a bad URL, a dead server or another study's space fail before models load
    ran: list[int] = []
    if trials:
        console.machine_warnings(precision_warnings(run.dtype, run.device))
        with console.fetch_progress() as progress:
            pipeline = Pipeline.load(run.pair, run.dtype, run.device, progress, run.thinking, run.linear)
        with console.counter_progress() as update:
            update("timing ar", 0, trials)

            def on_trial(number: int, value: float | None, done: int, total: int) -> None:
                shown = "pruned" if value is None else f"{value:.3f}x"
                update(f"trial {number}: {shown}", done, total)

            ran = run_tune(pipeline, result, search, settings, questions, on_trial)
            validate_trials(pipeline, result, search, base, held_out, validate_top, update)
    profile = export_profile(result, search, settings, out, thinking=run.thinking)
    plot = write_study_plot(result, out.with_suffix(".png"))
    best, validation_speedup = selected_trial(result)
    validated = validation_speedups(result)
    rows = sorted(completed(result), key=lambda t: -t.values[0])[:10]
    console.table(f"study {name} ({len(result.trials)} trials, {hide_password(storage)}; speedup over ar on the search "
                  f"and the validation questions; exported: trial {best.number})",
                  ["trial", "search", "validation", "peak MB", *search_keys(search)],
                  [(t.number, t.values[0], validated.get(t.number, "-"), f"{t.user_attrs.get('peak_memory_mb', 0):.0f}",
                    *(t.params.get(k, "-") for k in search_keys(search))) for t in rows])
    console.json_line({"profile": str(out), "plot": str(plot), "study": name, "storage": hide_password(storage),
                       "best_trial": best.number, "speedup": best.values[0], "validation_speedup": validation_speedup,
                       "selected_by": profile.tuned["selected_by"], "params": best.params,
                       "trials": len(result.trials), "ran": ran, "worker": worker_id(), "pair": profile.pair, "method": method})


def validation_questions(suite: str, prompts: list[Path], per_file: int, first_prompt: int) -> list[Question]:
    """The ``per_file`` questions of each file right after the search questions (none when ``per_file`` is 0)."""
    if per_file == 0:
        return []
    try:
        return suite_questions(suite, prompts, per_file, first_prompt)
    except NoQuestionsError:
        raise ConfigError(f"no validation questions: the question files end before question {first_prompt}",
                          "pass --validation-prompts 0 to tune without validation, or question files with more questions") from None


def search_keys(search) -> list[str]:
    return [p.key for p in search.params]
