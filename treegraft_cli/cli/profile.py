"""`treegraft profile`: time target verification and drafter forwards on this device; a cost-profile YAML + PNG."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from ..atomic import ensure_writable_dir
from ..pipeline import Pipeline
from ..scheduling.cost_profile import save_cost_profile
from ..scheduling.profiler import (
    DEFAULT_CONTEXTS,
    DEFAULT_TOKENS,
    ProfileSettings,
    measure_profile,
    parse_grid,
    plot_profile,
    summary_rows,
)
from . import console
from .options import Linear
from .resolve import resolve_run

SUMMARY_TOKENS = (1, 16, 64, 256)


def profile(
    pair: Annotated[str | None, typer.Option("--pair", help="DRAFTER:TARGET (default: the local default pair).")] = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32 (default: the pair profile's, else bf16).")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda | auto.")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="Cost-profile YAML (default runs/profile/PAIR-DEVICE-DTYPE.yaml); a PNG beside it.")] = None,
    tokens: Annotated[str, typer.Option("--tokens", help="Tree tokens per forward, comma list.")] = ",".join(map(str, DEFAULT_TOKENS)),
    contexts: Annotated[str, typer.Option("--contexts", help="Context lengths, comma list.")] = ",".join(map(str, DEFAULT_CONTEXTS)),
    repeats: Annotated[int, typer.Option("--repeats", help="Timed repeats per point (the median is kept).")] = 3,
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs before each point's repeats.")] = 1,
    width: Annotated[int, typer.Option("--width", "-K", help="K: n-gram continuations per parent, adjacency k.")] = 10,
    linear: Linear = None,
    random_weights: Annotated[bool, typer.Option(
        "--random-weights",
        help="Build each model from its config with random weights (no weights read): a forward's cost depends on the "
             "shapes, so a pair can be timed where its weights are not.")] = False,
) -> None:
    """Time the target's verify forward and the drafter's tree forward against tree tokens and context length."""
    run = resolve_run(pair, None, dtype, device, None, None, None, None, None, linear=linear)
    if repeats < 1 or warmup < 0 or width < 1:
        raise typer.BadParameter("--repeats >= 1, --warmup >= 0 and --width >= 1")
    settings = ProfileSettings(parse_grid(tokens, "tokens"), parse_grid(contexts, "contexts"), warmup, repeats, width)
    packed = "-packed" if run.linear == "packed" else ""
    path = out or Path("runs/profile") / f"{_slug(run.pair)}-{run.device}-{run.dtype}{packed}.yaml"
    ensure_writable_dir(path.parent)
    with console.fetch_progress() as progress:
        pipeline = Pipeline.load(run.pair, run.dtype, run.device, progress, linear=run.linear,
                                 random_weights=random_weights)
    drafter = pipeline.drafter.model if pipeline.drafter is not None else None
    with console.counter_progress() as update:
        measured = measure_profile(run.pair, run.dtype, pipeline.target.model, drafter, settings, update)
    if random_weights:  # beside the library versions: whoever reads the profile sees where its times come from
        measured = replace(measured, versions={**measured.versions, "weights": "random (shapes only)"})
    save_cost_profile(measured, path)
    plot = path.with_suffix(".png")
    plot_profile(measured, plot)
    columns = [t for t in SUMMARY_TOKENS if t <= max(settings.tree_tokens)] or [settings.tree_tokens[-1]]
    console.table(f"median ms per forward — {measured.device}, {measured.dtype}", ["model", "context", *(f"{t} tok" for t in columns)],
                  summary_rows(measured, columns))
    console.json_line({"profile": str(path), "plot": str(plot), "identity": measured.identity, "device": measured.device,
                       "dtype": measured.dtype, "host_ms": dict(measured.host_ms)})


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
