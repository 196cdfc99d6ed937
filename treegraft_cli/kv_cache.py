"""The decoding KV cache: every full-attention layer on a device keeps its rows in one preallocated buffer.

A *row* is one token's keys (or values) in one layer. transformers' ``DynamicLayer`` appends a forward's rows with
``torch.cat`` (a new tensor: the whole layer copied at every forward), and a step's crop and commit touch each layer
on its own (a slice, a gather and a write per keys or values tensor: 181 tensor calls per commit on SmolLM2-135M's
30 layers). Here the full-attention layers that live on one device are slices of one ``KVBlock``, a buffer
``[2 · layers · batch, kv_heads, capacity, head_dim]`` whose first dimension holds layer 0's keys, layer 0's values,
layer 1's keys, and so on (``batch`` entries each):

- a forward writes its rows in place, one write per keys or values tensor (no copy of the rows before them);
- a crop sets the block's length: no tensor call;
- a commit moves the kept rows of every layer at once: one gather over the buffer (``lm.gather_rows`` or the
  Triton kernel, which take it as one tensor whose batch is every layer's keys and values).

When a forward needs more rows the capacity grows to half again the rows in use; the buffer is kept for the next
request. Layers of other kinds (sliding windows, linear attention) stay transformers' own and are cropped and
committed layer by layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

MIN_CAPACITY = 256  # rows a block holds at first, at least: a prompt and a few steps without growing


def cache_keyword(module: torch.nn.Module) -> str:
    """The keyword under which ``module``'s forward takes the KV cache: ``cache`` from transformers 5.24 on (where
    ``past_key_values`` is deprecated), ``past_key_values`` before it."""
    return "cache" if "cache" in inspect.signature(module.forward).parameters else "past_key_values"


class KVBlock:
    """The rows of the full-attention layers on one device: one buffer, one length (every layer holds as many rows).

    A forward's rows count once every layer of the block has written them; until then ``length`` is the rows before
    the forward, which every layer writes after.
    """

    def __init__(self, layers: int):
        self.layers = layers
        self.buffer: torch.Tensor | None = None  # [2 · layers · batch, kv_heads, capacity, head_dim]
        self.length = 0
        self._end = -1  # rows after the forward being written, -1 between forwards
        self._writes = 0  # layers that wrote the forward's rows
        self._views: tuple[torch.Tensor, ...] = ()  # [batch, kv_heads, end, head_dim] per keys or values tensor

    @property
    def capacity(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[-2]

    def write(
        self,
        slot: int,  # the layer's place in the block
        keys: torch.Tensor,  # [batch, kv_heads, n, head_dim]
        values: torch.Tensor,  # [batch, kv_heads, n, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # every row of the layer, the new ones last: [batch, kv_heads, end, head_dim]
        """Write a forward's rows of one layer after the block's rows; the layer's keys and values as attention reads
        them. The first layer of a forward makes every layer's views (two calls, instead of one per layer)."""
        if self._end < 0:
            self._begin(keys, self.length + keys.shape[-2])
        key_rows, value_rows = self._views[2 * slot], self._views[2 * slot + 1]
        key_rows[:, :, self.length :] = keys
        value_rows[:, :, self.length :] = values
        self._writes += 1
        if self._writes == self.layers:
            self.settle()
        return key_rows, value_rows

    def _begin(self, like: torch.Tensor, end: int) -> None:  # like: [batch, kv_heads, n, head_dim]
        if end > self.capacity or self.buffer.dtype != like.dtype or self.buffer.device != like.device:
            self._grow(like, end)
        self._end = end
        self._views = self.buffer[:, :, :end].split(like.shape[0])

    def _grow(self, like: torch.Tensor, end: int) -> None:
        batch, heads, _, head_dim = like.shape
        capacity = max(MIN_CAPACITY, end + end // 2)  # room for a long answer; at most half again the rows in use
        buffer = like.new_empty(2 * self.layers * batch, heads, capacity, head_dim)
        if self.length:
            buffer[:, :, : self.length] = self.buffer[:, :, : self.length]
        self.buffer = buffer

    def settle(self) -> None:
        """The forward is written: its rows are the block's from now on."""
        if self._end >= 0:
            self.length, self._end, self._writes = self._end, -1, 0

    def crop(self, length: int) -> None:
        self.settle()
        self.length = min(self.length, length)

    def rows(self, slot: int, values: bool) -> torch.Tensor | None:  # [batch, kv_heads, length, head_dim]
        """One layer's keys (or values) as they stand: for inspection, not for the hot path."""
        if self.buffer is None:
            return None
        batch = self.buffer.shape[0] // (2 * self.layers)
        first = (2 * slot + values) * batch
        return self.buffer[first : first + batch, :, : self.length]


class BlockLayer(DynamicLayer):
    """A full-attention layer whose rows live in a ``KVBlock`` (``slot``: its place there)."""

    def __init__(self, block: KVBlock, slot: int):
        super().__init__()
        self.block, self.slot = block, slot

    # ``keys`` and ``values`` ([batch, kv_heads, length, head_dim]) read the block; transformers' own code sets them
    # (to None) only on init and reset, where the block is what counts
    keys = property(lambda self: self.block.rows(self.slot, False), lambda self, _: None)
    values = property(lambda self: self.block.rows(self.slot, True), lambda self, _: None)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.is_initialized = key_states.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.block.write(self.slot, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.block.length

    def reset(self) -> None:
        self.block.crop(0)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes the negative number of rows to remove")
        self.block.crop(self.block.length + tokens_to_remove)

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise TypeError("a BlockCache keeps the batch it was filled with; beam search needs transformers' DynamicCache")

    batch_select_indices = reorder_cache = batch_repeat_interleave


class BlockCache(DynamicCache):
    """transformers' ``DynamicCache`` for a model's config, its full-attention layers on ``KVBlock``s by device.

    ``layer_devices``: the device of every decoder layer, whose cache rows live there (a model spread over devices by
    ``device_map="auto"``); None: one block for every full-attention layer.
    """

    def __init__(self, config: PreTrainedConfig, layer_devices: Sequence[torch.device] | None = None):
        super().__init__(config=config)
        full = [i for i, layer in enumerate(self.layers) if type(layer) is DynamicLayer]
        devices = [None if layer_devices is None else layer_devices[i] for i in full]
        blocks = {device: KVBlock(devices.count(device)) for device in dict.fromkeys(devices)}
        slots = dict.fromkeys(blocks, 0)
        for index, device in zip(full, devices, strict=True):
            self.layers[index] = BlockLayer(blocks[device], slots[device])
            slots[device] += 1
        self.blocks = list(blocks.values())
        # the layers cropped and committed one by one: transformers' own kinds
        self.other_layers = [layer for layer in self.layers if not isinstance(layer, BlockLayer)]

    @property
    def length(self) -> int:
        """Rows held: every layer holds as many."""
        if self.blocks:
            return self.blocks[0].length
        return self.get_seq_length()

    def clear(self) -> None:
        """No rows, the buffers kept: a new request."""
        for block in self.blocks:
            block.crop(0)
        for layer in self.other_layers:
            layer.reset()
