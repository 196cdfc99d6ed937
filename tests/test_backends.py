"""Backend selection, and the engine giving the same tokens with the Triton kernels (interpreted) as with
the torch references."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt, speculative

from treegraft_cli import kernels
from treegraft_cli.backends import TritonBackend, VerifyBackend, select_backend
from treegraft_cli.config import DecodeConfig, SamplingConfig, TreeConfig
from treegraft_cli.errors import ConfigError

SMALL_TREE = TreeConfig(budget=12, depth=4, top_k=3)  # the interpreted kernels and the shared CPU stay quick
needs_triton = pytest.mark.skipif(
    not kernels.triton_status(torch.device("cpu"))[0], reason="triton cannot run here (not installed, or TRITON_INTERPRET unset)"
)


def test_auto_is_torch_on_cpu():
    assert type(select_backend("auto", torch.device("cpu"))) is VerifyBackend


def test_auto_is_torch_on_cuda_without_triton(monkeypatch):
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    assert type(select_backend("auto", torch.device("cuda"))) is VerifyBackend


def test_triton_without_triton_names_the_fix(monkeypatch):
    monkeypatch.setattr(kernels, "triton_installed", lambda: False)
    with pytest.raises(ConfigError) as error:
        select_backend("triton", torch.device("cpu"))
    assert "not installed" in error.value.message and "pip install triton" in error.value.hint


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError) as error:
        select_backend("triton", torch.device("cpu"))
    assert "TRITON_INTERPRET=1" in error.value.hint and "--kernels torch" in error.value.hint


@needs_triton
def test_triton_backend_is_selected():
    assert isinstance(select_backend("triton", torch.device("cpu")), TritonBackend)


@needs_triton
def test_engine_greedy_tokens_match(tiny_self_pair):
    prompt = random_prompt(seed=21)
    outputs = {
        name: speculative(tiny_self_pair, DecodeConfig(method="dense", tree=SMALL_TREE, max_new_tokens=12, kernels=name), prompt)
        for name in ("torch", "triton")
    }
    # torch == transformers' greedy is test_exactness's job; here the two backends must agree
    assert outputs["triton"].output_ids == outputs["torch"].output_ids
    assert max(step.accepted_length for step in outputs["triton"].steps) > 1  # real accepted paths were walked


@needs_triton
def test_engine_sampled_tokens_match(tiny_self_pair):
    """Same seed, same uniforms: the kernel samples the same tokens as the reference."""
    sampling = SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)
    prompt = random_prompt(seed=22)
    outputs = [
        speculative(tiny_self_pair, DecodeConfig(method="dense", tree=SMALL_TREE, max_new_tokens=8, sampling=sampling, kernels=k, seed=3), prompt)
        for k in ("torch", "triton")
    ]
    assert outputs[0].output_ids == outputs[1].output_ids
