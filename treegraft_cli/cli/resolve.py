"""Pair, profile and CLI overrides → the settings of one run (shared by bench and tune)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..bench.contenders import PairShape
from ..config import DecodeConfig
from ..models.load import parse_dtype
from ..models.packed_linear import resolve_linear
from ..pipeline import DEFAULT_PAIR
from ..profiles import Profile, decode_config_from_mapping, load_profile, profile_for_pair


@dataclass(frozen=True)
class RunSettings:
    pair: str
    dtype: str
    device: str
    config: DecodeConfig
    method_options: Mapping[str, Mapping[str, Any]]
    profile_name: str | None
    thinking: bool | None = None  # the chat template's enable_thinking; None: the template's default
    linear: str = "default"  # ``Pipeline.load``'s linear kernels: default | packed


def resolve_run(
    pair: str | None,
    profile_name: str | None,
    dtype: str | None,
    device: str | None,
    max_new_tokens: int | None,
    temperature: float | None,
    budget: int | None,
    depth: int | None,
    tree_top_k: int | None,
    thinking: bool | None = None,
    compile: str | None = None,
    linear: str | None = None,
) -> RunSettings:
    """Explicit options win over the profile (``--profile``, else the bundled profile of ``--pair``), which wins over defaults."""
    profile: Profile | None = load_profile(profile_name) if profile_name else profile_for_pair(pair or DEFAULT_PAIR)
    values = dataclasses.asdict(profile.decode) if profile else {}
    values.pop("method_options", None)
    tree = dict(values.get("tree", {}))
    tree.update({k: v for k, v in (("budget", budget), ("depth", depth), ("top_k", tree_top_k)) if v is not None})
    values["tree"] = tree
    if temperature is not None:
        values["sampling"] = {**values.get("sampling", {}), "temperature": temperature}
    if max_new_tokens is not None:
        values["max_new_tokens"] = max_new_tokens
    if compile is not None:
        values["compile"] = compile
    chosen_dtype = dtype or (profile.dtype if profile else "bf16")
    parse_dtype(chosen_dtype)  # an unknown dtype fails here, naming the valid ones
    chosen_device = device or (profile.device if profile else "cpu")
    chosen_linear = linear or (profile.linear if profile else "default")
    config = decode_config_from_mapping(values, "settings")
    chosen_linear = resolve_linear(chosen_linear, chosen_dtype, chosen_device, config.compile)
    return RunSettings(
        pair=pair or (profile.pair if profile else DEFAULT_PAIR),
        dtype=chosen_dtype,
        device=chosen_device,
        config=config,
        method_options=dict(profile.method_options) if profile else {},
        profile_name=profile.name if profile else None,
        thinking=thinking if thinking is not None else (profile.thinking if profile else None),
        linear=chosen_linear,
    )


def has_drafter(pair: str) -> bool:
    """Whether ``pair`` names a drafter (``DRAFTER:TARGET``), checked from its names alone (see ``PairShape.of``)."""
    return PairShape.of(pair).has_drafter
