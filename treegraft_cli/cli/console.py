"""The one module that prints: Rich console, error lines, progress bars, tables and JSON."""

from __future__ import annotations

import json
import sys
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
    """A progress bar driven by ``update(description, done, total)`` calls (the core's progress protocol)."""
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeRemainingColumn(), console=stderr, transient=True) as bar:
        task = bar.add_task("starting", total=1)

        def update(description: str, done: int, total: int) -> None:
            bar.update(task, description=description, completed=done, total=total)

        yield update


def _verdict(method: dict[str, Any]) -> str:
    if method["lossless"] is None:
        return "n/a (sampling)"
    if not method["lossless"]:
        return f"[bold red]NO[/] ({method['mismatches']} mismatch)"
    return f"yes ({method['ties']} ties)" if method["ties"] else "yes"


def bench_report(results: dict[str, Any]) -> None:
    """The bench tables on stderr: one row per method, then speedup and τ per benchmark."""
    rows = []
    for name, m in results["methods"].items():
        split = m["time_split"]
        busy = sum(split.get(k, 0.0) for k in ("prefill_s", "draft_s", "verify_s", "host_s")) or 1.0
        shares = "/".join(f"{100 * split.get(k, 0.0) / busy:.0f}" for k in ("prefill_s", "draft_s", "verify_s", "host_s"))
        accept = "/".join(f"{a:.2f}" for a in m["acceptance_by_depth"][:4]) or "-"
        calls = " ".join(f"{k}={v:.1f}" for k, v in m["drafter_calls_per_step"].items()) or "-"
        rows.append((name, m["kind"], m["tokens_per_s"], f"{m['speedup']:.2f}x", m["tau"], accept, calls, shares,
                     f"{m['peak_memory_mb']:.0f}", _verdict(m)))
    table(f"bench {results.get('pair', '')} ({results['num_questions']} questions, {results['max_new_tokens']} new tokens, "
          f"{results.get('dtype', '')})",
          ["method", "kind", "tok/s", "speedup", "τ", "accept@d1..4", "drafter calls/step", "prefill/draft/verify/host %",
           "peak MB", "lossless"], rows)
    benchmarks = results["benchmarks"]
    per = [(name, *(f"{m['per_benchmark'][b]['speedup']:.2f}x τ{m['per_benchmark'][b]['tau']:.2f}" for b in benchmarks))
           for name, m in results["methods"].items()]
    table("speedup and τ per benchmark", ["method", *benchmarks], per)
