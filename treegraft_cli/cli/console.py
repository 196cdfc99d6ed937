"""The one module that prints: Rich console, error lines, progress bars, tables and JSON."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

stdout = Console(highlight=False)
stderr = Console(stderr=True, highlight=False)


def error(message: str, hint: str = "") -> None:
    """One clear line (two with a hint) on stderr; no traceback."""
    stderr.print(f"[bold red]error:[/] {message}")
    if hint:
        stderr.print(f"[yellow]fix:[/] {hint}")


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
