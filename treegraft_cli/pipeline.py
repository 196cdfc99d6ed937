"""A loaded pair ready to decode: models, chat formatting and decoder construction in one place.

The CLI, bench, tune and collect all go through here, so a pair is loaded and a decoder is built the
same way everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .config import DecodeConfig
from .engine import Generation, SpeculativeDecoder
from .lm import CausalLM
from .models import LoadedModel, load_pair
from .models.fetch import Progress
from .models.packed_linear import pack_linears, resolve_linear

# Runs on a laptop CPU in seconds once fetched: a real model drafting for itself with its first 8 layers.
DEFAULT_PAIR = "smollm2-135m@layers=8:smollm2-135m"


@dataclass
class Pipeline:
    target: LoadedModel
    drafter: LoadedModel | None
    # what methods measured on these models and this device, shared by every decoder built here
    # (so a benchmark's warm-up pays for the cost measurement, not its timed run)
    measurements: dict[Any, Any] = field(default_factory=dict)
    # the chat template's ``enable_thinking`` (Qwen3 templates think unless told not to); None: the template's default
    thinking: bool | None = None
    pair: str = ""  # DRAFTER:TARGET as loaded ("" for models built some other way)

    @classmethod
    def load(
        cls, pair: str, dtype: str = "bf16", device: str = "cpu", progress: Progress | None = None,
        thinking: bool | None = None, linear: str = "default", random_weights: bool = False,
    ) -> Pipeline:
        """``linear``: ``packed`` gives every linear layer of both models a oneDNN-packed copy of its weight
        (``models/packed_linear.py``; CPU, fp32 or bf16); ``auto``: packed where that pays (``resolve_linear``).
        ``random_weights``: models built from their configs, weights random (``load_pair``)."""
        linear = resolve_linear(linear, dtype, device)
        drafter, target = load_pair(pair, dtype, device, progress, random_weights)
        if linear == "packed":
            for loaded in (target, drafter):
                if loaded is not None:
                    pack_linears(loaded.model)
        return cls(target=target, drafter=drafter, thinking=thinking, pair=pair)

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def device(self) -> torch.device:
        return self.target.model.device

    def decoder(self, config: DecodeConfig) -> SpeculativeDecoder:
        drafter = CausalLM(self.drafter.model) if self.drafter is not None else None
        return SpeculativeDecoder(
            CausalLM(self.target.model),
            config,
            drafter=drafter,
            eos_token_ids=self.target.eos_token_ids,
            measurements=self.measurements,
            pair=self.pair,
        )

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> torch.Tensor:
        """Token ids of a conversation, formatted by the chat template with the generation prompt added.

        ``thinking`` reaches the template as ``enable_thinking`` (templates without the switch ignore it).
        """
        switch = {} if self.thinking is None else {"enable_thinking": self.thinking}
        ids = self.tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False, **switch
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


def chat_messages(turns: Sequence[str], answers: Sequence[str] = (), system: str | None = None) -> list[dict[str, str]]:
    """The messages for the next turn: optional system message, then user/assistant alternating."""
    messages = [{"role": "system", "content": system}] if system else []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


def run_conversation(
    pipeline: Pipeline, decoder: SpeculativeDecoder, turns: Sequence[str], system: str | None = None
) -> list[Generation]:
    """Decode a multi-turn conversation: each turn's prompt holds every earlier turn and answer."""
    answers: list[str] = []
    generations = []
    for i in range(len(turns)):
        prompt = pipeline.encode_chat(chat_messages(turns[: i + 1], answers, system))
        generation = decoder.generate(prompt)
        answers.append(pipeline.decode(generation.output_ids))
        generations.append(generation)
    return generations
