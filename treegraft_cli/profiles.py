"""YAML profiles: a pair plus the decoding settings (and per-method options) that suit it.

A profile file (``profiles/NAME.yaml``)::

    name: qwen3-8b-qwen3-235b          # optional, defaults to the file name
    pair: qwen3-8b:qwen3-235b          # DRAFTER:TARGET
    description: ...
    dtype: bf16                        # bf16 | fp16 | fp32
    device: auto                       # cpu | cuda | auto
    thinking: false                    # optional: the chat template's enable_thinking (Qwen3); absent: its default
    linear: packed                     # optional: default | packed | auto (CPU linear kernels, ``--linear``)
    decode:                            # DecodeConfig fields; tree and sampling are nested
      method: treegraft
      max_new_tokens: 256
      tree: {budget: 63, depth: 5, top_k: 10}
      sampling: {temperature: 0.0}
    method_options:                    # per method: that method's own option names
      treegraft: {lookback: 5, call_budget: 5}   # scheduler: FILE and clock: FILE are read relative to this file
    cost: {...}                        # optional: measured costs (free-form mapping)
    tuned: {...}                       # optional: provenance written by `treegraft tune`

Profiles are validated on load; an error names the file and the field. ``decode_config_from_mapping``
is the one way a DecodeConfig is built from plain data: profiles, the bench CLI and the tuner all use it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from .config import DecodeConfig, check_value, from_mapping
from .errors import ConfigError
from .methods import METHODS, method_names
from .models.load import DTYPES
from .models.packed_linear import LINEAR_KINDS

PROFILES_ENV = "TREEGRAFT_PROFILES"
TOP_LEVEL = ("name", "pair", "description", "dtype", "device", "thinking", "linear", "decode", "method_options", "cost", "tuned")
DEVICES = ("cpu", "cuda", "auto")


@dataclass(frozen=True)
class Profile:
    name: str
    pair: str
    decode: DecodeConfig
    method_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    dtype: str = "bf16"
    device: str = "cpu"
    description: str = ""
    cost: Mapping[str, Any] = field(default_factory=dict)
    tuned: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    thinking: bool | None = None
    linear: str = "default"

    def config_for(self, method: str) -> DecodeConfig:
        """The profile's settings for ``method``, with that method's options."""
        return replace(self.decode, method=method, method_options=dict(self.method_options.get(method, {})))


def profiles_dir() -> Path:
    """``$TREEGRAFT_PROFILES``, else ``profiles/`` at the repository root (an editable install keeps it)."""
    override = os.environ.get(PROFILES_ENV)
    return Path(override).expanduser() if override else Path(__file__).resolve().parents[1] / "profiles"


def profile_names() -> list[str]:
    root = profiles_dir()
    return sorted(p.stem for p in root.glob("*.yaml")) if root.is_dir() else []


def decode_config_from_mapping(values: Mapping[str, Any] | None, where: str = "decode") -> DecodeConfig:
    """A DecodeConfig from plain data (nested ``tree`` / ``sampling`` mappings), validated field by field."""
    if values is not None and not isinstance(values, Mapping):
        raise ConfigError(f"{where} must be a mapping (got {values!r})", f"write {where.split(': ')[-1]} as key: value lines")
    return from_mapping(DecodeConfig, values, where)


def profile_from_mapping(document: Any, source: str = "profile", default_name: str = "") -> Profile:
    """Validate a parsed profile document; every error names ``source`` and the field."""
    if not isinstance(document, Mapping):
        raise ConfigError(f"{source}: a profile must be a mapping of fields", f"fields are: {', '.join(TOP_LEVEL)}")
    unknown = sorted(set(document) - set(TOP_LEVEL))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(map(str, unknown))}", f"fields are: {', '.join(TOP_LEVEL)}")
    for key in ("name", "pair", "description", "dtype", "device", "linear"):
        if key in document:
            check_value(document[key], str, f"{source}: {key}")
    if not document.get("pair"):
        raise ConfigError(f"{source}: field 'pair' is missing", "add pair: DRAFTER:TARGET")
    dtype = document.get("dtype", "bf16")
    if dtype not in DTYPES:
        raise ConfigError(f"{source}: dtype {dtype!r} is not one of {', '.join(DTYPES)}", "fix dtype in the profile")
    device = document.get("device", "cpu")
    if device not in DEVICES and not str(device).startswith("cuda:"):
        raise ConfigError(f"{source}: device {device!r} is not one of {', '.join(DEVICES)}", "fix device in the profile")
    thinking = document.get("thinking")
    if thinking is not None and not isinstance(thinking, bool):
        raise ConfigError(f"{source}: thinking must be true or false (got {thinking!r})", "write thinking: false")
    linear = document.get("linear", "default")
    if linear not in LINEAR_KINDS:
        raise ConfigError(f"{source}: linear {linear!r} is not one of {', '.join(LINEAR_KINDS)}", "fix linear in the profile")
    decode = decode_config_from_mapping(document.get("decode"), f"{source}: decode")
    options = document.get("method_options") or {}
    if not isinstance(options, Mapping) or not all(isinstance(v, Mapping) for v in options.values()):
        raise ConfigError(f"{source}: method_options must map each method name to a mapping of its options",
                          "write method_options: {METHOD: {option: value}}")
    _check_method_options(options, source)
    for key in ("cost", "tuned"):
        if not isinstance(document.get(key) or {}, Mapping):
            raise ConfigError(f"{source}: {key} must be a mapping", f"write {key} as key: value lines")
    return Profile(
        name=document.get("name") or default_name,
        pair=document["pair"],
        decode=decode,
        method_options={str(k): dict(v) for k, v in options.items()},
        dtype=dtype,
        device=device,
        description=document.get("description", ""),
        cost=dict(document.get("cost") or {}),
        tuned=dict(document.get("tuned") or {}),
        source=source,
        thinking=thinking,
        linear=linear,
    )


def _check_method_options(options: Mapping[str, Mapping[str, Any]], source: str) -> None:
    """Each method's options must build that method's own settings: a typo names the field."""
    for name, values in options.items():
        cls = METHODS.get(str(name).partition(":")[0])
        if cls is None:
            raise ConfigError(f"{source}: method_options.{name}: no such method", f"methods are: {', '.join(method_names())}")
        cls.parse_options(values, f"{source}: method_options.{name}")


def load_profile_file(path: Path) -> Profile:
    path = Path(path)
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"profile {path} does not exist", "pass an existing YAML file or a name from profiles/") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML ({str(error).splitlines()[0]})", "fix the YAML syntax") from None
    return _files_beside(profile_from_mapping(document, str(path), path.stem), path.parent)


FILE_OPTIONS = ("scheduler", "clock")  # method options that name a file: relative to the profile's own directory


def _files_beside(profile: Profile, directory: Path) -> Profile:
    """The profile with relative file options (a shipped scheduler artifact) made absolute from ``directory``,
    so a profile finds the files shipped beside it from any working directory."""
    options = {}
    for method, values in profile.method_options.items():
        values = dict(values)
        for key in FILE_OPTIONS:
            value = values.get(key)
            if isinstance(value, str) and value and not Path(value).expanduser().is_absolute():
                values[key] = str(directory / value)
        options[method] = values
    return replace(profile, method_options=options)


def load_profile(name_or_path: str) -> Profile:
    """A profile by file path, or by name from ``profiles/``; an unknown name lists the bundled ones."""
    path = Path(name_or_path).expanduser()
    if path.suffix in (".yaml", ".yml") or path.exists():
        return load_profile_file(path)
    candidate = profiles_dir() / f"{name_or_path}.yaml"
    if candidate.is_file():
        return load_profile_file(candidate)
    raise ConfigError(f"unknown profile {name_or_path!r}", f"use a YAML path or one of: {', '.join(profile_names()) or '(none found)'}")


def profile_for_pair(pair: str) -> Profile | None:
    """The bundled profile for exactly this pair, if any (first by name)."""
    for name in profile_names():
        profile = load_profile_file(profiles_dir() / f"{name}.yaml")
        if profile.pair == pair:
            return profile
    return None


def profile_document(profile: Profile) -> dict[str, Any]:
    """The YAML document of a profile (what ``profile_from_mapping`` reads back)."""
    decode = dataclasses.asdict(profile.decode)
    decode.pop("method_options")
    document: dict[str, Any] = {"name": profile.name, "pair": profile.pair}
    if profile.description:
        document["description"] = profile.description
    document.update({"dtype": profile.dtype, "device": profile.device})
    if profile.thinking is not None:
        document["thinking"] = profile.thinking
    if profile.linear != "default":
        document["linear"] = profile.linear
    document.update({"decode": decode,
                     "method_options": {k: dict(v) for k, v in profile.method_options.items()}})
    if profile.cost:
        document["cost"] = dict(profile.cost)
    if profile.tuned:
        document["tuned"] = dict(profile.tuned)
    return document


def dump_profile(profile: Profile) -> str:
    return yaml.safe_dump(profile_document(profile), sort_keys=False, default_flow_style=None)
