"""`treegraft distill` (fit the scheduler MLP to rollouts) and `treegraft replay` (re-price policies)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..atomic import ensure_writable_dir
from ..scheduling.artifact import load_scheduler
from ..scheduling.cost_profile import load_cost_profile, profile_from_document
from ..scheduling.distill import DistillSettings
from ..scheduling.distill import distill as run_distill
from ..scheduling.replay import FIXED_POLICIES
from ..scheduling.replay import replay as run_replay
from ..scheduling.shards import read_rollouts
from . import console


def distill(
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollout directory from `treegraft collect`.")],
    out: Annotated[Path, typer.Option("--out", help="Scheduler artifact (JSON) to write.")],
    holdout: Annotated[float, typer.Option("--holdout", help="Share of prompts held out for testing.")] = 0.2,
    epochs: Annotated[int, typer.Option("--epochs", help="Full-batch Adam epochs.")] = 400,
    seed: Annotated[int, typer.Option("--seed", help="Split and initialisation seed.")] = 0,
    cost: Annotated[list[Path] | None, typer.Option("--cost", help="Extra cost profile(s) to re-price the rollouts under (hardware-aware training).")] = None,
) -> None:
    """Fit the 17→64→32→1 MLP to the value margins; held-out sign accuracy and regret; write the artifact."""
    if not 0 < holdout < 1 or epochs < 1:
        raise typer.BadParameter("--holdout in (0, 1) and --epochs >= 1")
    ensure_writable_dir(out.parent)
    settings_doc, table = read_rollouts(rollouts)
    costs = profile_from_document(settings_doc["cost_profile"], f"{rollouts}/collect.json")
    extra = [load_cost_profile(path) for path in cost or ()]
    identity = {"identity": costs.identity, "device": costs.device, "dtype": costs.dtype, "pair": costs.pair,
                "also_priced_under": [p.identity for p in extra]}
    settings = DistillSettings(holdout=holdout, epochs=epochs, seed=seed)
    scheduler = run_distill(table, settings_doc["tree"], [costs, *extra], settings, identity)
    scheduler.save(out)
    held = scheduler.report["held_out"]
    console.table(f"held-out decisions: {held['rows']} rows from {held['prompts']} prompts, sign accuracy {held['sign_accuracy']:.3f} "
                  f"(commoner sign: {held['majority_sign_accuracy']:.3f})",
                  ["policy", "mean value (tok/s)", "regret (tok/s)", "call rate"],
                  [(name, p["value"], p["regret"], p["call_rate"]) for name, p in held["policies"].items()])
    console.json_line({"scheduler": str(out), "cost_profile": costs.identity, "held_out": held,
                       "train_sign_accuracy": scheduler.report["train"]["sign_accuracy"]})


def replay(
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollout directory from `treegraft collect`.")],
    cost: Annotated[Path | None, typer.Option("--cost", help="Cost profile to price under (default: the collection's).")] = None,
    scheduler: Annotated[Path | None, typer.Option("--scheduler", help="Distilled scheduler: adds policy `learned`.")] = None,
    policies: Annotated[str | None, typer.Option("--policies", help="Semicolon list, e.g. 'always-call;fixed:1,2;learned'.")] = None,
) -> None:
    """Estimate each policy's speedup from rollouts under a cost profile, without running a model."""
    settings_doc, table = read_rollouts(rollouts)
    profile = load_cost_profile(cost) if cost else profile_from_document(settings_doc["cost_profile"], f"{rollouts}/collect.json")
    learned = load_scheduler(scheduler) if scheduler else None
    chosen = [p.strip() for p in policies.split(";") if p.strip()] if policies else [*FIXED_POLICIES, *(["learned"] if learned else [])]
    results = run_replay(table, settings_doc["tree"], profile, chosen, learned)
    console.table(f"replayed under {profile.device}, {profile.dtype} ({profile.identity}); {len(table)} decisions",
                  ["policy", "est. speedup", "tok/s (modelled)", "τ", "call rate"],
                  [(r.policy, f"{r.speedup:.2f}x", r.tokens_per_s, r.tau, r.call_rate) for r in results])
    console.json_line({"cost_profile": profile.identity, "results": [r.as_dict() for r in results]})
