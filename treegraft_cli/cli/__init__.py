"""The treegraft command line. Commands are thin: they parse options and call the core."""

from __future__ import annotations

import platform
import sys
from typing import Annotated

import typer

from .. import __version__
from ..errors import TreegraftError
from . import console
from .bench import bench
from .collect import collect
from .distill import distill, replay
from .generate import generate
from .methods_cmd import methods
from .models_cmd import app as models_app
from .profile import profile
from .tune import tune

app = typer.Typer(
    name="treegraft",
    help="Benchmark and tune tree-based speculative decoding (Graft, TreeGraft).",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _print_version(value: bool) -> None:
    if value:
        import torch
        import transformers

        console.result(f"treegraft {__version__} (torch {torch.__version__}, transformers {transformers.__version__}, "
                       f"python {platform.python_version()})")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print the version (and torch's, transformers') and exit.")] = False,
) -> None:
    """Benchmark and tune tree-based speculative decoding (Graft, TreeGraft)."""


app.command()(generate)
app.command()(methods)
app.command()(bench)
app.command()(tune)
app.command()(profile)
app.command()(collect)
app.command()(distill)
app.command()(replay)
app.add_typer(models_app, name="models")

# Commands whose issues have not landed yet: they say so and exit non-zero instead of faking output.
PENDING: dict[str, tuple[str, str]] = {}


def _pending(name: str, summary: str, issue: str):
    def command(ctx: typer.Context) -> None:
        console.error(f"`treegraft {name}` is not available in this version", f"it is tracked in {issue}")
        raise typer.Exit(2)

    command.__doc__ = f"{summary[0].upper()}{summary[1:]} (not available yet)."
    return command


def register_pending(commands: dict[str, tuple[str, str]]) -> None:
    existing = {c.name for c in app.registered_commands}
    for name, (summary, issue) in commands.items():
        if name not in existing:
            app.command(name, context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(
                _pending(name, summary, issue)
            )


def main() -> None:
    register_pending(PENDING)
    try:
        app()
    except TreegraftError as failure:
        console.error(failure.message, failure.hint)
        sys.exit(2)
