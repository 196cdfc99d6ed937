"""Exactness on real models. SmolLM2-135M (self-drafting with 8 of its 30 layers) runs in CI; the
Qwen2.5-Coder pair is marked slow (about 1.6 GB to fetch and minutes of CPU)."""

from __future__ import annotations

import pytest
from conftest import reference_greedy, speculative

from treegraft_cli.config import DecodeConfig, TreeConfig
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


@pytest.mark.slow
def test_qwen_coder_pair_is_exact():
    check_pair("qwen2.5-coder-0.5b:qwen2.5-coder-1.5b", ["chain", "dense"], max_new_tokens=32)
