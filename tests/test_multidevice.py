"""A target spread over devices (device_map="auto"): each layer's KV cache is committed on its own device.

On CPU the second device is PyTorch's ``meta`` device (shapes only): a cache whose later layers' block lives there
stands in for a second GPU, and a recording gather shows where each gather ran and with which index.
"""

from __future__ import annotations

import torch
from conftest import random_prompt

from treegraft_cli.kv_cache import BlockCache
from treegraft_cli.lm import CausalLM, gather_rows


class RecordingGather:
    """A ``GatherRows`` that records (tensor devices, index device) of every call, then gathers."""

    def __init__(self):
        self.calls: list[tuple[set[torch.device], torch.device, int]] = []

    def __call__(self, tensors, keep_positions, start) -> None:
        self.calls.append(({t.device for t in tensors}, keep_positions.device, len(tensors)))
        gather_rows(tensors, keep_positions, start)


def spread_lm(model, moved_from: int) -> CausalLM:
    """A CausalLM whose layers from ``moved_from`` on keep their rows in a second block, moved to ``meta`` after a forward
    of a random prompt (the layers run on the CPU: only the cache is spread)."""
    lm = CausalLM(model)
    layers = len(lm.cache.layers)
    cpu, meta = torch.device("cpu"), torch.device("meta")
    lm.cache = BlockCache(model.config, [cpu] * moved_from + [meta] * (layers - moved_from))
    return lm


def move_second_block(lm: CausalLM) -> None:
    block = lm.cache.blocks[1]
    block.buffer = block.buffer.to("meta")


def test_commit_gathers_each_layer_on_its_device(tiny_pair):
    _, target = tiny_pair
    layers = len(target.model.model.layers)
    lm = spread_lm(target.model, layers // 2)
    lm.forward(random_prompt(3, length=12))
    reference = [(layer.keys.clone(), layer.values.clone()) for layer in lm.cache.layers]
    move_second_block(lm)
    keep = torch.tensor([4, 7, 9])
    gather = RecordingGather()
    lm.commit(keep, 4, gather=gather)
    # one gather per device, with the positions copied to that device, over that device's block: one tensor each
    assert sorted((sorted(d.type for d in devices), index.type, n) for devices, index, n in gather.calls) == [
        (["cpu"], "cpu", 1),
        (["meta"], "meta", 1),
    ]
    assert lm.cache_length == 7
    for (keys, values), layer in zip(reference[: layers // 2], lm.cache.layers, strict=False):
        expected = torch.cat([keys[..., :4, :], keys[..., keep, :]], dim=-2)
        assert torch.equal(layer.keys, expected)
        assert torch.equal(layer.values, torch.cat([values[..., :4, :], values[..., keep, :]], dim=-2))
    for layer in lm.cache.layers[layers // 2 :]:
        assert layer.keys.device.type == "meta" and layer.keys.shape[-2] == 7


def test_crop_keeps_every_layer_on_its_device(tiny_pair):
    _, target = tiny_pair
    lm = spread_lm(target.model, 1)
    lm.forward(random_prompt(4, length=10))
    move_second_block(lm)
    lm.crop(6)
    assert [layer.keys.shape[-2] for layer in lm.cache.layers] == [6] * len(lm.cache.layers)
    assert lm.cache.layers[0].keys.device.type == "cpu" and lm.cache.layers[-1].keys.device.type == "meta"
