"""Shared fixtures: tiny random pairs (seconds on CPU) and a helper for the greedy exactness check."""

from __future__ import annotations

import os

# before anything imports triton: its JIT reads the switch when a kernel is decorated
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from treegraft_cli.config import DecodeConfig  # noqa: E402
from treegraft_cli.engine import SpeculativeDecoder  # noqa: E402
from treegraft_cli.lm import CausalLM  # noqa: E402
from treegraft_cli.models import LoadedModel, load_pair  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """For modules of thousands of tiny forwards: intra-op threads only add synchronisation, and on a busy
    machine they stall (a 600-draw sampling test ran 10x slower with 2 threads than with 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_pair() -> tuple[LoadedModel, LoadedModel]:
    """(drafter, target): an unrelated random drafter, so acceptance is rare."""
    drafter, target = load_pair("tiny-random-drafter:tiny-random", dtype="fp32")
    return drafter, target


@pytest.fixture(scope="session")
def tiny_self_pair() -> tuple[LoadedModel, LoadedModel]:
    """(drafter, target): the target's first 2 layers draft, so many drafts are accepted."""
    drafter, target = load_pair("tiny-random@layers=2:tiny-random", dtype="fp32")
    return drafter, target


def reference_greedy(target: LoadedModel, prompt: torch.Tensor, max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of the target: the ground truth for exactness."""
    out = target.model.generate(
        prompt[None], attention_mask=torch.ones_like(prompt)[None], max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, prompt.numel():].tolist()


def speculative(pair: tuple[LoadedModel | None, LoadedModel], config: DecodeConfig, prompt: torch.Tensor):
    drafter, target = pair
    decoder = SpeculativeDecoder(
        CausalLM(target.model),
        config,
        drafter=CausalLM(drafter.model) if drafter is not None else None,
        eos_token_ids=target.eos_token_ids,
    )
    return decoder.generate(prompt)


def random_prompt(seed: int, length: int = 24, vocab: int = 256) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=generator)
