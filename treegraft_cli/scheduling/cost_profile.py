"""Cost profiles: measured forward times on one device, and the modelled step time built from them.

A cost profile (written by ``treegraft profile``, read by ``collect``/``distill``/``replay`` as ``--cost``)::

    kind: treegraft-cost-profile
    pair: D:T
    device: cpu                         # or "cuda:0 (NVIDIA H200)"
    dtype: bf16
    versions: {torch: ..., transformers: ..., treegraft: ..., python: ...}
    warmup: 1
    repeats: 5
    tree_tokens: [1, 2, 4, ..., 256]    # tokens in one forward (a verified tree has N + 1 with its root)
    contexts: [128, 512, ..., 4096]     # committed tokens before the forward
    target_ms: [[...], ...]             # [context][tree_tokens] median ms of one target forward
    drafter_ms: [[...], ...]            # same for the model drafter (empty without one)
    host_ms: {ngram: ..., adjacency: ...}  # one weak n-gram layer (K lookups), one adjacency retrieval
    identity: 12 hex digits             # hash of everything above: what a scheduler artifact records

Between grid points the curves are interpolated linearly (tokens first, then context); beyond the last
grid point they are extrapolated along the last segment, never below the last measured value.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..atomic import atomic_write_text
from ..errors import ConfigError
from .policies import CostModel, interpolate, token_ms
from .values import CATCH_UP_SHARE

KIND = "treegraft-cost-profile"
FIX = "write it with `treegraft profile --out FILE`"


@dataclass(frozen=True)
class CostProfile:
    pair: str
    device: str
    dtype: str
    tree_tokens: tuple[int, ...]
    contexts: tuple[int, ...]
    target_ms: tuple[tuple[float, ...], ...]  # [context][tree_tokens]
    drafter_ms: tuple[tuple[float, ...], ...] = ()  # [context][tree_tokens]; () without a model drafter
    host_ms: Mapping[str, float] = field(default_factory=dict)
    versions: Mapping[str, str] = field(default_factory=dict)
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self) -> None:
        grids = [("target_ms", self.target_ms)] + ([("drafter_ms", self.drafter_ms)] if self.drafter_ms else [])
        for name, grid in grids:
            if len(grid) != len(self.contexts) or any(len(row) != len(self.tree_tokens) for row in grid):
                raise ConfigError(f"cost profile: {name} is not a contexts × tree_tokens grid", FIX)
            if not all(math.isfinite(v) and v > 0 for row in grid for v in row):
                raise ConfigError(f"cost profile: {name} holds a non-positive or non-finite time", FIX)
        if list(self.tree_tokens) != sorted(set(self.tree_tokens)) or list(self.contexts) != sorted(set(self.contexts)):
            raise ConfigError("cost profile: tree_tokens and contexts must be increasing", FIX)

    @property
    def identity(self) -> str:
        """A short hash of the measurement: two profiles with the same identity model the same costs."""
        body = json.dumps(_measurement(self), sort_keys=True)
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def target_forward_ms(self, tokens: int, context: int) -> float:
        return _surface(self.contexts, self.tree_tokens, self.target_ms, context, tokens)

    def drafter_forward_ms(self, tokens: int, context: int) -> float:
        return _surface(self.contexts, self.tree_tokens, self.drafter_ms, context, tokens) if self.drafter_ms else 0.0

    def cost_model(self, budget: int, width: int, context: int) -> CostModel:
        """The scheduler's costs, as ``scheduling.costs.measure_costs`` defines them: a target forward of a
        full tree (N + 1 tokens), a strong call over 2·K tokens, the drafter's ms per token from there to the
        profile's widest forward, and the verification curve at the profile's tree sizes up to N + 1 (the root alone
        and a full tree included)."""
        sizes = sorted({1, budget + 1, *(t for t in self.tree_tokens if t <= budget + 1)})
        curve = tuple((tokens, self.target_forward_ms(tokens, context)) for tokens in sizes)
        strong_ms, catch_up = self.drafter_forward_ms(2 * width, context), 0.0
        if self.drafter_ms:  # the catch-up rate: the drafter's slope up to its widest forward
            widest = self.tree_tokens[-1]
            catch_up = token_ms((2 * width, strong_ms), (widest, self.drafter_forward_ms(widest, context)))
        return CostModel(curve[-1][1], strong_ms, curve[0][1], curve, strong_token_ms=catch_up)

    def step_ms(self, tree_tokens: int, strong_calls: int, weak_layers: int, width: int, context: int,
                lag: int = 0, forwarded: Sequence[int] | None = None, catch_up_share: float = CATCH_UP_SHARE) -> float:
        """Modelled time of one step: verify the tree, ``strong_calls`` strong forwards, ``weak_layers`` n-gram layers.

        ``forwarded``: the tree nodes each strong call forwarded (``strong_calls`` counts); None, for rollouts that
        did not count them: 2·K a call. The step's first strong call also forwards the ``lag`` committed tokens the
        strong drafter has not seen (``catch_up_share`` of the time they add is charged to the step, by default
        ``values.CATCH_UP_SHARE``)."""
        calls = [2 * width] * strong_calls if forwarded is None else list(forwarded)
        strong = sum(self.drafter_forward_ms(max(1, nodes), context) for nodes in calls)
        if calls and lag > 0:
            first = calls[0]
            extra = self.drafter_forward_ms(first + lag, context) - self.drafter_forward_ms(max(1, first), context)
            strong += catch_up_share * max(0.0, extra)
        return self.target_forward_ms(tree_tokens, context) + strong + weak_layers * float(self.host_ms.get("ngram", 0.0))


def _measurement(profile: CostProfile) -> dict[str, Any]:
    return {
        "pair": profile.pair,
        "device": profile.device,
        "dtype": profile.dtype,
        "tree_tokens": list(profile.tree_tokens),
        "contexts": list(profile.contexts),
        "target_ms": [list(row) for row in profile.target_ms],
        "drafter_ms": [list(row) for row in profile.drafter_ms],
        "host_ms": dict(profile.host_ms),
    }


def _surface(contexts: Sequence[int], tokens: Sequence[int], grid: Sequence[Sequence[float]], context: int, n: int) -> float:
    per_context = [interpolate(n, tokens, row) for row in grid]
    return max(interpolate(context, contexts, per_context), 1e-6)


def profile_document(profile: CostProfile) -> dict[str, Any]:
    return {
        "kind": KIND,
        **_measurement(profile),
        "versions": dict(profile.versions),
        "warmup": profile.warmup,
        "repeats": profile.repeats,
        "identity": profile.identity,
    }


def profile_from_document(document: Any, source: str = "cost profile") -> CostProfile:
    if not isinstance(document, Mapping) or document.get("kind") != KIND:
        raise ConfigError(f"{source} is not a treegraft cost profile (kind: {KIND} missing)", FIX)
    try:
        return CostProfile(
            pair=str(document.get("pair", "")),
            device=str(document["device"]),
            dtype=str(document["dtype"]),
            tree_tokens=tuple(int(v) for v in document["tree_tokens"]),
            contexts=tuple(int(v) for v in document["contexts"]),
            target_ms=tuple(tuple(float(v) for v in row) for row in document["target_ms"]),
            drafter_ms=tuple(tuple(float(v) for v in row) for row in document.get("drafter_ms") or ()),
            host_ms={str(k): float(v) for k, v in (document.get("host_ms") or {}).items()},
            versions={str(k): str(v) for k, v in (document.get("versions") or {}).items()},
            warmup=int(document.get("warmup", 1)),
            repeats=int(document.get("repeats", 3)),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{source}: missing or malformed field ({error})", FIX) from None
    except ConfigError as error:
        raise ConfigError(f"{source}: {error.message}", error.hint) from None


def load_cost_profile(path: Path) -> CostProfile:
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"cost profile {path} does not exist", FIX) from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})", FIX) from None
    return profile_from_document(document, str(path))


def check_profile_pair(profile: CostProfile, pair: str, source: str) -> None:
    """Refuse a profile measured on another DRAFTER:TARGET pair (its times are that pair's); an unknown pair on either
    side is not checked."""
    if pair and profile.pair and profile.pair != pair:
        raise ConfigError(f"cost profile {source} was measured on the pair {profile.pair}, not {pair}",
                          f"measure this pair's: treegraft profile --pair {pair} --out FILE")


def save_cost_profile(profile: CostProfile, path: Path) -> None:
    atomic_write_text(path, yaml.safe_dump(profile_document(profile), sort_keys=False, default_flow_style=None))
