"""CausalLM: a Hugging Face causal LM with its own KV cache, driven one tree at a time.

All model code stays in transformers: tree attention goes through a 4-D additive float mask and
explicit position ids, which llama, qwen2 and gemma3 accept in transformers 5.x.

Feature drafters (EAGLE-3 heads) read the target's intermediate hidden states. ``capture_hidden_states``
makes every forward keep them in ``last_hidden``; they are taken by forward hooks on the decoder layers,
registered for the duration of one forward only, so no model code is copied and a model shared with a
layer-truncated drafter is not affected by the other's forwards.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel, StaticCache

from .capture import CAPTURED_ROWS, StaticForwards, bucket
from .kv_cache import BlockCache, cache_keyword
from .syncs import uncounted

GatherRows = Callable[[Sequence[torch.Tensor], torch.Tensor, int], None]


def gather_rows(
    tensors: Sequence[torch.Tensor],  # each [batch, kv_heads, seq, head_dim]: keys and values of every layer
    keep_positions: torch.Tensor,  # [m] ascending cache rows to keep
    start: int,
) -> None:
    """In place: row ``keep_positions[j]`` moves to ``start + j`` in every tensor (torch reference, one gather each)."""
    m = keep_positions.shape[0]
    if m == 0:
        return
    for tensor in tensors:
        tensor[..., start : start + m, :] = tensor.index_select(-2, keep_positions)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # visible: [n, kv] bool
    """The ``[1, 1, n, kv]`` float mask attention adds to its scores: 0 where visible, -inf-like elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def inference(method: Callable) -> Callable:
    """``torch.inference_mode()`` that only switches when it is off: a decoding loop already running in it
    (``SpeculativeDecoder.generate``) pays no mode switch per forward.

    Inference mode rather than ``no_grad``: tensors made in it carry no version counter and no autograd
    metadata, which makes every small op of a decoding step cheaper on the host (about a quarter per op on
    a CPU). Tensors made in it cannot be written in place outside it, so whatever keeps decoding state
    (caches, trees, tables) is written under it too.
    """

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return wrapper


def on_device_of(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor.to(device)``, skipping the call when it is there already (a no-op copy still costs a torch call)."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _keeps_rows(logits_to_keep: int | torch.Tensor) -> bool:
    """Whether ``CausalLM.forward`` passes ``logits_to_keep`` on: row indices, or a positive count."""
    return isinstance(logits_to_keep, torch.Tensor) or logits_to_keep > 0


def decoder_layers(model: PreTrainedModel) -> Sequence[torch.nn.Module]:
    """The decoder layer list of a causal LM (llama, qwen2/3, gemma3 text and their truncations)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no decoder layer list to capture hidden states from")
    return layers


class CausalLM:
    """A model plus its KV cache. ``cache_length`` counts the rows the cache holds."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self._cache_keyword = cache_keyword(model)
        self._device, self._dtype = model.device, model.dtype  # the model's properties walk its parameters
        self.cache: BlockCache | StaticCache = self._dynamic_cache()
        self.forward_calls = 0
        self.forward_s = 0.0  # time inside model forwards, for the draft / verify / host split
        self.synchronize_timing = False  # on CUDA, time forwards on the device (events; see settle_timing)
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # CUDA forwards not yet in forward_s
        self.capture_indices: tuple[int, ...] = ()
        self.last_hidden: torch.Tensor | None = None  # [n, len(capture_indices) * hidden] after a forward
        # static shapes (``use_static``): forwards run through StaticForwards over a StaticCache
        self.static: StaticForwards | None = None
        self._static_cache: StaticCache | None = None
        self._length = 0  # rows in use in the static cache
        # where the static cache writes next (its layers' own counts, on the device): past ``_length`` after a
        # padded forward until a crop or the next forward moves it back
        self._written = 0
        self._mask_constants: tuple[torch.Tensor, torch.Tensor] | None = None  # see ``mask_values``

    def capture_hidden_states(self, indices: Sequence[int]) -> None:
        """Keep these hidden states of every later forward in ``last_hidden``, concatenated in this order.

        Indices follow transformers' ``output_hidden_states``: 0 is the embedding output, k >= 1 the
        output of decoder layer k - 1.
        """
        count = len(decoder_layers(self.model))
        bad = [i for i in indices if not 0 <= i <= count]
        if bad:
            raise ValueError(f"hidden state indices {bad} outside 0..{count}")
        self.capture_indices = tuple(int(i) for i in indices)

    def _dynamic_cache(self) -> BlockCache:
        """The cache of the dynamic path, its full-attention layers' rows kept on each decoder layer's device."""
        try:
            layer_devices = [next(layer.parameters()).device for layer in decoder_layers(self.model)]
        except (AttributeError, TypeError, StopIteration):  # no decoder layer list (a head): rows on the model's device
            layer_devices = None
        return BlockCache(self.model.config, layer_devices)

    @property
    def device(self) -> torch.device:
        """Where inputs go: the device of the model's first parameters (its embeddings)."""
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def cache_length(self) -> int:
        if self.static is not None:
            return self._length
        cache = self.cache
        return cache.length if isinstance(cache, BlockCache) else cache.get_seq_length()  # transformers' own: a benchmark's

    def use_static(self, mode: str, capacity: int) -> None:
        """Forwards with static shapes (``capture.py``) over a StaticCache of at least ``capacity`` rows; mode
        ``off``: the dynamic path. Takes effect at the next ``reset``.

        The cache and its forwards (their compiled function or captured graphs) are kept while they fit, so
        later requests replay what the first one captured.
        """
        if mode == "off":
            self.static, self._static_cache = None, None
            return
        static = self.static
        if static is None or static.mode != mode or static.capacity < capacity:
            self.static = StaticForwards(self.model, mode, capacity, self.dtype, self.device)
            self._static_cache = StaticCache(config=self.model.config, max_cache_len=capacity)

    def reset(self) -> None:
        self.last_hidden = None
        if self.static is None:
            if isinstance(self.cache, BlockCache):
                self.cache.clear()
            else:
                self.cache = self._dynamic_cache()
            return
        self.cache = self._static_cache
        self._crop_layers(self._filled_layers(), 0)  # the last request's rows: the write position goes back

    @inference
    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        position_ids: torch.Tensor | None = None,  # [n]; default: continue after the cache
        visible: torch.Tensor | None = None,  # [n, cache_length + n] bool; default: causal
        logits_to_keep: int | torch.Tensor = 0,  # or [r] row indices on the device
        mask: torch.Tensor | None = None,  # [n, cache_length + n] or [1, 1, n, cache_length + n] additive, in
        # self.dtype: instead of ``visible``
    ) -> torch.Tensor:
        """Append ``input_ids`` to the cache and return their logits ``[n, vocab]``.

        ``logits_to_keep`` > 0 returns only the last that many rows: a drafter catching up on a long
        prompt needs the last row alone, and the LM head over every prompt row would cost as much as a
        third of the forward. A tensor of row indices returns those rows (``[r, vocab]``): rows the host has not read
        yet. A caller that builds the additive ``mask`` itself spares the bool one's conversion.
        """
        if mask is None and visible is not None:
            mask = additive_mask(visible, self.dtype)  # [1, 1, n, width]: taken as it is below
        if self.static is not None:
            rows_mask = mask if mask is None or mask.ndim == 2 else mask[0, 0]
            return self._forward_static_rows(input_ids, position_ids, rows_mask, logits_to_keep)
        return self._forward(input_ids, position_ids, mask if mask is None or mask.ndim == 4 else mask[None, None],
                             logits_to_keep)

    def _forward_static_rows(self, input_ids, position_ids, mask, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """``forward`` over the static cache: padded to a bucket (``StaticForwards.rows_inputs``) up to
        ``CAPTURED_ROWS`` rows, else eagerly with the mask widened to the whole cache (no mask: causal, which the
        model builds)."""
        n, prefix, static = input_ids.shape[0], self._length, self.static
        self._rewind()
        if n > CAPTURED_ROWS:
            static.fitting(n, prefix, padded=False)
            if mask is not None:
                wide = mask.new_full((n, static.capacity), torch.finfo(self.dtype).min)
                wide[:, : mask.shape[-1]] = mask
                mask = wide[None, None]
            return self._forward(input_ids, position_ids, mask, logits_to_keep)
        if position_ids is None:
            position_ids = torch.arange(prefix, prefix + n, device=self.device)
        logits = self._run_static(static.rows_inputs(input_ids, position_ids, mask, prefix), prefix, n)
        if isinstance(logits_to_keep, torch.Tensor):
            logits = logits.index_select(0, logits_to_keep)
        else:
            logits = logits[n - logits_to_keep : n] if 0 < logits_to_keep < n else logits[:n]
        # a drafter keeps rows of one forward while it runs the next, which a replay would write over
        return logits.clone() if static.reuses_outputs else logits

    @inference
    def _forward(
        self,
        input_ids: torch.Tensor,  # [n]
        position_ids: torch.Tensor | None,  # [n]
        attention_mask: torch.Tensor | None,  # [1, 1, n, cache_length + n] additive
        logits_to_keep: int | torch.Tensor = 0,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        if position_ids is None:
            start = self.cache_length
            position_ids = torch.arange(start, start + n, device=self.device)
        events = self._device_timing()
        started = time.perf_counter()
        with self._capturing() as captured, uncounted():
            out = self.model(
                input_ids=input_ids[None],
                position_ids=position_ids[None],
                attention_mask=attention_mask,
                **{self._cache_keyword: self.cache},
                use_cache=True,
                **({"logits_to_keep": logits_to_keep} if _keeps_rows(logits_to_keep) else {}),
            )
        if self.capture_indices:
            self.last_hidden = torch.cat([captured[i][0].to(self.device) for i in self.capture_indices], dim=-1)
        if self.static is not None:
            self._length = self._written = self._length + n
        self._count_forward(events, started)
        return out.logits[0]

    def _device_timing(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """A started pair of CUDA events when forwards are timed on the device, else None (wall time)."""
        if not (self.synchronize_timing and self._device.type == "cuda"):
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        return events

    def _count_forward(self, events, started: float) -> None:
        """Add one forward's time: wall time on CPU, CUDA events (read later, without a sync) on a GPU."""
        if events is None:
            self.forward_s += time.perf_counter() - started
        else:
            events[1].record()
            self._timed.append(events)
        self.forward_calls += 1

    def settle_timing(self) -> None:
        """Add the device time of the forwards timed with events to ``forward_s``; call after a synchronisation."""
        for begin, end in self._timed:
            self.forward_s += begin.elapsed_time(end) / 1e3
        self._timed.clear()

    @contextmanager
    def _capturing(self) -> Iterator[dict[int, torch.Tensor]]:
        """Hooks that store the captured hidden states ``{index: [1, n, hidden]}`` during one forward."""
        captured: dict[int, torch.Tensor] = {}
        handles = []
        if self.capture_indices:
            layers = decoder_layers(self.model)
            for index in set(self.capture_indices):
                module = self.model.get_input_embeddings() if index == 0 else layers[index - 1]
                handles.append(module.register_forward_hook(_store_output(captured, index)))
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()

    def forward_tree(
        self,
        tokens: torch.Tensor,  # [n] tree tokens, root first
        depths: torch.Tensor,  # [n]
        ancestor_mask: torch.Tensor,  # [n, n] bool
    ) -> torch.Tensor:
        """Verification forward: each node sees the whole cache plus its own ancestors."""
        prefix = self.cache_length
        n = tokens.shape[0]
        if self.static is not None:
            return self._forward_static(tokens, depths, ancestor_mask, prefix)
        if n == 1:
            return self.forward(tokens)
        # the tree's part picked from two constants, the committed prefix (all visible: 0) padded in front
        visible, hidden = self.mask_values()
        mask = torch.nn.functional.pad(torch.where(ancestor_mask, visible, hidden), (prefix, 0))  # [1, 1, n, prefix + n]
        return self._forward(tokens, prefix + depths, mask)

    def mask_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Additive-mask values ``[1, 1, 1, 1]`` in the model's dtype on its device, made once: visible (0), hidden.
        ``torch.where`` of an ``[n, width]`` bool mask between them is the model's 4-D mask, with no reshaping call."""
        if self._mask_constants is None:
            zero = torch.zeros((1, 1, 1, 1), dtype=self.dtype, device=self.device)
            self._mask_constants = (zero, torch.full_like(zero, torch.finfo(self.dtype).min))
        return self._mask_constants

    @inference
    def _forward_static(self, tokens, depths, ancestor_mask, prefix: int) -> torch.Tensor:  # -> [n, vocab]
        """The padded verify forward: the cache holds the tree's rows, and the padding's until the commit's crop."""
        n = tokens.shape[0]
        self._rewind()
        return self._run_static(self.static.tree_inputs(tokens, depths, ancestor_mask, prefix), prefix, n)[:n]

    def _run_static(self, buffers: dict[str, torch.Tensor], prefix: int, n: int) -> torch.Tensor:  # -> [bucket, vocab]
        """Run the bucket whose ``buffers`` hold ``n`` rows written at ``prefix``, timed as a forward; the cache then
        holds the ``n`` rows and writes next after their padding."""
        events = self._device_timing()
        started = time.perf_counter()
        with uncounted():
            logits = self.static.run(self.cache, buffers)
        self._length, self._written = prefix + n, prefix + bucket(n)
        self._count_forward(events, started)
        return logits

    @inference
    def commit(self, keep_positions: torch.Tensor, start: int, gather: GatherRows | None = None) -> None:
        """Move the cache rows at ``keep_positions`` ([m], ascending) to ``start..start+m`` and drop all rows after.

        ``gather`` moves the rows of many keys and values tensors at once (module-level ``gather_rows``, or the Triton
        kernel with the same signature): each device's ``KVBlock`` is one such tensor, the layers of other kinds one
        tensor each, and the crop after it only sets lengths and narrows views. A target spread over several devices
        (``device_map="auto"``) keeps each layer's cache on its layer's device: the rows are gathered per device, with
        the positions copied to each device once.
        """
        m = keep_positions.shape[0]
        if m:
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for tensor in self._row_tensors():
                by_device.setdefault(tensor.device, []).append(tensor)
            for device, tensors in by_device.items():
                (gather or gather_rows)(tensors, on_device_of(keep_positions, device), start)
        self.crop(start + m)

    def _row_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding cache rows on dim -2: the blocks' buffers, then the other layers' keys and values."""
        blocks = self.cache.blocks if isinstance(self.cache, BlockCache) else []
        buffers = [block.buffer for block in blocks if block.buffer is not None]
        return buffers + [t for layer in self._filled_layers() for t in (layer.keys, layer.values)]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cache rows."""
        if isinstance(self.cache, BlockCache):
            for block in self.cache.blocks:
                block.crop(length)
        self._crop_layers(self._filled_layers(), length)

    def _rewind(self) -> None:
        """Move a static cache's write position back to its last row in use (past it: a padded forward's padding)."""
        if self._written != self._length:
            self._crop_layers(self._filled_layers(), self._length)

    def _filled_layers(self) -> list:
        """Layers whose own keys and values hold rows: a block cache's other kinds, every layer of any other cache."""
        layers = self.cache.other_layers if isinstance(self.cache, BlockCache) else self.cache.layers
        return [layer for layer in layers if getattr(layer, "is_initialized", True) and layer.keys is not None]

    def _crop_layers(self, layers: Sequence, end: int) -> None:
        if self.static is not None:  # a static cache keeps its tensors: only the write position moves back
            if end < self._written:
                for layer in layers:
                    layer.cumulative_length.fill_(end)
                self._written = end
            self._length = min(self._length, end)
            return
        for layer in layers:
            if layer.keys.shape[-2] > end:
                layer.keys = layer.keys[..., :end, :]
                layer.values = layer.values[..., :end, :]


@contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Make ``device`` current while kernels are launched on its tensors (Triton launches on the current CUDA device)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield


def _store_output(captured: dict[int, torch.Tensor], index: int) -> Callable:
    def hook(module, args, output) -> None:
        # decoder layers return a tensor in transformers 5.x; older-style layers a tuple led by it
        captured[index] = output[0] if isinstance(output, tuple) else output

    return hook
