"""Host-device synchronisations per step: the step's own count is honest (an auditor that sees every
synchronising torch call agrees with it) and stays within each method's limit."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from conftest import random_prompt, reference_greedy, speculative

from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import Generation, SpeculativeDecoder
from treegraft_cli.lm import CausalLM
from treegraft_cli.syncs import (
    HostReads,
    SyncAuditor,
    counting,
    fetch,
    host_only,
    read,
    recorded_sync_sites,
    uncounted,
)

TREE = TreeConfig(budget=16, depth=4, top_k=4)
# graft's default checkpoints (0, 1, 5): those on layers 0 and 1 are decision reads; the one on the last
# layer keeps K_draft 40 >= N 16, so it decides nothing and is read with the verdict
DECIDING_CHECKPOINTS = 2
# The verdict read is every step's one; beyond it a method reads only where it decides on data:
# adjacency how many retrieved nodes are new, graft whether a checkpoint fires (the firing one's graft size
# rides along), the TreeGraft loop what a strong call sends back: once for the strong layers run on the device
# from layer 1 on (the step rule's strong steps, fixed:1,2 ...), then once per call on the host (fixed:1,3 calls at
# layer 3 after a weak layer); never for a run over every layer that nothing reads on the host (all-mid), nor for a
# lone layer-1 call, made ahead and read with the step before's verdict (fixed:1,3, fixed:1).
LIMITS = {
    "ar": lambda calls: 1,
    "chain": lambda calls: 1,
    "dense": lambda calls: 1,
    "ngram": lambda calls: 1,
    "adjacency": lambda calls: 2,
    "graft": lambda calls: 1 + DECIDING_CHECKPOINTS,
    "all-small": lambda calls: 1,
    "all-mid": lambda calls: 1,
    "fixed:1,2": lambda calls: 2,
    "fixed:1,3": lambda calls: 2,
    "fixed:1": lambda calls: 1,
    "treegraft": lambda calls: 2,
}


def repetitive_prompt(seed: int) -> torch.Tensor:
    base = random_prompt(seed, length=12)
    return torch.cat([base, base, base[:6]])


def audited(pair, method: str) -> Generation:
    config = DecodeConfig(method=method, tree=TREE, max_new_tokens=32, method_options=_options(method))
    with SyncAuditor():
        return speculative(pair, config, repetitive_prompt(4))


def _options(method: str) -> dict:
    # costs that make the step rule take strong steps too, so both kinds are counted
    return {"verify_ms": 100.0, "strong_ms": 5.0} if method == "treegraft" else {}


@pytest.mark.parametrize("method", list(LIMITS))
def test_syncs_per_step_are_counted_honestly_and_within_the_limit(tiny_self_pair, method):
    generation = audited(tiny_self_pair, method)
    assert generation.steps
    for step in generation.steps:
        assert step.audited_syncs == step.syncs, f"a read outside the step's counter: {step}"
        strong_calls = step.drafter_calls.get("model", 0)
        assert 1 <= step.syncs <= LIMITS[method](strong_calls), step


# Every layer list of ``fixed`` at depth 4: the most reads a step takes. The verdict's, plus one for strong layers
# 1..r run on the device from the root (r >= 2; none when r is every layer: the run is cut on the device), plus one
# per strong call on the host, after a weak layer or after such a call; a lone call at layer 1 is made ahead and
# read with the step before's verdict. A weak layer works on the host: a strong call before it is read before it.
FIXED_READS = {
    "fixed:1": 1, "fixed:2": 2, "fixed:3": 2, "fixed:4": 2,
    "fixed:1,2": 2, "fixed:1,3": 2, "fixed:1,4": 2, "fixed:2,3": 3, "fixed:2,4": 3, "fixed:3,4": 3,
    "fixed:1,2,3": 2, "fixed:1,2,4": 3, "fixed:1,3,4": 3, "fixed:2,3,4": 4, "fixed:1,2,3,4": 1,
}


@pytest.mark.parametrize("method", list(FIXED_READS))
def test_every_layer_list_reads_once_per_host_strong_call_and_once_per_run(tiny_self_pair, method):
    steps = audited(tiny_self_pair, method).steps
    assert all(step.audited_syncs == step.syncs for step in steps)
    assert max(step.syncs for step in steps) == FIXED_READS[method]


def test_tree_methods_without_strong_calls_read_once_per_step(tiny_self_pair):
    for method in ("chain", "dense", "ngram", "all-small", "all-mid"):
        assert {step.syncs for step in audited(tiny_self_pair, method).steps} == {1}, method


# Torch calls per step outside model forwards (``SyncAuditor.torch_calls``): the noise-free proxy of host
# overhead (each call costs a few microseconds of Python and dispatch). About 10% above what the hot path
# makes on this prompt, so an extra op per node or per layer shows.
CALLS_PER_STEP = {
    "ar": 19,
    "chain": 90,
    "dense": 105,
    "ngram": 28,
    "adjacency": 115,
    "graft": 165,
    "all-small": 56,
    "all-mid": 138,
    "fixed:1,3": 199,
    "treegraft": 380,  # more slack: the step rule's choices follow measured times
}


@pytest.mark.parametrize("method", list(CALLS_PER_STEP))
def test_torch_calls_per_step_stay_within_the_bound(tiny_self_pair, method):
    drafter, target = tiny_self_pair
    config = DecodeConfig(method=method, tree=TREE, max_new_tokens=32, method_options=_options(method))
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model),
                                 eos_token_ids=target.eos_token_ids)
    prompt = repetitive_prompt(4)
    decoder.generate(prompt)  # first-call paths (allocations, cost measurements) are not the hot path
    auditor = SyncAuditor()
    with auditor:
        generation = decoder.generate(prompt)
    per_step = auditor.torch_calls / len(generation.steps)
    assert per_step <= CALLS_PER_STEP[method], f"{method}: {per_step:.1f} torch calls per step"



@pytest.mark.parametrize("method", ["dense", "treegraft"])
def test_decoding_runs_in_inference_mode_whatever_the_callers_mode(tiny_self_pair, method):
    """Every step runs in inference mode (each small op of the step is cheaper on the host); a caller with grad
    on, under ``no_grad`` or already in inference mode gets the same tokens and keeps its own modes."""
    drafter, target = tiny_self_pair
    config = DecodeConfig(method=method, tree=TREE, max_new_tokens=24, method_options=_options(method))
    decoder = SpeculativeDecoder(CausalLM(target.model), config, drafter=CausalLM(drafter.model),
                                 eos_token_ids=target.eos_token_ids)
    prompt = repetitive_prompt(5)
    modes_in_steps, outputs = [], []
    for context in (contextlib.nullcontext, torch.no_grad, torch.inference_mode):
        with context():
            before = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
            generation = decoder.generate(prompt, on_step=lambda _: modes_in_steps.append(torch.is_inference_mode_enabled()))
            assert (torch.is_grad_enabled(), torch.is_inference_mode_enabled()) == before
        outputs.append(generation.output_ids)
    assert modes_in_steps and all(modes_in_steps)
    assert outputs[0] == outputs[1] == outputs[2] == reference_greedy(target, prompt, 24)

def test_auditor_sees_what_the_counter_misses():
    x = torch.arange(6)
    auditor = SyncAuditor()
    with auditor:
        int(x[2])
        bool(x.any())
        x[x > 2] = 0  # boolean-mask indexing sizes its work from the data
        torch.nonzero(x)
        x.sum()  # not a synchronisation
        x[0] = 1  # one element from a host scalar: a blocking copy on CUDA
        x[torch.tensor([1, 2])] = 0  # through an index tensor, likewise
        x[1:3] = 0  # a slice: a fill, no wait
        x[0].fill_(1)  # likewise
        with uncounted():  # a model forward's own
            x.tolist()
        with host_only():  # host work on host tensors
            x.tolist()
    assert auditor.count == 6
    assert auditor.calls == {"__int__": 1, "__bool__": 1, "__setitem__": 3, "nonzero": 1}


def test_reads_count_once_per_transfer_on_both_counters():
    reads = HostReads()
    auditor = SyncAuditor()
    with auditor, counting(reads):
        assert read(torch.tensor([1, 2])) == [1, 2]
        a, b = fetch(torch.zeros(2), torch.ones(3))
        assert a.shape == (2,) and b.shape == (3,)
    assert reads.count == auditor.count == 2


class _WarnsLikeTheDriver(torch.overrides.TorchFunctionMode):
    """Raises the warning ``set_sync_debug_mode("warn")`` raises, from inside a torch call as the driver does."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.sum:
            warnings.warn("called a synchronizing CUDA operation", stacklevel=2)
        return func(*args, **(kwargs or {}))


def _a_synchronising_step(x: torch.Tensor) -> torch.Tensor:
    return x.sum()  # the line a site must name


def test_sync_sites_name_the_caller_not_the_auditor():
    sites: list[str] = []
    with recorded_sync_sites(sites), SyncAuditor(), _WarnsLikeTheDriver():
        _a_synchronising_step(torch.ones(3))
        torch.ones(3).mean()  # no warning: no site
        warnings.warn("an unrelated warning", stacklevel=2)
    line = _a_synchronising_step.__code__.co_firstlineno + 1
    assert len(sites) == 1
    assert f"{__file__}:{line}" in sites[0].split(" < ")  # the warning's own frame would be the auditor's
    assert "treegraft_cli/syncs.py" not in sites[0]
