"""The KV cache of the dynamic path (``kv_cache.py``): full-attention layers in one buffer per device, written in
place, grown when full, cropped by a length and committed by one gather."""

from __future__ import annotations

import copy

import torch
from conftest import random_prompt, reference_greedy
from transformers import DynamicCache

from treegraft_cli import kv_cache
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.kv_cache import BlockCache, BlockLayer
from treegraft_cli.lm import CausalLM, gather_rows


def test_layers_share_one_block_per_device(tiny_pair):
    _, target = tiny_pair
    config = target.model.config
    layers = config.num_hidden_layers
    cpu, meta = torch.device("cpu"), torch.device("meta")
    cache = BlockCache(config, [cpu] * 2 + [meta] * (layers - 2))
    assert [block.layers for block in cache.blocks] == [2, layers - 2]
    assert all(isinstance(layer, BlockLayer) for layer in cache.layers)
    assert [(cache.blocks.index(layer.block), layer.slot) for layer in cache.layers] == [
        (0, 0), (0, 1), *((1, i) for i in range(layers - 2))
    ]
    assert len(BlockCache(config).blocks) == 1


def test_rows_and_logits_equal_transformers_dynamic_cache(tiny_pair, monkeypatch):
    """Forwards that outgrow the buffer twice: the same rows and logits as transformers' own cache."""
    monkeypatch.setattr(kv_cache, "MIN_CAPACITY", 8)
    _, target = tiny_pair
    lm = CausalLM(target.model)
    reference = DynamicCache(config=target.model.config)
    prompt = random_prompt(1, length=40)
    for chunk in (prompt[:6], prompt[6:7], prompt[7:20], prompt[20:]):  # capacity 9, then 30, then 60
        ours = lm.forward(chunk)
        start = reference.get_seq_length()
        positions = torch.arange(start, start + chunk.numel())[None]
        with torch.inference_mode():
            theirs = target.model(input_ids=chunk[None], position_ids=positions, cache=reference, use_cache=True).logits[0]
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert lm.cache_length == reference.get_seq_length() == 40
    assert lm.cache.blocks[0].capacity == 60
    for layer, expected in zip(lm.cache.layers, reference.layers, strict=True):
        torch.testing.assert_close(layer.keys, expected.keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(layer.values, expected.values, atol=1e-6, rtol=1e-6)


def test_crop_sets_a_length_and_the_next_forward_writes_after_it(tiny_pair):
    _, target = tiny_pair
    lm = CausalLM(target.model)
    prompt = random_prompt(2, length=12)
    lm.forward(torch.cat([prompt[:8], torch.tensor([5, 6, 7])]))  # three rows to drop
    lm.crop(8)
    assert lm.cache_length == 8
    logits = lm.forward(prompt[8:])
    fresh = CausalLM(target.model)
    torch.testing.assert_close(logits, fresh.forward(prompt)[8:], atol=1e-5, rtol=1e-5)


def test_commit_is_one_gather_per_device(tiny_pair):
    _, target = tiny_pair
    lm = CausalLM(target.model)
    lm.forward(random_prompt(3, length=10))
    calls = []

    def gather(tensors, keep_positions, start):
        calls.append(len(tensors))
        gather_rows(tensors, keep_positions, start)

    lm.commit(torch.tensor([6, 8]), 5, gather=gather)
    assert calls == [1] and lm.cache_length == 7


def test_a_new_request_keeps_the_buffer(tiny_pair):
    _, target = tiny_pair
    lm = CausalLM(target.model)
    lm.forward(random_prompt(4, length=10))
    buffer = lm.cache.blocks[0].buffer
    lm.reset()
    assert lm.cache_length == 0
    prompt = random_prompt(5, length=10)
    logits = lm.forward(prompt)
    assert lm.cache.blocks[0].buffer is buffer
    torch.testing.assert_close(logits, CausalLM(target.model).forward(prompt), atol=0, rtol=0)


def test_cache_keyword_follows_the_forward_signature():
    """transformers 5.24 renamed the forwards' ``past_key_values`` to ``cache``; the cache goes under whichever the
    installed release takes (under the other name an older release would decode without a cache)."""

    class Older(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs): ...

    class Newer(torch.nn.Module):
        def forward(self, input_ids, cache=None, **kwargs): ...

    assert kv_cache.cache_keyword(Older()) == "past_key_values"
    assert kv_cache.cache_keyword(Newer()) == "cache"


def test_a_model_that_takes_past_key_values_decodes_exactly(tiny_self_pair):
    """A transformers release before 5.24 names the forward's cache ``past_key_values``: decoding through such a
    model keeps its cache (under ``cache=`` it would see only each forward's own rows) and stays exact."""
    drafter, target = tiny_self_pair

    class OlderSignature(type(target.model)):
        def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, use_cache=None,
                    **kwargs):
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   cache=past_key_values, use_cache=use_cache, **kwargs)

    model = copy.deepcopy(target.model)
    model.__class__ = OlderSignature
    prompt = random_prompt(seed=21)
    config = DecodeConfig(method="dense", tree=TreeConfig(budget=12, depth=4, top_k=3), max_new_tokens=12)
    decoder = SpeculativeDecoder(CausalLM(model), config, drafter=CausalLM(drafter.model))
    generation = decoder.generate(prompt)
    assert generation.output_ids == reference_greedy(target, prompt, 12)
    assert max(step.accepted_length for step in generation.steps) > 1
