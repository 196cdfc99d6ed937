"""The distilled scheduler: a ReLU MLP (features → 64 → 32 → 1) over standardised features, and its artifact file.

The artifact is one JSON file (no pickle: loading runs no code)::

    kind: treegraft-scheduler, version: 1
    feature_names: the inputs in order, one of ``scheduling.policies.FEATURE_SETS`` (checked on load): the
        paper's 17, or those, the 6 history features and the strong drafter's lag (``extended``); a per-step scheduler adds the kind it prices
    decides: layer (call or skip at each layer; ``LearnedLayerRule``) or step (the step's kind, at layer 1;
        ``LearnedStepRule``)
    full_layers: the layers a full strong step called at in the per-step rollouts
    residual: a per-step scheduler whose last input, ``rule_margin``, is the step rule's own margin of the kind over a
        weak step (``MeasuredValues.margins``), and whose margin is that plus the MLP's output: it learns a correction
        to the rule, not the margin from nothing
    correction_scale: a residual scheduler's margin is the rule's plus this share of the MLP's correction (0, ¼, ½
        or 1, the one of least out-of-fold regret in ``distill --folds K``; 1 when distilled without folds)
    feature_mean, feature_scale: z = clip((x − mean) · scale, ±5); scale = 1/std, 0 for a feature that was
        constant in the rollouts (e.g. the cost features of a single-profile collection) — it carried no
        information, so a different value at run time must not push the MLP off its training range
    margin_mean, margin_std: margin = mlp(z) · std + mean (in the units of the report's value: tokens, or tokens
        per modelled second for rollouts without the real step's outcome)
    layers: [{weight, bias}, ...]
    cost_profile: {identity, device, dtype, pair} the rollouts' labels were modelled under
    report: the held-out metrics of ``treegraft distill``

``treegraft`` loads it with ``-o scheduler=FILE`` (or ``policy=learned:FILE``) and calls where the de-standardised
margin exceeds ``min_margin`` (default 0), measuring and trimming as the step rule does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..atomic import atomic_write_text
from ..errors import ConfigError
from .options import TreeGraftConfig
from .policies import FEATURE_NAMES, FEATURE_SETS, STEP_KIND_FEATURE_NAMES, CallPolicy, kind_one_hot
from .step_rule import LearnedLayerRule, LearnedStepRule

KIND = "treegraft-scheduler"
RULE_MARGIN_FEATURE = "rule_margin"  # a residual scheduler's last input: the step rule's margin of the kind
HIDDEN = (64, 32)
CLIP = 5.0  # standardised inputs are clipped to ±CLIP: a feature far outside the rollouts' range (another
# device's costs, an unseen prompt length) saturates instead of driving the MLP into untrained territory
FIX = "write it with `treegraft distill --rollouts DIR --out FILE`"


def build_mlp(inputs: int = len(FEATURE_NAMES), hidden: tuple[int, ...] = HIDDEN) -> torch.nn.Sequential:
    layers: list[torch.nn.Module] = []
    width = inputs
    for size in hidden:
        layers += [torch.nn.Linear(width, size), torch.nn.ReLU()]
        width = size
    layers.append(torch.nn.Linear(width, 1))
    return torch.nn.Sequential(*layers)


@dataclass(frozen=True)
class Normaliser:
    feature_mean: torch.Tensor  # [features]
    feature_scale: torch.Tensor  # [features] 1/std, 0 for constant features
    margin_mean: float
    margin_std: float

    @classmethod
    def fit(cls, features: torch.Tensor, margins: torch.Tensor) -> Normaliser:  # [n, features], [n]
        std = features.std(dim=0, unbiased=False)
        scale = torch.where(std > 1e-6, 1.0 / std.clamp(min=1e-6), torch.zeros_like(std))
        margin_std = float(margins.std(unbiased=False)) if margins.numel() > 1 else 1.0
        return cls(features.mean(dim=0), scale, float(margins.mean()), margin_std if margin_std > 1e-9 else 1.0)

    def inputs(self, features: torch.Tensor) -> torch.Tensor:  # [..., features] → same
        return ((features - self.feature_mean) * self.feature_scale).clamp(-CLIP, CLIP)

    def targets(self, margins: torch.Tensor) -> torch.Tensor:
        return (margins - self.margin_mean) / self.margin_std

    def margins(self, outputs: torch.Tensor) -> torch.Tensor:
        return outputs * self.margin_std + self.margin_mean


@dataclass
class DistilledScheduler:
    mlp: torch.nn.Sequential
    normaliser: Normaliser
    cost_profile: Mapping[str, Any] = field(default_factory=dict)
    report: Mapping[str, Any] = field(default_factory=dict)
    feature_set: str = "paper"  # a key of FEATURE_SETS: the inputs the MLP reads, in that order
    decides: str = "layer"  # per "layer" (call or skip, LearnedLayerRule) or per "step" (the kind, LearnedStepRule)
    full_layers: tuple[int, ...] = ()  # a full strong step's layers in the per-step rollouts (() = 1..D−1)
    residual: bool = False  # the margin is the last input's (the step rule's margin) plus the MLP's correction
    correction_scale: float = 1.0  # the share of that correction a residual scheduler adds (0: it decides as the rule)

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The MLP's inputs: the feature set, for a per-step scheduler the kind it prices, and for a residual one the
        rule's margin of that kind."""
        step = STEP_KIND_FEATURE_NAMES if self.decides == "step" else ()
        return FEATURE_SETS[self.feature_set] + step + ((RULE_MARGIN_FEATURE,) if self.residual else ())

    @torch.no_grad()
    def predict(self, features: torch.Tensor) -> torch.Tensor:  # [n, features] → [n] margins
        predicted = self.normaliser.margins(self.mlp(self.normaliser.inputs(features.float())).squeeze(-1))
        return features[:, -1].float() + self.correction_scale * predicted if self.residual else predicted

    def kind_margins(
        self,
        features: torch.Tensor,  # [n, features] the layer-1 features
        kinds: list[str],
        rule_margins: Mapping[str, torch.Tensor] | None = None,  # kind → [n] the rule's margins (a residual scheduler)
    ) -> torch.Tensor:  # [kinds, n]
        """A per-step scheduler's margin of each step kind over a weak step (0 for ``weak`` itself)."""
        n = features.shape[0]
        if self.residual and rule_margins is None:
            raise ConfigError("this scheduler corrects the step rule's margins, and these rollouts hold none",
                              "collect them again under a step-rule policy (`treegraft collect --decide step`)")

        def inputs(kind: str) -> torch.Tensor:
            base = rule_margins[kind][:, None] if self.residual else torch.zeros(n, 0)
            return torch.cat([features, kind_one_hot(kind).expand(n, -1), base], dim=1)

        return torch.stack([torch.zeros(n) if kind == "weak" else self.predict(inputs(kind)) for kind in kinds])

    def margin(self, features: torch.Tensor) -> float:  # [features] → one margin
        return float(self.predict(features[None])[0])

    def policy(self, options: TreeGraftConfig, source: str = "the scheduler") -> CallPolicy:
        """The call policy that decides with this scheduler under the method's ``options``."""
        rule = LearnedStepRule if self.decides == "step" else LearnedLayerRule
        return rule(options.call_budget, options.hit_rate, self.margin, self.feature_set, options.layers or self.full_layers,
                    options.trim, self.cost_profile, source, options.min_margin, self.residual)

    def document(self) -> dict[str, Any]:
        linear = [m for m in self.mlp if isinstance(m, torch.nn.Linear)]
        n = self.normaliser
        return {
            "kind": KIND,
            "version": 1,
            "feature_names": list(self.feature_names),
            "decides": self.decides,
            "full_layers": list(self.full_layers),
            "residual": self.residual,
            "correction_scale": self.correction_scale,
            "feature_mean": n.feature_mean.tolist(),
            "feature_scale": n.feature_scale.tolist(),
            "margin_mean": n.margin_mean,
            "margin_std": n.margin_std,
            "layers": [{"weight": m.weight.tolist(), "bias": m.bias.tolist()} for m in linear],
            "cost_profile": dict(self.cost_profile),
            "report": dict(self.report),
        }

    def save(self, path: Path) -> None:
        atomic_write_text(Path(path), json.dumps(self.document()))


def scheduler_from_document(document: Any, source: str) -> DistilledScheduler:
    if not isinstance(document, Mapping) or document.get("kind") != KIND:
        raise ConfigError(f"{source} is not a treegraft scheduler artifact", FIX)
    names = list(document.get("feature_names", []))
    decides = document.get("decides", "layer")
    residual = document.get("residual", False) is True
    kind_names = list(STEP_KIND_FEATURE_NAMES) if decides == "step" else []
    kind_names += [RULE_MARGIN_FEATURE] if residual else []
    feature_set = next((name for name, known in FEATURE_SETS.items() if names == [*known, *kind_names]), None)
    if decides not in ("layer", "step") or feature_set is None or (residual and decides != "step"):
        raise ConfigError(f"{source} was distilled for other features than this version's sets ({', '.join(FEATURE_SETS)})",
                          "distill it again with this version (`treegraft distill --features paper|extended`)")
    try:
        layers = document["layers"]
        hidden = tuple(len(layer["bias"]) for layer in layers[:-1])
        mlp = build_mlp(len(names), hidden)
        linear = [m for m in mlp if isinstance(m, torch.nn.Linear)]
        with torch.no_grad():
            for module, values in zip(linear, layers, strict=True):
                module.weight.copy_(torch.tensor(values["weight"]))
                module.bias.copy_(torch.tensor(values["bias"]))
        normaliser = Normaliser(
            torch.tensor(document["feature_mean"], dtype=torch.float32),
            torch.tensor(document["feature_scale"], dtype=torch.float32),
            float(document["margin_mean"]),
            float(document["margin_std"]),
        )
        correction_scale = float(document.get("correction_scale", 1.0))
        if not 0.0 <= correction_scale <= 1.0:
            raise ValueError(f"correction_scale {correction_scale} outside [0, 1]")
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise ConfigError(f"{source}: malformed scheduler artifact ({type(error).__name__}: {error})", FIX) from None
    return DistilledScheduler(mlp.eval(), normaliser, document.get("cost_profile", {}), document.get("report", {}),
                              feature_set, decides, tuple(int(v) for v in document.get("full_layers", ())), residual,
                              correction_scale)


def load_scheduler(path: str | Path) -> DistilledScheduler:
    path = Path(path).expanduser()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"scheduler artifact {path} does not exist", FIX) from None
    except json.JSONDecodeError:
        raise ConfigError(f"{path} is not valid JSON (a torn or foreign file?)", FIX) from None
    return scheduler_from_document(document, str(path))
