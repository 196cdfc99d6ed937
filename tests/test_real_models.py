"""Real models: exactness, and what loading one tells the user. SmolLM2-135M (self-drafting with 8 of its
30 layers) runs in CI; the Qwen2.5-Coder pair is marked slow (about 1.6 GB to fetch and minutes of CPU)."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import reference_greedy, speculative

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.models.load import GGUF_LOGGER, PACKED_ADVICE
from treegraft_cli.pipeline import Pipeline, chat_messages

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarize in one sentence: the cat sat on the mat because the mat was warm.",
    "What is 17 times 23? Show your steps.",
]


def check_pair(pair_name: str, methods: list[str], max_new_tokens: int) -> None:
    pipeline = Pipeline.load(pair_name, dtype="fp32")
    pair = (pipeline.drafter, pipeline.target)
    for prompt_text in PROMPTS:
        prompt = pipeline.encode_chat(chat_messages([prompt_text]))
        expected = reference_greedy(pipeline.target, prompt, max_new_tokens)
        for method in methods:
            config = DecodeConfig(method=method, tree=TreeConfig(budget=24, depth=5, top_k=4), max_new_tokens=max_new_tokens)
            result = speculative(pair, config, prompt)
            assert result.output_ids == expected, (method, prompt_text)


@pytest.mark.real_model
def test_smollm2_self_drafter_is_exact():
    check_pair("smollm2-135m@layers=8:smollm2-135m", ["chain", "dense"], max_new_tokens=32)


class Messages(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.real_model
def test_float32_advice_for_gguf_only_where_weights_stay_packed():
    """transformers advises loading GGUF files in float32 "because the weights stay packed" before it knows
    whether any will; without a GGUF kernel every weight is dequantised to bf16 and the advice would only slow
    the user down, so it reaches the user only when some module kept packed weights."""
    logger, seen = logging.getLogger(GGUF_LOGGER), Messages()
    logger.addHandler(seen)
    try:
        model = Pipeline.load("smollm2-135m", dtype="bf16").target.model
    finally:
        logger.removeHandler(seen)
    packed = any(type(module).__name__.startswith("Gguf") for module in model.modules())
    assert model.dtype == torch.bfloat16
    assert any(message.startswith(PACKED_ADVICE) for message in seen.messages) == packed


@pytest.mark.slow
def test_qwen_coder_pair_is_exact():
    check_pair("qwen2.5-coder-0.5b:qwen2.5-coder-1.5b", ["chain", "dense"], max_new_tokens=32)
