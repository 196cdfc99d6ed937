"""`treegraft distill` (fit the scheduler MLP to rollouts) and `treegraft replay` (re-price policies)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..atomic import ensure_writable_dir
from ..scheduling.artifact import load_scheduler
from ..scheduling.cost_profile import load_cost_profile, profile_from_document
from ..scheduling.distill import VALUE_RATE, DistillSettings
from ..scheduling.distill import distill as run_distill
from ..scheduling.options import parse_layers
from ..scheduling.policies import FEATURE_SETS
from ..scheduling.replay import (
    FIXED_POLICIES,
    load_results,
    measured_speedups,
    parse_matches,
    replay_steps,
    step_policies,
)
from ..scheduling.replay import replay as run_replay
from ..scheduling.shards import read_iterations, read_rollouts
from . import console


def distill(
    rollouts: Annotated[list[Path], typer.Option("--rollouts", help="Rollout directory from `treegraft collect`; repeat it for the iterations of on-policy collection.")],
    out: Annotated[Path, typer.Option("--out", help="Scheduler artifact (JSON) to write.")],
    holdout: Annotated[float, typer.Option("--holdout", help="Share of prompts held out for testing.")] = 0.2,
    epochs: Annotated[int, typer.Option("--epochs", help="Full-batch Adam epochs.")] = DistillSettings.epochs,
    seed: Annotated[int, typer.Option("--seed", help="Split and initialisation seed.")] = 0,
    folds: Annotated[int, typer.Option("--folds", help="K > 1: K-fold cross-validation over prompts for the report (the artifact then fits every prompt).")] = 0,
    cost: Annotated[list[Path] | None, typer.Option("--cost", help="Extra cost profile(s) to re-price the rollouts under (hardware-aware training).")] = None,
    features: Annotated[str, typer.Option("--features", help=f"Feature set: {' | '.join(FEATURE_SETS)} (extended adds what the recent steps measured).")] = "paper",
    huber_delta: Annotated[float, typer.Option("--huber-delta", help="Huber loss threshold on standardised margins (0: squared error).")] = DistillSettings.huber_delta,
    residual: Annotated[bool, typer.Option("--residual", help="Per-step rollouts of a step-rule policy: learn a correction to the rule's own margins.")] = False,
    catch_up_share: Annotated[float, typer.Option("--catch-up-share", help="Per-step rollouts: share of a strong step's catch-up on unseen text its label charges.")] = DistillSettings.catch_up_share,
) -> None:
    """Fit the features→64→32→1 MLP to the value margins; held-out sign accuracy and regret; write the artifact."""
    if not 0 < holdout < 1 or epochs < 1 or folds < 0 or folds == 1 or huber_delta < 0 or not 0 <= catch_up_share <= 1:
        raise typer.BadParameter("--holdout in (0, 1), --epochs >= 1, --folds 0 (one split) or >= 2, --huber-delta >= 0, "
                                 "--catch-up-share in [0, 1]")
    if features not in FEATURE_SETS:
        raise typer.BadParameter(f"--features must be one of {', '.join(FEATURE_SETS)}")
    ensure_writable_dir(out.parent)
    settings_doc, tables = read_iterations(rollouts)
    first = rollouts[0]
    costs = profile_from_document(settings_doc["cost_profile"], f"{first}/collect.json")
    extra = [load_cost_profile(path) for path in cost or ()]
    identity = {"identity": costs.identity, "device": costs.device, "dtype": costs.dtype, "pair": costs.pair,
                "also_priced_under": [p.identity for p in extra]}
    settings = DistillSettings(holdout=holdout, epochs=epochs, seed=seed, feature_set=features, folds=folds,
                               huber_delta=huber_delta, residual=residual,
                               catch_up_share=catch_up_share)
    decide = settings_doc.get("decide", "layer")
    full_layers = parse_layers(settings_doc.get("method_options", {}).get("layers", ()))
    scheduler = run_distill(tables, settings_doc["tree"], [costs, *extra], settings, identity, [str(r) for r in rollouts],
                            decide, full_layers)
    scheduler.save(out)
    report = scheduler.report
    held = report["held_out"]
    unit = "tokens" if report["value"] == VALUE_RATE else "tok/s"
    console.table(f"{report['held_out_scope']}: {held['rows']} decisions from {held['prompts']} prompts, sign accuracy {held['sign_accuracy']:.3f} "
                  f"(commoner sign: {held['majority_sign_accuracy']:.3f}); value {report['value']}",
                  ["policy", f"mean value ({unit})", f"regret ({unit})", "call rate"],
                  [(name, p["value"], p["regret"], p["call_rate"]) for name, p in held["policies"].items()])
    if decide == "step":
        console.table(f"{report['held_out_scope']}, per step kind (value in {unit})", ["rollouts", "steps", "policy", "value", "regret", "shares"],
                      [(it["rollouts"], it["steps"], name, p["value"], p["regret"],
                        " ".join(f"{k[len('share_'):]} {v:.2f}" for k, v in p.items() if k.startswith("share_")))
                       for it in report["held_out_by_iteration"] for name, p in it["policies"].items()])
    elif len(rollouts) > 1:
        console.table("held-out regret per iteration", ["rollouts", "rows", f"mlp regret ({unit})", "mlp call rate", "oracle call rate"],
                      [(it["rollouts"], it["rows"], it["policies"]["mlp"]["regret"], it["policies"]["mlp"]["call_rate"],
                        it["oracle_call_rate"]) for it in report["held_out_by_iteration"]])
    if report["correction_scale_regret"]:
        console.table("a share of the correction added to the rule's margin, out of fold",
                      ["share", f"regret ({unit})", "shipped"],
                      [(share, regret, "yes" if float(share) == scheduler.correction_scale else "")
                       for share, regret in report["correction_scale_regret"].items()])
    console.json_line({"scheduler": str(out), "cost_profile": costs.identity, "decides": decide,
                       "correction_scale": scheduler.correction_scale,
                       "held_out_scope": report["held_out_scope"], "held_out": held,
                       "held_out_by_iteration": report["held_out_by_iteration"], "value": report["value"],
                       "train_sign_accuracy": report["train"]["sign_accuracy"]})


def replay(
    rollouts: Annotated[Path, typer.Option("--rollouts", help="Rollout directory from `treegraft collect`.")],
    cost: Annotated[Path | None, typer.Option("--cost", help="Cost profile to price under (default: the collection's).")] = None,
    scheduler: Annotated[Path | None, typer.Option("--scheduler", help="Distilled scheduler: adds policy `learned`.")] = None,
    policies: Annotated[str | None, typer.Option("--policies", help="Semicolon list, e.g. 'always-call;fixed:1,2;learned'.")] = None,
    measured: Annotated[Path | None, typer.Option("--measured", help="A bench results.json: show each policy's measured speedup beside the estimate.")] = None,
    match: Annotated[list[str] | None, typer.Option("--match", help="POLICY=CONTENDER: which bench contender a policy stands for (defaults: never-call=all-small, always-call=all-mid, collected=treegraft).")] = None,
) -> None:
    """Estimate each policy's speedup from rollouts under a cost profile, without running a model."""
    settings_doc, table = read_rollouts(rollouts)
    profile = load_cost_profile(cost) if cost else profile_from_document(settings_doc["cost_profile"], f"{rollouts}/collect.json")
    learned = load_scheduler(scheduler) if scheduler else None
    per_step = settings_doc.get("decide", "layer") == "step"
    fixed = step_policies(table) if per_step else FIXED_POLICIES
    chosen = [p.strip() for p in policies.split(";") if p.strip()] if policies else [*fixed, *(["learned"] if learned else [])]
    matches = parse_matches(match or ())
    bench = measured_speedups(load_results(measured), matches, str(measured)) if measured else {}
    results = (replay_steps if per_step else run_replay)(table, settings_doc["tree"], profile, chosen, learned)
    columns = ["policy", "est. speedup", "tok/s (modelled)", "τ", "call rate"]
    rows = [[r.policy, f"{r.speedup:.2f}x", r.tokens_per_s, r.tau, r.call_rate] for r in results]
    if measured:
        columns += ["measured", "contender"]
        for row, r in zip(rows, results, strict=True):
            found = bench.get(r.policy)
            row += [f"{found:.2f}x" if found is not None else "–", matches.get(r.policy, "") if found is not None else ""]
    console.table(f"replayed under {profile.device}, {profile.dtype} ({profile.identity}); {len(table)} decisions",
                  columns, rows)
    console.json_line({"cost_profile": profile.identity,
                       "results": [{**r.as_dict(), **({"measured_speedup": bench[r.policy], "contender": matches[r.policy]}
                                                      if r.policy in bench else {})} for r in results]})
