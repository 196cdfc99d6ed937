"""`treegraft collect`: decode prompts and label each sampled layer decision with V(call) − V(skip)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer
from datasets.utils.logging import disable_progress_bar

from ..atomic import ensure_writable_dir
from ..bench.suites import BENCHMARKS, suite_questions
from ..config import parse_options
from ..methods import METHODS, check_method
from ..pipeline import Pipeline
from ..scheduling.cost_profile import CostProfile, load_cost_profile, profile_from_document
from ..scheduling.profiler import ProfileSettings, measure_profile
from ..scheduling.registry import make_policy
from ..scheduling.rollouts import POLICY_ITSELF, CollectSettings, parse_shard
from ..scheduling.rollouts import collect as run_collect
from ..scheduling.shards import FORMATS, SETTINGS_FILE, read_settings
from . import console
from .options import FirstPrompt, Linear, MethodOptions, Thinking
from .resolve import has_drafter, resolve_run

QUICK_CONTEXTS = (128,)  # the in-process profile when no --cost is given: one short context


def collect(
    out: Annotated[Path, typer.Option("--out", help="Rollout directory (resumable: a rerun skips finished prompts).")],
    pair: Annotated[str | None, typer.Option("--pair", help="DRAFTER:TARGET; its bundled profile supplies settings.")] = None,
    profile: Annotated[str | None, typer.Option("--profile", help="Pair profile name or YAML path.")] = None,
    suite: Annotated[str, typer.Option("--suite", help=f"quick | full | comma list of {', '.join(BENCHMARKS)}.")] = "quick",
    prompts: Annotated[list[Path] | None, typer.Option("--prompts", help="FastChat question file(s); replace --suite.")] = None,
    num_prompts: Annotated[int | None, typer.Option("--num-prompts", help="Questions per benchmark file.")] = None,
    first_prompt: FirstPrompt = 1,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens", "-n", help="Tokens per turn.")] = None,
    cost: Annotated[Path | None, typer.Option("--cost", help="Cost profile from `treegraft profile` (default: a quick one measured now).")] = None,
    shard: Annotated[str, typer.Option("--shard", help="i/n: this worker takes every n-th prompt from the i-th (0-based).")] = "0/1",
    policy: Annotated[str, typer.Option("--policy", help="The real policy that drives decoding.")] = "cost-aware",
    continuation: Annotated[str, typer.Option("--continuation", help="Policy after the probed layer: 'policy' (the real one, on-policy labels) or a fixed one such as all-small.")] = POLICY_ITSELF,
    every: Annotated[int, typer.Option("--every", help="Probe every k-th step.")] = 1,
    decide: Annotated[str, typer.Option("--decide", help="Label each layer's call or skip ('layer', the paper's) or each step's kind ('step').")] = "layer",
    fmt: Annotated[str, typer.Option("--format", help=f"Shard format: {' | '.join(FORMATS)}.")] = "parquet",
    dtype: Annotated[str | None, typer.Option("--dtype", help="bf16 | fp16 | fp32.")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu | cuda | auto.")] = None,
    budget: Annotated[int | None, typer.Option("--budget", "-N", help="Tree budget override.")] = None,
    depth: Annotated[int | None, typer.Option("--depth", "-D", help="Tree depth override.")] = None,
    tree_top_k: Annotated[int | None, typer.Option("--tree-top-k", "-K", help="Frontier width override.")] = None,
    options: MethodOptions = None,
    thinking: Thinking = None,
    linear: Linear = None,
) -> None:
    """Offline value rollouts for the TreeGraft scheduler: features, actions, values, margins, in shards."""
    disable_progress_bar()  # one bar per shard write from datasets would drown the collect bar
    if every < 1:
        raise typer.BadParameter("--every must be >= 1")
    if decide not in ("layer", "step"):
        raise typer.BadParameter("--decide must be layer or step")
    index_count = parse_shard(shard)
    run = resolve_run(pair, profile, dtype, device, max_new_tokens, 0.0, budget, depth, tree_top_k, thinking, linear=linear)
    method_options = {**run.method_options.get("treegraft", {}), **parse_options(options or ()), "policy": policy}
    config = dataclasses.replace(run.config, method="treegraft", method_options=method_options)
    check_method(config, has_drafter(run.pair))  # a typo in --policy or -o fails before any model loads
    if continuation != POLICY_ITSELF:
        make_policy(continuation, METHODS["treegraft"].parse_options(method_options))
    settings = CollectSettings(run.pair, run.dtype, config, continuation, every, fmt, decide)
    questions = suite_questions(suite, prompts or (), num_prompts, first_prompt)
    ensure_writable_dir(out)
    with console.fetch_progress() as progress:
        pipeline = Pipeline.load(run.pair, run.dtype, run.device, progress, run.thinking, run.linear)
    costs, measured = _costs(cost, out, pipeline, run.pair, run.dtype, config)
    with console.counter_progress() as update:
        report = run_collect(pipeline, questions, settings, costs, out, index_count, update, costs_measured=measured)
    console.json_line({"out": str(out), "shard": shard, **dataclasses.asdict(report)})


def _costs(path: Path | None, out: Path, pipeline: Pipeline, pair: str, dtype: str, config) -> tuple[CostProfile, bool]:
    """``--cost``; else the profile a previous run of this directory measured (resume keeps labels comparable);
    else a quick in-process profile at the tree's sizes (True: measured here, yields to a profile another
    worker records first)."""
    if path is not None:
        return load_cost_profile(path), False
    if (out / SETTINGS_FILE).is_file():
        return profile_from_document(read_settings(out)["cost_profile"], str(out / SETTINGS_FILE)), False
    tree = config.tree
    tokens = tuple(sorted({1, 2 * tree.top_k, tree.budget + 1}))
    settings = ProfileSettings(tokens, QUICK_CONTEXTS, warmup=1, repeats=3, width=tree.top_k)
    drafter = pipeline.drafter.model if pipeline.drafter is not None else None
    console.info("no --cost given: measuring a quick cost profile (tree sizes only, one context)")
    return measure_profile(pair, dtype, pipeline.target.model, drafter, settings), True
