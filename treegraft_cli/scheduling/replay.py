"""Replay: a policy's speedup estimated from rollouts under any cost profile, without running a model.

Every rollout row holds, for one layer decision, the outcome of both actions: τ, tree nodes, strong calls
and weak layers. Under a cost profile P each outcome's modelled time is re-priced with P (see
``CostProfile.step_ms``) and plain decoding costs P's 1-token target forward per token. A policy picks one
action per row; its estimated speedup over autoregressive decoding is

    Σ τ_chosen · ar_ms(context) / Σ T_chosen

Policies: ``always-call``, ``never-call``, ``oracle`` (the action of larger value under P, ``values``), ``collected`` (what the
real policy did), ``fixed:1,3`` (call at those layers) and ``learned`` (a distilled scheduler, whose cost
features are replaced by P's so it sees the hardware it is replayed on). It is a decision-level estimate:
each row changes one layer's action with the collection's continuation after it, not a whole policy run.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ..errors import ConfigError
from .artifact import DistilledScheduler
from .cost_profile import CostProfile
from .costs import COST_CONTEXT
from .options import parse_layers
from .shards import table_columns
from .values import CATCH_UP_SHARE, LAG_COLUMN, REAL_COLUMNS, decision_values, running_rates

FIXED_POLICIES = ("always-call", "never-call", "oracle", "collected")
# the bench contender each replay policy stands for when a bench's results are given (``measured_speedups``)
DEFAULT_MATCHES = MappingProxyType({"never-call": "all-small", "always-call": "all-mid", "collected": "treegraft",
                                    "always-weak": "all-small"})


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    speedup: float  # estimated vs autoregressive under the profile
    tokens_per_s: float  # modelled
    tau: float  # mean accepted length of the chosen trees
    call_rate: float  # share of rows where the policy calls

    def as_dict(self) -> dict:
        return {"policy": self.policy, "speedup": self.speedup, "tokens_per_s": self.tokens_per_s,
                "tau": self.tau, "call_rate": self.call_rate}


@dataclass(frozen=True)
class Priced:
    """The rows re-priced under one profile; all [n]."""

    tau_call: torch.Tensor
    tau_skip: torch.Tensor
    ms_call: torch.Tensor
    ms_skip: torch.Tensor
    ar_ms: torch.Tensor
    layers: torch.Tensor
    real_call: torch.Tensor
    features: torch.Tensor  # [n, 17] with the cost features of the profile
    rate: torch.Tensor | None = None  # [n] the collecting policy's running rate R (tokens per ms); None: old rollouts

    @property
    def value_call(self) -> torch.Tensor:  # [n]
        return decision_values(self.tau_call, self.ms_call, self.rate)

    @property
    def value_skip(self) -> torch.Tensor:  # [n]
        return decision_values(self.tau_skip, self.ms_skip, self.rate)


class Pricing:
    """One table's rows under one cost profile: any action's modelled ms, the running rate, the features."""

    def __init__(self, table, profile: CostProfile, tree: dict, feature_set: str = "paper",
                 catch_up_share: float = CATCH_UP_SHARE):
        self.catch_up_share = catch_up_share  # of a strong step's catch-up time, charged to the step (labels' times)
        self.table = table_columns(table)
        self.profile = profile
        self.width, self.budget = int(tree["top_k"]), int(tree["budget"])
        self.contexts = [int(c) for c in self.table["context_length"]]
        self.feature_set = feature_set

    def ms(self, action: str, catch_up_share: float | None = None) -> torch.Tensor:  # [n]
        share = self.catch_up_share if catch_up_share is None else catch_up_share
        table = self.table
        nodes, calls, weak = table[f"nodes_{action}"], table[f"calls_{action}"], table[f"weak_{action}"]
        lags = table.get(LAG_COLUMN) or [0] * len(nodes)  # rollouts collected before the lag was stored: none
        # rollouts collected before each call's forwarded nodes were stored: 2·K a call
        forwarded = table.get(f"forwarded_{action}") or [None] * len(nodes)
        return torch.tensor([self.profile.step_ms(n + 1, c, w, self.width, ctx, lag, f, share) for n, c, w, ctx, lag, f
                             in zip(nodes, calls, weak, self.contexts, lags, forwarded, strict=True)])

    def tau(self, action: str) -> torch.Tensor:  # [n]
        return torch.tensor(self.table[f"tau_{action}"], dtype=torch.float32)

    def rate(self, catch_up_share: float | None = None) -> torch.Tensor | None:  # [n] R of each row's generation
        """None for rows without the real outcome."""
        table = self.table
        if not all(name in table for name in REAL_COLUMNS):
            return None
        generations = list(zip(table["key"], table["turn"], strict=True))
        return running_rates(generations, table["step"], self.tau("real"), self.ms("real", catch_up_share))

    def features(self) -> torch.Tensor:  # [n, features] with the profile's cost features
        table = self.table
        features = torch.tensor(table["features"], dtype=torch.float32)
        costs = self.profile.cost_model(self.budget, self.width, COST_CONTEXT)
        features[:, 1:4] = torch.tensor([costs.verify_ms, costs.strong_ms, costs.log_ratio])
        if self.feature_set == "paper":
            return features
        if "history" not in table or LAG_COLUMN not in table or "preview" not in table:
            raise ConfigError("these rollouts hold no history or preview features or strong lag (collected by an older "
                              "treegraft)", "collect them again, or distill with --features paper")
        history = torch.tensor(table["history"], dtype=torch.float32)
        lag = torch.tensor(table[LAG_COLUMN], dtype=torch.float32).log1p()[:, None]
        preview = torch.tensor(table["preview"], dtype=torch.float32)
        return torch.cat([features, history, lag, preview], dim=1)

    def rule_margins(self, kinds: Sequence[str]) -> dict[str, torch.Tensor] | None:  # kind → [n] tokens
        """The driving step rule's margin of each kind over a weak step, as it weighed them (``rollouts.rule_columns``),
        moved to this profile: its τ as measured, its times T and rate R each scaled by how this profile prices the
        row against the collection's (the kind's probed tree, the generation's running rate). Under the collection's
        profile the scale is 1, and it prices the catch-up as the collection did, whatever share the labels charge: the
        margin is the rule's as it decided. None for rollouts that hold none (another driving policy, an older
        treegraft)."""
        table = self.table
        names = ["rule_rate", "rate", *(f"rule_{q}_{k}" for k in kinds for q in ("tau", "ms"))]
        if any(name not in table or any(v is None for v in table[name]) for name in names):
            return None

        def column(name: str) -> torch.Tensor:
            return torch.tensor(table[name], dtype=torch.float32)

        rate = column("rule_rate") * self.rate(CATCH_UP_SHARE) / column("rate").clamp(min=1e-12)
        values = {}
        for kind in kinds:
            priced = self.ms(f"kind_{kind}", CATCH_UP_SHARE)
            ms = column(f"rule_ms_{kind}") * priced / column(f"ms_kind_{kind}").clamp(min=1e-9)
            values[kind] = column(f"rule_tau_{kind}") - rate * ms
        return {kind: value - values["weak"] for kind, value in values.items()}

    def ar_ms(self) -> torch.Tensor:  # [n] plain decoding's ms per token at each row's context
        return torch.tensor([self.profile.target_forward_ms(1, c) for c in self.contexts])


def price(table, profile: CostProfile, tree: dict, feature_set: str = "paper") -> Priced:
    """Every row's outcomes re-priced under ``profile``: times, the running rate and the cost features
    (``feature_set``: the paper's 17 features, or ``extended`` with the rows' history features and strong lag after them)."""
    pricing = Pricing(table, profile, tree, feature_set)
    return Priced(
        tau_call=pricing.tau("call"),
        tau_skip=pricing.tau("skip"),
        ms_call=pricing.ms("call"),
        ms_skip=pricing.ms("skip"),
        ar_ms=pricing.ar_ms(),
        layers=torch.tensor(pricing.table["layer"]),
        real_call=torch.tensor(pricing.table["real_call"], dtype=torch.bool),
        features=pricing.features(),
        rate=pricing.rate(),
    )


@dataclass(frozen=True)
class PricedSteps:
    """Per-step rows (``collect --decide step``) under one profile: each step kind's value; all [n]."""

    values: Mapping[str, torch.Tensor]  # kind → V = τ − R·T (or τ/T without the real outcome)
    features: torch.Tensor  # [n, features] the layer-1 features
    real_kind: list[str]  # the kind the collecting policy took ("" when its step matched none)
    tau: Mapping[str, torch.Tensor]  # kind → accepted length
    ms: Mapping[str, torch.Tensor]  # kind → modelled step ms
    ar_ms: torch.Tensor  # plain decoding's ms per token
    rule_margins: Mapping[str, torch.Tensor] | None = None  # kind → the driving step rule's margin over weak

    def subset(self, mask: torch.Tensor) -> PricedSteps:
        keep = mask.nonzero().flatten().tolist()
        names = ("values", "tau", "ms", "rule_margins") if self.rule_margins is not None else ("values", "tau", "ms")
        pick = {name: {k: v[mask] for k, v in getattr(self, name).items()} for name in names}
        return PricedSteps(pick["values"], self.features[mask], [self.real_kind[i] for i in keep], pick["tau"],
                           pick["ms"], self.ar_ms[mask], pick.get("rule_margins"))

    def rule_choices(self) -> torch.Tensor:  # [n] index into ``values``' kinds
        """The driving rule's own choice at each step (the kind of largest margin), without its explorations."""
        if self.rule_margins is None:
            raise ConfigError("policy 'rule' needs rollouts collected under a step-rule policy",
                              "collect them with `treegraft collect --decide step --policy step`")
        return torch.stack([self.rule_margins[k] for k in self.values]).argmax(0)


def price_steps(table, profile: CostProfile, tree: dict, feature_set: str = "paper",
                catch_up_share: float = CATCH_UP_SHARE) -> PricedSteps:
    """Per-step rows under ``profile``, a strong step's catch-up charged at ``catch_up_share`` of its time."""
    pricing = Pricing(table, profile, tree, feature_set, catch_up_share)
    kinds = [name[len("tau_kind_"):] for name in pricing.table if name.startswith("tau_kind_")]
    if not kinds:
        raise ConfigError("these rollouts hold no per-step rows", "collect them with `treegraft collect --decide step`")
    rate = pricing.rate()
    tau = {k: pricing.tau(f"kind_{k}") for k in kinds}
    ms = {k: pricing.ms(f"kind_{k}") for k in kinds}
    values = {k: decision_values(tau[k], ms[k], rate) for k in kinds}
    calls = {k: pricing.table[f"calls_kind_{k}"] for k in kinds}
    real = [next((k for k in kinds if calls[k][i] == c), "") for i, c in enumerate(pricing.table["calls_real"])]
    return PricedSteps(values, pricing.features(), real, tau, ms, pricing.ar_ms(), pricing.rule_margins(kinds))


def step_policies(table) -> list[str]:
    """The fixed per-step policies of a per-step rollout table: always-KIND for each kind it holds, oracle, collected."""
    kinds = [name[len("tau_kind_"):] for name in table.column_names if name.startswith("tau_kind_")]
    rule = ["rule"] if "rule_rate" in table.column_names else []
    return [*(f"always-{k}" for k in kinds), "oracle", "collected", *rule]


def choose_kind(policy: str, priced: PricedSteps, scheduler: DistilledScheduler | None) -> list[str]:
    """[n] the step kind ``policy`` takes at each per-step row."""
    kinds = list(priced.values)
    n = priced.features.shape[0]
    if policy == "oracle":
        return [kinds[i] for i in torch.stack([priced.values[k] for k in kinds]).argmax(0).tolist()]
    if policy == "collected":
        return [k or "weak" for k in priced.real_kind]
    if policy == "rule":
        return [kinds[i] for i in priced.rule_choices().tolist()]
    if policy.startswith("always-") and policy[len("always-"):] in kinds:
        return [policy[len("always-"):]] * n
    if policy == "learned":
        if scheduler is None or scheduler.decides != "step":
            raise ConfigError("policy 'learned' on per-step rollouts needs a per-step scheduler",
                              "pass --scheduler FILE from `treegraft distill` of `collect --decide step` rollouts")
        return [kinds[i] for i in scheduler.kind_margins(priced.features, kinds, priced.rule_margins).argmax(0).tolist()]
    raise ConfigError(f"unknown per-step replay policy {policy!r}",
                      f"use oracle, collected, rule, learned or always-KIND with KIND one of {', '.join(kinds)}")


def replay_steps(table, tree: dict, profile: CostProfile, policies: Sequence[str],
                 scheduler: DistilledScheduler | None = None) -> list[ReplayResult]:
    """``replay`` for per-step rollouts: each policy's chosen kinds, Σ τ·ar_ms / Σ T (call rate: share of strong kinds)."""
    priced = price_steps(table, profile, tree, scheduler.feature_set if scheduler is not None else "paper")
    results = []
    for policy in policies:
        chosen = choose_kind(policy, priced, scheduler)
        tau = torch.stack([priced.tau[k][i] for i, k in enumerate(chosen)])
        ms = torch.stack([priced.ms[k][i] for i, k in enumerate(chosen)])
        total_ms = float(ms.sum())
        speedup = float((tau * priced.ar_ms).sum()) / total_ms if total_ms > 0 else math.nan
        strong = sum(k != "weak" for k in chosen) / max(1, len(chosen))
        results.append(ReplayResult(policy, speedup, 1000.0 * float(tau.sum()) / total_ms, float(tau.mean()), strong))
    return results


def choose(policy: str, priced: Priced, scheduler: DistilledScheduler | None) -> torch.Tensor:
    """[n] bool: where ``policy`` calls."""
    value_call, value_skip = priced.value_call, priced.value_skip
    name, _, argument = policy.partition(":")
    if name == "always-call":
        return torch.ones_like(priced.real_call)
    if name == "never-call":
        return torch.zeros_like(priced.real_call)
    if name == "oracle":
        return value_call > value_skip
    if name == "collected":
        return priced.real_call
    if name == "fixed":
        return torch.isin(priced.layers, torch.tensor(parse_layers(argument), dtype=torch.long))
    if name == "learned":
        if scheduler is None:
            raise ConfigError("policy 'learned' needs a scheduler artifact", "pass --scheduler FILE")
        return scheduler.predict(priced.features) > 0
    raise ConfigError(f"unknown replay policy {policy!r}", f"use {', '.join(FIXED_POLICIES)}, fixed:1,3 or learned")


def replay(table, tree: dict, profile: CostProfile, policies: Sequence[str], scheduler: DistilledScheduler | None = None) -> list[ReplayResult]:
    priced = price(table, profile, tree, scheduler.feature_set if scheduler is not None else "paper")
    results = []
    for policy in policies:
        call = choose(policy, priced, scheduler)
        tau = torch.where(call, priced.tau_call, priced.tau_skip)
        ms = torch.where(call, priced.ms_call, priced.ms_skip)
        total_ms = float(ms.sum())
        speedup = float((tau * priced.ar_ms).sum()) / total_ms if total_ms > 0 else math.nan
        results.append(ReplayResult(policy, speedup, 1000.0 * float(tau.sum()) / total_ms, float(tau.mean()),
                                    float(call.float().mean())))
    return results


def measured_speedups(results: Mapping[str, Any], matches: Mapping[str, str], source: str = "results") -> dict[str, float]:
    """Policy → the measured speedup over the bench's baseline of the contender it stands for (``matches``:
    policy → contender name in a bench ``results.json``); policies whose contender the bench did not run are left out.

    Replay estimates each policy from single-decision deviations on the rollouts' prompts; the bench runs the
    whole policy on its own prompts. Side by side they show how far the value system can be trusted."""
    methods = results.get("methods") if isinstance(results, Mapping) else None
    if not isinstance(methods, Mapping):
        raise ConfigError(f"{source} is not a bench results.json (no 'methods')", "pass the results.json `treegraft bench` wrote")
    found = {}
    for policy, contender in matches.items():
        speedup = methods.get(contender, {}).get("speedup") if isinstance(methods.get(contender), Mapping) else None
        if isinstance(speedup, int | float) and math.isfinite(speedup):
            found[policy] = float(speedup)
    return found


def load_results(path: Path) -> Any:
    """A bench results.json as read from disk (``measured_speedups`` checks its shape)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"bench results {path} do not exist", "pass the results.json `treegraft bench --out DIR` wrote") from None
    except json.JSONDecodeError:
        raise ConfigError(f"{path} is not valid JSON", "pass the results.json `treegraft bench --out DIR` wrote") from None


def parse_matches(texts: Sequence[str]) -> dict[str, str]:
    """``POLICY=CONTENDER`` pairs over the defaults (``DEFAULT_MATCHES``)."""
    matches = dict(DEFAULT_MATCHES)
    for text in texts:
        policy, sep, contender = text.partition("=")
        if not sep or not policy.strip() or not contender.strip():
            raise ConfigError(f"--match {text!r} is not POLICY=CONTENDER", "e.g. --match learned=treegraft")
        matches[policy.strip()] = contender.strip()
    return matches
