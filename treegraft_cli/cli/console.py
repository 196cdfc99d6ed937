"""The one module that prints: Rich console, error lines, progress bars, tables and JSON."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False, width=None if sys.stderr.isatty() else 200)  # logs keep wide tables whole


def error(message: str, hint: str = "") -> None:
    """One clear line (two with a hint) on stderr; no traceback. Brackets in the text are literal, not markup."""
    stderr.print(f"[bold red]error:[/] {escape(message)}")
    if hint:
        stderr.print(f"[yellow]fix:[/] {escape(hint)}")


def info(message: str) -> None:
    stderr.print(message)


def result(text: str) -> None:
    """Plain output on stdout (answers, summaries), never styled."""
    sys.stdout.write(text + ("\n" if not text.endswith("\n") else ""))
    sys.stdout.flush()


def json_line(payload: Any) -> None:
    result(json.dumps(payload, ensure_ascii=False))


def table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    grid = Table(title=title)
    for column in columns:
        grid.add_column(column, justify="right" if column not in (columns[0],) else "left")
    for row in rows:
        grid.add_row(*[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row])
    stderr.print(grid)


def listing(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A table of text on stdout: the answer of a listing command (``treegraft methods``), left-aligned."""
    grid = Table(title=title, title_justify="left")
    for column in columns:
        grid.add_column(column, overflow="fold")
    for row in rows:
        grid.add_row(*map(str, row))
    stdout.print(grid)


@contextmanager
def fetch_progress() -> Iterator[Any]:
    """A progress callback (description, completed, total) backed by a Rich bar on stderr."""
    columns = [TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=stderr, transient=True) as bar:
        tasks: dict[str, int] = {}

        def update(description: str, completed: int, total: int) -> None:
            phase = "bytes" if total > 1000 else "files"
            if phase not in tasks:
                tasks[phase] = bar.add_task(description, total=total)
            bar.update(tasks[phase], description=description, completed=completed, total=total)

        yield update


@contextmanager
def task_progress(description: str, total: int) -> Iterator[Any]:
    """A counting progress bar; yields ``advance(n=1, description=None)``."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=stderr, transient=True) as bar:
        task = bar.add_task(description, total=total)

        def advance(n: int = 1, description: str | None = None) -> None:
            bar.update(task, advance=n, description=description or bar.tasks[0].description)

        yield advance


@contextmanager
def counter_progress() -> Iterator[Any]:
    """A progress display driven by ``update(description, done, total)`` calls (the core's progress protocol):
    a Rich bar on a terminal; one plain line per call otherwise (a log or CI shows the run is alive)."""
    if not sys.stderr.isatty():
        started = time.monotonic()
        phase = {"started": started, "total": None, "done": 0}  # a new total or a count going back: a new phase

        def line(description: str, done: int, total: int) -> None:
            now = time.monotonic()
            if total != phase["total"] or done < phase["done"]:
                phase.update(started=now, total=total, base=done)
            phase["done"] = done
            progress, spent = done - phase["base"], now - phase["started"]
            left = f", about {duration(spent / progress * (total - done))} left" if progress > 0 and done < total else ""
            sys.stderr.write(f"[{done}/{total}] {description} ({duration(now - started)} elapsed{left})\n")
            sys.stderr.flush()

        yield line
        return
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=stderr, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def update(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total)

        yield update


def duration(seconds: float) -> str:
    """``42s``, ``7m05s``, ``2h03m``."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def lossless_failure(failure: dict[str, Any], tolerance: float) -> None:
    """One not-lossless turn: where it parted from ar, and how far each token was from the target's best logit."""
    where = (f"not lossless: {failure['method']} on {failure['benchmark']} question {failure['question_id']} "
             f"turn {failure['turn'] + 1}, token {failure['position']}")
    distances = failure.get("distances")
    if distances:
        ranks = failure.get("ranks") or ["?", "?"]
        where += (f" (distance from the best logit: ar's token {distances[0]:.3g} (rank {ranks[0]}), "
                  f"{failure['method']}'s {distances[1]:.3g} (rank {ranks[1]}); tie tolerance {tolerance:g})")
    else:
        where += " (one output stopped where the other went on)"
    error(where, "a real mismatch with ar: the method is not lossless on this prompt")


def _verdict(method: dict[str, Any]) -> str:
    if method["lossless"] is None:
        return "n/a (sampling)"
    if not method["lossless"]:
        return f"[bold red]NO[/] ({method['mismatches']} mismatch)"
    ties = method["ties"]
    return f"yes ({ties} tie{'s' if ties != 1 else ''})" if ties else "yes"


def _speedup(m: dict[str, Any]) -> str:
    interval = m.get("speedup_ci")
    return f"{m['speedup']:.2f}x" + (f" [{interval[0]:.2f}–{interval[1]:.2f}]" if interval else "")


def _same_text(m: dict[str, Any]) -> str:
    if m.get("speedup_same_text") is None:
        return f"- (0/{m.get('turns', 0)})"
    return f"{m['speedup_same_text']:.2f}x ({m['same_text_turns']}/{m['turns']})"


def bench_report(results: dict[str, Any]) -> None:
    """The bench tables on stderr: one row per method, then speedup and τ per benchmark."""
    rows = []
    for name, m in results["methods"].items():
        split = m["time_split"]
        busy = sum(split.get(k, 0.0) for k in ("prefill_s", "draft_s", "verify_s", "host_s")) or 1.0
        shares = "/".join(f"{100 * split.get(k, 0.0) / busy:.0f}" for k in ("prefill_s", "draft_s", "verify_s", "host_s"))
        accept = "/".join(f"{a:.2f}" for a in m["acceptance_by_depth"][:4]) or "-"
        calls = " ".join(f"{k}={v:.1f}" for k, v in m["drafter_calls_per_step"].items()) or "-"
        rows.append((name, m["kind"], m["tokens_per_s"], _speedup(m), _same_text(m), m["tau"], accept, calls, shares,
                     f"{m['peak_memory_mb']:.0f}", _verdict(m)))
    runs = results.get("repeats", 1)
    table(f"bench {results.get('pair', '')} ({results['num_questions']} questions"
          f"{f' × {runs} repeats' if runs > 1 else ''}, {results['max_new_tokens']} new tokens, {results.get('dtype', '')}, "
          f"state {results.get('state_between_questions', 'carry')}; speedup with its 95% interval)",
          ["method", "kind", "tok/s", "speedup", "same text as ar", "τ", "accept@d1..4", "drafter calls/step",
           "prefill/draft/verify/host %", "peak MB", "lossless"], rows)
    benchmarks = results["benchmarks"]
    per = [(name, *(f"{m['per_benchmark'][b]['speedup']:.2f}x τ{m['per_benchmark'][b]['tau']:.2f}" for b in benchmarks))
           for name, m in results["methods"].items()]
    table("speedup and τ per benchmark", ["method", *benchmarks], per)
    if results.get("temperature", 0) > 0:
        info(f"lossless: {results['lossless_basis']}")


def bench_journal(journal: Any) -> None:
    """What an earlier, interrupted run in the same --out left to resume."""
    if journal.stale:
        info(f"note: {journal.path} holds an earlier run with another pair or settings; it is replaced by this run")
    elif journal.runs:
        info(f"resuming: {len(journal.runs)} question run(s) already finished in {journal.path} are kept")


def machine_warnings(warnings: Sequence[str]) -> None:
    for warning in warnings:
        stderr.print(f"[yellow]warning:[/] {warning}")


def bench_estimate(estimate: Any, plan: Any, resumable: int) -> None:
    """The time the timed run should take, before it starts."""
    left = max(0, plan.question_runs - resumable) / max(1, plan.question_runs)
    info(f"estimated time: about {duration(estimate.seconds * left)} for {len(plan.configs)} contenders × "
         f"{plan.question_runs} question runs ({duration(estimate.seconds * left / max(1, len(plan.configs)))} "
         "per contender; from the warm-up, shorter when answers stop early)")


def bench_interrupted(run: Any, path: Any, total: int) -> None:
    """Ctrl-C: what was kept, what was lost, and how to resume."""
    if run is None:
        error("interrupted before the first question run finished: nothing new was kept",
              "rerun the same command; question runs finished by earlier runs in --out are resumed")
        return
    stop = run.interrupted
    kept = f"kept {run.done} of {total} question runs in {path} (partial: not results.json)"
    if stop.question is not None:
        where = f"{stop.question.benchmark} #{stop.question.question_id}"
        done = f"; its finished contenders ({', '.join(stop.finished)}) are dropped" if stop.finished else ""
        lost = f"lost: the question run in progress ({where}, repeat {stop.repeat + 1}{done})"
    else:
        lost = "lost: nothing in progress"
    error(f"interrupted: {kept}; {lost}; {stop.not_started} question run(s) not started",
          "rerun the same command with the same --out to resume from the finished question runs")
