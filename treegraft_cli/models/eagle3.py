"""Load and save EAGLE-3 draft heads in the published checkpoint layout, and check them against a target.

Layout (EAGLE authors, SpecForge, sglang): a directory with ``config.json`` (Llama-like:
``hidden_size``, heads, ``intermediate_size``, ``rms_norm_eps``, rope settings, ``vocab_size`` = the
target's vocabulary, ``draft_vocab_size``, optional ``target_hidden_size``, optional
``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` or ``pytorch_model.bin``
with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and rarely ``embed_tokens``.

Which target hidden states the head fuses (indices into transformers' ``output_hidden_states``,
where 0 is the embedding output and k the output of decoder layer k - 1), following the EAGLE
reference and sglang:

- default, for a target of L layers: indices ``(2, L // 2, L - 3)``, the *inputs* of decoder layers
  2, L // 2 and L - 3 (the reference code records the state before running those layers);
- ``eagle_aux_hidden_state_layer_ids = [a, b, c]``: the *outputs* of layers a, b, c, indices
  ``(a + 1, b + 1, c + 1)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, PreTrainedModel

from ..errors import ModelError
from .eagle3_head import Eagle3Head, draft_vocab_size, target_hidden_size

ARCHITECTURE = "LlamaForCausalLMEagle3"
_REFIT_HINT = "use an EAGLE-3 head trained for this target model"


def aux_hidden_indices(config: LlamaConfig, num_target_layers: int) -> tuple[int, ...]:
    """The target hidden-state indices (low, mid, high) the head was trained on; see the module doc."""
    eagle = getattr(config, "eagle_config", None) or {}
    layer_ids = eagle.get("eagle_aux_hidden_state_layer_ids") or getattr(config, "eagle_aux_hidden_state_layer_ids", None)
    if layer_ids:
        indices = tuple(int(i) + 1 for i in layer_ids)
    else:
        indices = (2, num_target_layers // 2, num_target_layers - 3)
    if len(indices) != 3 or not all(1 <= i <= num_target_layers for i in indices):
        raise ModelError(
            f"EAGLE-3 head reads target hidden states {indices}, but the target has {num_target_layers} layers",
            f"{_REFIT_HINT}; eagle_aux_hidden_state_layer_ids must name 3 layers in 0..{num_target_layers - 1}",
        )
    return indices


def load_eagle3_head(source: Path, target: PreTrainedModel) -> Eagle3Head:
    """The head in ``source`` (a checkpoint directory), on the target's device and in its dtype."""
    config = read_config(source)
    state = read_weights(source)
    check_fits_target(config, state, target)
    embed = None if "embed_tokens.weight" in state else target.get_input_embeddings()
    with torch.device(target.device):
        head = Eagle3Head(config, embed)
    _fill_vocab_maps(config, state)
    _load_state(head, state, source)
    check_vocab_map(head)
    return head.to(dtype=target.dtype).eval()


def save_eagle3_head(head: Eagle3Head, directory: Path) -> None:
    """Write ``config.json`` and ``model.safetensors`` in the EAGLE-3 layout (borrowed embeddings left out)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    values = head.config.to_dict()
    values["architectures"] = [ARCHITECTURE]
    (directory / "config.json").write_text(json.dumps(values, indent=2, default=str))
    state = {name: tensor.detach().contiguous().cpu() for name, tensor in head.checkpoint_state().items()}
    save_file(state, str(directory / "model.safetensors"))


def read_config(source: Path) -> LlamaConfig:
    path = source / "config.json"
    if not path.is_file():
        raise ModelError(f"{source} has no config.json", "an EAGLE-3 head directory holds config.json and its weights")
    values = json.loads(path.read_text())
    values.setdefault("draft_vocab_size", values.get("vocab_size"))
    if values.get("num_hidden_layers", 1) != 1:
        raise ModelError(
            f"{source}: EAGLE-3 heads have one decoder layer, config.json says {values['num_hidden_layers']}",
            "pass an EAGLE-3 head directory, or a full drafter model without the eagle3: prefix",
        )
    return LlamaConfig(**values)


def read_weights(source: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint: all ``*.safetensors`` files, else ``pytorch_model*.bin``."""
    state: dict[str, torch.Tensor] = {}
    shards = sorted(source.glob("*.safetensors"))
    if shards:
        from safetensors.torch import load_file

        for shard in shards:
            state.update(load_file(str(shard)))
        return state
    bins = sorted(source.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelError(f"{source} has no weights", "expected model.safetensors or pytorch_model.bin")
    for path in bins:
        state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state


def check_fits_target(config: LlamaConfig, state: dict[str, torch.Tensor], target: PreTrainedModel) -> None:
    """Refuse a head whose hidden size, vocabulary or layer choice does not match the target."""
    text = target.config.get_text_config()
    fused = target_hidden_size(config)
    if fused != text.hidden_size:
        raise ModelError(
            f"EAGLE-3 head fuses target hidden states of size {fused}, the target's hidden size is {text.hidden_size}",
            f"{_REFIT_HINT} (config.json target_hidden_size, or hidden_size, must be {text.hidden_size})",
        )
    if config.vocab_size != text.vocab_size:
        raise ModelError(
            f"EAGLE-3 head maps drafts into a vocabulary of {config.vocab_size} tokens, the target has {text.vocab_size}",
            f"{_REFIT_HINT} (config.json vocab_size must be {text.vocab_size})",
        )
    embedding_size = target.get_input_embeddings().weight.shape[1]
    if "embed_tokens.weight" not in state and config.hidden_size != embedding_size:
        raise ModelError(
            f"EAGLE-3 head has hidden size {config.hidden_size} and no embeddings of its own; "
            f"the target's embeddings have size {embedding_size}",
            f"{_REFIT_HINT}, or a checkpoint that includes embed_tokens.weight",
        )
    aux_hidden_indices(config, text.num_hidden_layers)


def check_vocab_map(head: Eagle3Head) -> None:
    """Every draft id must map to a distinct target id inside the target vocabulary."""
    ids = head.draft_to_target
    vocab = head.config.vocab_size
    outside = ((ids < 0) | (ids >= vocab)).nonzero().flatten()
    if outside.numel():
        first = int(outside[0])
        raise ModelError(
            f"EAGLE-3 d2t maps draft id {first} to target id {int(ids[first])}, outside 0..{vocab - 1} "
            f"({outside.numel()} ids out of range)",
            f"{_REFIT_HINT}; d2t must hold offsets with draft_id + d2t[draft_id] < {vocab}",
        )
    if torch.unique(ids).numel() != ids.numel():
        raise ModelError("EAGLE-3 d2t maps two draft ids to the same target id", f"{_REFIT_HINT}; the checkpoint's d2t is corrupt")


def _fill_vocab_maps(config: LlamaConfig, state: dict[str, torch.Tensor]) -> None:
    """A head drafting over the full vocabulary may omit d2t / t2d: the identity map."""
    if draft_vocab_size(config) == config.vocab_size:
        state.setdefault("d2t", torch.zeros(config.vocab_size, dtype=torch.long))
        state.setdefault("t2d", torch.ones(config.vocab_size, dtype=torch.bool))


def _load_state(head: Eagle3Head, state: dict[str, torch.Tensor], source: Path) -> None:
    for name in [k for k in state if k.endswith("rotary_emb.inv_freq")]:
        del state[name]  # older checkpoints saved this buffer; the head recomputes it from the config
    expected = head.checkpoint_state()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} vs {tuple(v.shape)}" for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        details = "; ".join(
            f"{label}: {', '.join(items[:4])}{' …' if len(items) > 4 else ''}"
            for label, items in (("missing", missing), ("unexpected", unexpected), ("shape (checkpoint vs config)", wrong))
            if items
        )
        raise ModelError(f"{source} is not an EAGLE-3 checkpoint matching its config.json ({details})", "check the checkpoint files")
    head.load_state_dict(state, strict=False)
