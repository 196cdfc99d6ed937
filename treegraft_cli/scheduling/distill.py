"""`treegraft distill`: fit the scheduler MLP to the collected margins and say how good it is.

Labels: every rollout row priced under the collection's cost profile and any extra profiles (``--cost``),
so cost features vary with the hardware they stand for (see ``decisions_from_rows``).
Split: whole prompts are held out (``holdout`` of them, at least one, seeded), so no step of a held-out
prompt is seen in training; with a single prompt, rows are split instead. With ``--folds K`` every prompt is
held out once instead: K models each predict the prompts they never saw (out-of-fold), the metrics are those
predictions' over all rows, and the artifact is fitted on every prompt. With a dozen prompts one split holds
out two, and its regret swings by more than the differences between policies; K folds measure all twelve. Training: full-batch Adam on
the mean squared error of standardised margins, seeded inside a forked RNG (the global RNG is untouched).

A residual scheduler (``--residual``) distilled with folds adds to the rule's margin the share of its correction
(0, ¼, ½ or 1: ``choose_correction_scale``) whose out-of-fold choices have the least regret; at share 0 it decides as
the rule, so a correction the held-out prompts do not bear out is not shipped.

Several rollout directories (``--rollouts A --rollouts B``: the iterations of on-policy collection, each
collected with the scheduler distilled from the ones before) are fitted as one set; the held-out metrics
are also reported per directory, so a DAgger-style loop shows its regret per iteration.

Values: V = τ − R·T (tokens, see rollouts), or τ/T for rollouts without the real step's outcome.
Metrics on the held-out rows (one row = one layer decision with the continuation, see rollouts):
sign accuracy (rows with a non-zero margin; next to it the accuracy of always guessing the commoner
sign, the bar to beat on imbalanced rollouts), and per policy the mean value it picks and its regret
= mean(max(V_call, V_skip) − V_chosen) for: the MLP (call iff predicted margin > 0), the oracle
(regret 0 by definition), always-call and never-call. The per-step call budget is not applied here.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from .artifact import HIDDEN, DistilledScheduler, Normaliser, build_mlp
from .cost_profile import CostProfile
from .policies import STEP_KIND_NAMES, kind_one_hot
from .replay import PricedSteps, price, price_steps
from .shards import table_columns
from .values import CATCH_UP_SHARE, REAL_COLUMNS


@dataclass(frozen=True)
class DistillSettings:
    holdout: float = 0.2
    # full-batch epochs: more fit the noise of single steps' outcomes (a per-step collection over 12 prompts, 511
    # steps: out-of-fold regret 0.57 tokens a step at 50 epochs, 0.63 at 400, the collecting step rule's 0.60)
    epochs: int = 50
    learning_rate: float = 3e-3
    weight_decay: float = 1e-4
    seed: int = 0
    feature_set: str = "paper"  # a key of FEATURE_SETS
    folds: int = 0  # > 1: K-fold cross-validation over prompts for the report, the artifact fitted on every prompt
    # the loss on standardised margins: Huber past this many standard deviations, squared error below (0: squared
    # error throughout). A step's label is one noisy outcome, and a few (a catch-up on a 1,000-token article: −6
    # tokens against margins mostly within ±1) would otherwise pull every nearby state's margin after them.
    huber_delta: float = 0.5
    # per-step only: the MLP learns a correction to the driving step rule's own margin of each kind (its last input),
    # not the margin from nothing; where the rollouts teach it nothing, it decides as the rule
    residual: bool = False
    # of a strong step's catch-up time, the share its label charges (per-step rollouts; see ``values.CATCH_UP_SHARE``)
    catch_up_share: float = CATCH_UP_SHARE


@dataclass(frozen=True)
class Decisions:
    """The labelled rows as tensors."""

    features: torch.Tensor  # [n, features]
    value_call: torch.Tensor  # [n]
    value_skip: torch.Tensor  # [n]
    groups: list[str]  # [n] prompt key of each row
    sources: torch.Tensor | None = None  # [n] long: which rollout directory (iteration) each row comes from

    @property
    def margins(self) -> torch.Tensor:
        return self.value_call - self.value_skip

    def subset(self, mask: torch.Tensor) -> Decisions:
        keep = mask.nonzero().flatten().tolist()
        sources = self.sources[mask] if self.sources is not None else None
        return Decisions(self.features[mask], self.value_call[mask], self.value_skip[mask], [self.groups[i] for i in keep],
                         sources)


def decisions_from_rows(table, tree: dict, profiles: Sequence[CostProfile], source: int = 0,
                        feature_set: str = "paper") -> Decisions:
    """The rows priced under each profile (the collection's first): one decision per row and profile.

    Under the collection's profile this reproduces the stored values; every further profile re-prices the
    same outcomes (and the running rate) and sets the cost features to its own, so the MLP sees how costs
    move the margin.
    """
    keys = [str(k) for k in table_columns(table)["key"]]
    parts = [price(table, profile, tree, feature_set) for profile in profiles]
    n = len(keys) * len(parts)
    return Decisions(
        torch.cat([p.features for p in parts]),
        torch.cat([p.value_call for p in parts]),
        torch.cat([p.value_skip for p in parts]),
        keys * len(parts),
        torch.full((n,), source, dtype=torch.long),
    )


def union(parts: Sequence[Decisions]) -> Decisions:
    """The decisions of several rollout directories (the iterations of on-policy collection) as one set."""
    return Decisions(
        torch.cat([p.features for p in parts]),
        torch.cat([p.value_call for p in parts]),
        torch.cat([p.value_skip for p in parts]),
        [g for p in parts for g in p.groups],
        torch.cat([p.sources for p in parts]),
    )


def step_decisions(table, tree: dict, profiles: Sequence[CostProfile], source: int = 0,
                   feature_set: str = "paper", residual: bool = False,
                   catch_up_share: float = CATCH_UP_SHARE) -> Decisions:
    """Per-step rows as pairwise decisions: each strong kind against a weak step, the kind one-hot after the
    features (what ``LearnedStepRule`` asks the MLP), and with ``residual`` the rule's margin of the kind after
    that, under every profile."""
    keys = [str(k) for k in table_columns(table)["key"]]
    parts = []
    for profile in profiles:
        priced = price_steps(table, profile, tree, feature_set, catch_up_share)
        if residual and priced.rule_margins is None:
            raise ConfigError("--residual needs the step rule's margins, and these rollouts hold none (collected under "
                              "a policy that measures none, or by an older treegraft)",
                              "collect them with `treegraft collect --decide step --policy step` (or learned:FILE)")
        for kind in STEP_KIND_NAMES:
            if kind in priced.values:
                one_hot = kind_one_hot(kind).expand(len(keys), -1)
                base = priced.rule_margins[kind][:, None] if residual else torch.zeros(len(keys), 0)
                parts.append(Decisions(torch.cat([priced.features, one_hot, base], dim=1), priced.values[kind],
                                       priced.values["weak"], keys, torch.full((len(keys),), source, dtype=torch.long)))
    return union(parts)


def evaluate_steps(
    margins: torch.Tensor,  # [kinds, n] the scheduler's margin of each kind (``priced.values`` order) over a weak step
    priced: PricedSteps,
) -> dict[str, Any]:
    """Per-step policies on ``priced``: mean value, regret against the best kind, and how often each kind is taken."""
    kinds = list(priced.values)
    values = torch.stack([priced.values[k] for k in kinds])  # [kinds, n]
    n = values.shape[1]
    choices = {"mlp": margins.argmax(0), "oracle": values.argmax(0),
               **{f"always-{k}": torch.full((n,), i) for i, k in enumerate(kinds)}}
    real = torch.tensor([kinds.index(k) if k in kinds else -1 for k in priced.real_kind])
    if bool((real >= 0).all()):
        choices["collected"] = real
    if priced.rule_margins is not None:
        choices["rule"] = priced.rule_choices()
    best = values.max(0).values
    policies = {}
    for name, chosen in choices.items():
        value = values.gather(0, chosen[None])[0]
        policies[name] = {"value": float(value.mean()), "regret": float((best - value).mean()),
                          **{f"share_{k}": float((chosen == i).float().mean()) for i, k in enumerate(kinds)}}
    return {"steps": n, "policies": policies}


def split(decisions: Decisions, holdout: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Boolean [n] masks (train, held out): whole prompts held out, or rows when there is only one prompt."""
    n = len(decisions.groups)
    keys = sorted(set(decisions.groups))
    chooser = random.Random(seed)
    if len(keys) >= 2:
        chooser.shuffle(keys)
        held = set(keys[: max(1, round(holdout * len(keys)))])
        test = torch.tensor([g in held for g in decisions.groups], dtype=torch.bool)
    else:
        rows = list(range(n))
        chooser.shuffle(rows)
        test = torch.zeros(n, dtype=torch.bool)
        test[rows[: max(1, round(holdout * n))]] = True
    if bool(test.all()):
        raise ConfigError("too few labelled decisions to hold any out for testing", "collect more prompts or tokens")
    return ~test, test


def fold_masks(decisions: Decisions, folds: int, seed: int) -> list[torch.Tensor]:
    """Boolean [n] held-out masks of ``folds`` folds: every prompt held out in exactly one (seeded shuffle)."""
    keys = sorted(set(decisions.groups))
    if len(keys) < folds:
        raise ConfigError(f"{folds} folds need at least {folds} prompts; the rollouts hold {len(keys)}",
                          "lower --folds, or collect more prompts")
    random.Random(seed).shuffle(keys)
    fold_of = {key: i % folds for i, key in enumerate(keys)}
    return [torch.tensor([fold_of[g] == i for g in decisions.groups], dtype=torch.bool) for i in range(folds)]


def fit(decisions: Decisions, settings: DistillSettings) -> tuple[torch.nn.Sequential, Normaliser]:
    # a residual MLP fits what the rule's margin (the last input) misses
    margins = decisions.margins - decisions.features[:, -1] if settings.residual else decisions.margins
    normaliser = Normaliser.fit(decisions.features, margins)
    inputs = normaliser.inputs(decisions.features)  # [n, features]
    targets = normaliser.targets(margins)  # [n]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        mlp = build_mlp(decisions.features.shape[1], HIDDEN)
        if settings.residual:  # start from no correction beyond the mean one: the rule itself
            torch.nn.init.zeros_(mlp[-1].weight)
            torch.nn.init.zeros_(mlp[-1].bias)
        optimiser = torch.optim.Adam(mlp.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
        for _ in range(settings.epochs):
            optimiser.zero_grad()
            loss = margin_loss(mlp(inputs).squeeze(-1), targets, settings.huber_delta)
            loss.backward()
            optimiser.step()
    return mlp.eval(), normaliser


def margin_loss(predicted: torch.Tensor, targets: torch.Tensor, huber_delta: float) -> torch.Tensor:  # [n], [n]
    if huber_delta > 0:
        return torch.nn.functional.huber_loss(predicted, targets, delta=huber_delta)
    return torch.nn.functional.mse_loss(predicted, targets)


def evaluate(predicted: torch.Tensor, decisions: Decisions) -> dict[str, Any]:  # predicted: [n] margins
    """Sign accuracy and per-policy mean value and regret on ``decisions``, the scheduler's margins ``predicted``."""
    margins = decisions.margins
    decided = margins != 0
    accuracy = float(((predicted > 0) == (margins > 0))[decided].float().mean()) if bool(decided.any()) else float("nan")
    best = torch.maximum(decisions.value_call, decisions.value_skip)
    choices = {"mlp": predicted > 0, "oracle": margins > 0, "always-call": torch.ones_like(decided),
               "never-call": torch.zeros_like(decided)}
    policies = {}
    for name, call in choices.items():
        chosen = torch.where(call, decisions.value_call, decisions.value_skip)
        policies[name] = {"value": float(chosen.mean()), "regret": float((best - chosen).mean()),
                          "call_rate": float(call.float().mean())}
    positive = float((margins[decided] > 0).float().mean()) if bool(decided.any()) else float("nan")
    return {"rows": len(decisions.groups), "prompts": len(set(decisions.groups)), "sign_accuracy": accuracy,
            "majority_sign_accuracy": max(positive, 1.0 - positive),  # what always guessing the commoner sign scores
            "oracle_call_rate": float((margins > 0).float().mean()), "policies": policies}


def distill(
    tables: Sequence, tree: dict, profiles: Sequence[CostProfile], settings: DistillSettings, cost_profile: dict[str, Any],
    sources: Sequence[str] = (), decide: str = "layer", full_layers: Sequence[int] = (),
) -> DistilledScheduler:
    """Fit on the training split of every table (one per iteration, ``sources`` their names), evaluate on both
    splits and on each iteration's held-out rows; the report travels inside the artifact. With
    ``settings.folds`` > 1 every prompt is held out once (K models) and the artifact is fitted on all of them.

    Prompts are held out across iterations: a prompt collected again under a later policy stays on its side.
    """
    if len({_has_rate([table]) for table in tables}) > 1:
        raise ConfigError("some rollout directories lack the real step's outcome (collected by an older treegraft)",
                          "collect them again, or distill them apart")
    if settings.residual and decide != "step":
        raise ConfigError("--residual corrects the step rule's per-step margins", "collect with --decide step")
    if decide == "step":
        decisions = union([step_decisions(table, tree, profiles, i, settings.feature_set, settings.residual,
                                          settings.catch_up_share) for i, table in enumerate(tables)])
    else:
        decisions = union([decisions_from_rows(table, tree, profiles, i, settings.feature_set)
                           for i, table in enumerate(tables)])
    names = list(sources) or [str(i) for i in range(len(tables))]
    # the per-step view of every iteration's rows, under the collection's profile
    steps = [price_steps(table, profiles[0], tree, settings.feature_set, settings.catch_up_share)
             for table in tables] if decide == "step" else []
    step_keys = [[str(k) for k in table_columns(table)["key"]] for table in tables] if decide == "step" else []

    def scheduler_for(train: Decisions) -> DistilledScheduler:
        mlp, normaliser = fit(train, settings)
        return DistilledScheduler(mlp, normaliser, cost_profile, feature_set=settings.feature_set, decides=decide,
                                  full_layers=tuple(full_layers), residual=settings.residual)

    scale_regret: dict[float, float] = {}  # a residual scheduler's out-of-fold regret per share of its correction
    if settings.folds > 1:  # every prompt predicted by the fold's model that never saw it; the artifact sees all
        held = fold_masks(decisions, settings.folds, settings.seed)
        schedulers = [scheduler_for(decisions.subset(~mask)) for mask in held]
        scheduler = scheduler_for(decisions)
        fold_of = {g: i for i, mask in enumerate(held) for g, h in zip(decisions.groups, mask.tolist(), strict=True) if h}
        step_models = [[schedulers[fold_of[k]] for k in keys] for keys in step_keys]
        if settings.residual:  # the share of the correction that decides best on prompts its fold never saw
            full = [_step_margins(priced, models) for priced, models in zip(steps, step_models, strict=True)]
            scale, scale_regret = choose_correction_scale([margins for margins, _ in full], [kept for _, kept in full])
            for model in (*schedulers, scheduler):
                model.correction_scale = scale
        train, test = decisions, decisions
        predicted = torch.zeros(len(decisions.groups))
        for mask, fold in zip(held, schedulers, strict=True):
            predicted[mask] = fold.predict(decisions.features[mask])
        held_out_scope = f"{settings.folds}-fold cross-validation over prompts"
    else:
        train_mask, test_mask = split(decisions, settings.holdout, settings.seed)
        train, test = decisions.subset(train_mask), decisions.subset(test_mask)
        scheduler = scheduler_for(train)
        predicted = scheduler.predict(test.features)
        test_keys = set(test.groups)
        step_models = [[scheduler if k in test_keys else None for k in keys] for keys in step_keys]
        held_out_scope = "held-out prompts"
    if decide == "step":
        by_iteration = [{"rollouts": name, **evaluate_steps(*_step_margins(priced, models))}
                        for name, priced, models in zip(names, steps, step_models, strict=True)
                        if any(m is not None for m in models)]
    else:
        by_iteration = [{"rollouts": name, **evaluate(predicted[test.sources == i], test.subset(test.sources == i))}
                        for i, name in enumerate(names) if bool((test.sources == i).any())]
    scheduler.report = {"train": evaluate(scheduler.predict(train.features), train), "held_out": evaluate(predicted, test),
                        "held_out_scope": held_out_scope, "held_out_by_iteration": by_iteration,
                        "value": VALUE_RATE if _has_rate(tables) else VALUE_RATIO,
                        "correction_scale_regret": {str(k): v for k, v in scale_regret.items()},
                        "settings": {"holdout": settings.holdout, "folds": settings.folds, "epochs": settings.epochs,
                                     "seed": settings.seed, "features": settings.feature_set,
                                     "huber_delta": settings.huber_delta, "residual": settings.residual,
                                     "catch_up_share": settings.catch_up_share}}
    return scheduler


CORRECTION_SCALES = (0.0, 0.25, 0.5, 1.0)  # shares of a residual scheduler's correction ``distill --folds`` weighs


def choose_correction_scale(
    margins: Sequence[torch.Tensor],  # per iteration: [kinds, n] out-of-fold margins with the whole correction
    priced: Sequence[PricedSteps],  # the same steps (with the rule's margins)
) -> tuple[float, dict[float, float]]:
    """The share of a residual scheduler's correction whose choices have the least out-of-fold regret over every
    iteration's steps, ties to the smaller share (nearer the rule), and each share's regret.

    The margin at share s is the rule's plus s times the correction. Share 0 is the rule itself, so a correction that
    the held-out prompts do not bear out is not shipped: the scheduler then decides as the rule."""
    regret = {}
    for scale in CORRECTION_SCALES:
        total, steps = 0.0, 0
        for whole, kept in zip(margins, priced, strict=True):
            rule = torch.stack([kept.rule_margins[kind] for kind in kept.values])  # [kinds, n]
            result = evaluate_steps(rule + scale * (whole - rule), kept)
            total += result["policies"]["mlp"]["regret"] * result["steps"]
            steps += result["steps"]
        regret[scale] = total / max(steps, 1)
    return min(regret, key=lambda scale: (regret[scale], scale)), regret


def _step_margins(priced: PricedSteps, models: Sequence[DistilledScheduler | None]) -> tuple[torch.Tensor, PricedSteps]:
    """The held-out steps of ``priced`` (those with a model, the one that did not see them) and their kind margins."""
    keep = torch.tensor([m is not None for m in models])
    subset = priced.subset(keep)
    kinds = list(priced.values)
    margins = torch.zeros(len(kinds), int(keep.sum()))  # [kinds, held-out steps]
    chosen = [m for m in models if m is not None]
    for model in {id(m): m for m in chosen}.values():
        rows = torch.tensor([m is model for m in chosen])
        rule = {k: v[rows] for k, v in subset.rule_margins.items()} if subset.rule_margins is not None else None
        margins[:, rows] = model.kind_margins(subset.features[rows], kinds, rule)
    return margins, subset


VALUE_RATE = "tau - R*T (tokens)"  # see rollouts: the value decoding maximises
VALUE_RATIO = "1000*tau/T (tokens per modelled second; rollouts without the real step's outcome)"


def _has_rate(tables: Sequence) -> bool:
    return all(all(name in table.column_names for name in REAL_COLUMNS) for table in tables)
