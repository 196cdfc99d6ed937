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
@pytest.mark.parametrize("sampling", [SamplingConfig(temperature=0.8), SamplingConfig(temperature=0.8, top_k=40, top_p=0.95)],
                         ids=["kernel", "filtered"])
def test_engine_sampled_tokens_match(tiny_self_pair, sampling):
    """Same seed, same uniforms: the Triton backend samples the same tokens as the reference."""
    prompt = random_prompt(seed=22)
    outputs = [
        speculative(tiny_self_pair, DecodeConfig(method="dense", tree=SMALL_TREE, max_new_tokens=8, sampling=sampling, kernels=k, seed=3), prompt)
        for k in ("torch", "triton")
    ]
    assert outputs[0].output_ids == outputs[1].output_ids


@needs_triton
@pytest.mark.parametrize(("top_k", "top_p", "kernel_calls"), [(0, 1.0, 1), (40, 1.0, 0), (0, 0.9, 0), (64, 1.0, 1)])
def test_sampling_takes_the_kernel_only_without_filters(monkeypatch, top_k, top_p, kernel_calls):
    """top-k or top-p run the reference (a sort beats the kernel's bisection on a GPU); top-k of the whole
    vocabulary is no filter."""
    backend = select_backend("triton", torch.device("cpu"))
    calls = []
    kernel = backend._sampling
    monkeypatch.setattr(backend, "_sampling", lambda *args: calls.append(1) or kernel(*args))
    logits = torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(0))
    tokens, parents = torch.tensor([[0, 5, 9]]), torch.tensor([[-1, 0, 0]])
    uniforms = torch.rand(1, 3, generator=torch.Generator().manual_seed(1))
    backend.verify_sampling(logits, tokens, parents, uniforms, 0.8, top_k, top_p)
    assert len(calls) == kernel_calls


@needs_triton
@pytest.mark.parametrize("method", ["adjacency", "graft"])
def test_grafting_methods_match_with_the_graft_kernel(tiny_self_pair, monkeypatch, method):
    """The Triton backend grafts through its kernel, and every graft gives the same tree: the same tokens and
    accepted lengths as the reference. Thresholds of 1 make every graft checkpoint fire."""
    from treegraft_cli.kernels import graft_candidates

    calls = []
    kernel = graft_candidates.graft_candidates
    monkeypatch.setattr(graft_candidates, "graft_candidates", lambda *args: calls.append(1) or kernel(*args))
    prompt = random_prompt(seed=23)
    options = {"thresholds": [1.0, 1.0, 1.0]} if method == "graft" else {}
    outputs = [
        speculative(tiny_self_pair, DecodeConfig(method=method, tree=SMALL_TREE, max_new_tokens=12, kernels=k,
                                                 method_options=options), prompt)
        for k in ("torch", "triton")
    ]
    assert outputs[0].output_ids == outputs[1].output_ids
    assert [s.accepted_length for s in outputs[0].steps] == [s.accepted_length for s in outputs[1].steps]
    assert len(calls) >= len(outputs[1].steps)  # a graft every step
