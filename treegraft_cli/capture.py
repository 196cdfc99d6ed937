"""Forwards with static shapes, run eagerly, compiled, or replayed from CUDA graphs (``--compile``).

``DecodeConfig.compile``:

- ``off``: the dynamic path (``CausalLM`` with a growing ``DynamicCache``, a mask as wide as the cache);
- ``static``: static shapes run eagerly: what ``compile`` and ``cudagraphs`` capture, for testing and debugging;
- ``compile``: static shapes through ``torch.compile`` (``reduce-overhead`` on CUDA);
- ``cudagraphs``: static shapes, one CUDA graph per row-count bucket, captured at first use and replayed.

Static shapes apply to the target's verify forward and to the model drafter's forwards alike: each model's cache
is a transformers ``StaticCache`` of ``capacity`` rows (its tensors never move, so a captured graph keeps pointing
at them), the rows of a forward are padded to a power-of-two bucket (1, 2, 4, ... rows), and the attention mask
spans the whole cache. A padding row sees only itself (in a verified tree: the root and itself); its logits are
dropped and its cache row is never visible to a real row and is cut or overwritten later, so it changes nothing a
real row computes: outputs are exact like every other path. Forwards of more than ``CAPTURED_ROWS`` rows (a
prompt) run eagerly over the static cache, unpadded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import ConfigError
from .kv_cache import cache_keyword

MODES = ("off", "static", "compile", "cudagraphs")
CAPTURED_ROWS = 64  # padded forwards of at most this many rows; a longer one (a prompt) runs eagerly


def bucket(n: int) -> int:
    """The padded tree size: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


def check_mode(mode: str, device: torch.device, models: Sequence[torch.nn.Module] = ()) -> None:
    """Refuse a mode the run cannot take: ``cudagraphs`` off CUDA, or over ``models`` whose weights sit on more than
    one device (a graph is captured on one device's stream)."""
    if mode not in MODES:
        raise ConfigError(f"unknown --compile mode {mode!r}", f"use one of: {', '.join(MODES)}")
    if mode != "cudagraphs":
        return
    if device.type != "cuda":
        raise ConfigError("--compile cudagraphs needs a CUDA target", "use --compile off, static or compile on this device")
    devices = sorted({str(p.device) for model in models for p in model.parameters()})
    if len(devices) > 1:
        raise ConfigError(f"--compile cudagraphs captures on one GPU, but the models are spread over {', '.join(devices)}",
                          "load the target and drafter on one GPU, or use --compile off or static")


class StaticForwards:
    """Runs one model's padded forwards over one ``StaticCache`` (see the module docstring): a tree's verification
    (``tree_inputs``) or rows with a given mask or a causal one (``rows_inputs``, the drafter's forwards) are written
    into the bucket's buffers, then ``run``."""

    def __init__(self, model: torch.nn.Module, mode: str, capacity: int, dtype: torch.dtype, device: torch.device):
        self.model, self.mode, self.capacity = model, mode, capacity
        self.dtype, self.device = dtype, device
        self.cache_keyword = cache_keyword(model)
        self.runners: dict[int, Callable[[], torch.Tensor]] = {}  # bucket → run the forward on its buffers
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.compiled = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default",
                                      dynamic=False) if mode == "compile" else None
        self.graphs = CudaGraphs(device) if mode == "cudagraphs" else None  # what captures and replays the buckets
        # a replayed graph writes its logits into the same buffer every time
        self.reuses_outputs = mode == "cudagraphs" or (mode == "compile" and device.type == "cuda")

    def tree_inputs(
        self,
        tokens: torch.Tensor,  # [n] tree tokens, root first
        depths: torch.Tensor,  # [n]
        ancestor_mask: torch.Tensor,  # [n, n] bool
        prefix: int,  # the root's cache row
    ) -> dict[str, torch.Tensor]:
        """The bucket's buffers, holding a tree's verify inputs; padding nodes hang from the root."""
        buffers = self._buffers(self.fitting(tokens.shape[0], prefix))
        self._fill_tree(buffers, tokens, depths, ancestor_mask, prefix)
        return buffers

    def rows_inputs(
        self,
        tokens: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        mask: torch.Tensor | None,  # [n, width] additive over cache rows 0..width-1 (later ones hidden); None: causal
        prefix: int,  # the first row's cache row
    ) -> dict[str, torch.Tensor]:
        """The bucket's buffers, holding ``n`` rows that see what ``mask`` shows them (or every row up to their own)."""
        buffers = self._buffers(self.fitting(tokens.shape[0], prefix))
        self._fill_rows(buffers, tokens, positions, mask, prefix)
        return buffers

    def run(self, cache, buffers: dict[str, torch.Tensor]) -> torch.Tensor:  # -> [size, vocab]
        """The forward of the bucket whose ``buffers`` hold the inputs, over ``cache`` (its StaticCache)."""
        size = buffers["tokens"].shape[1]
        if size not in self.runners:
            self.runners[size] = self._runner(cache, buffers)
        return self.runners[size]()

    def fitting(self, n: int, prefix: int, padded: bool = True) -> int:
        """The rows ``n`` rows take after ``prefix`` (their bucket, when ``padded``), checked against the capacity."""
        size = bucket(n) if padded else n
        if prefix + size > self.capacity:
            raise ConfigError(f"the static cache holds {self.capacity} rows, a forward needs {prefix + size}",
                              "raise max new tokens' headroom or use --compile off")
        return size

    def _buffers(self, size: int) -> dict[str, torch.Tensor]:
        if size not in self.buffers:
            self.buffers[size] = {
                "tokens": torch.zeros(1, size, dtype=torch.long, device=self.device),
                "positions": torch.zeros(1, size, dtype=torch.long, device=self.device),
                "mask": torch.zeros(1, 1, size, self.capacity, dtype=self.dtype, device=self.device),
            }
        return self.buffers[size]

    def _fill_tree(self, buffers, tokens, depths, ancestor_mask, prefix: int) -> None:
        """Write a tree's inputs into the bucket's buffers in place (a captured graph reads them there)."""
        n, size = tokens.shape[0], buffers["tokens"].shape[1]
        low = torch.finfo(self.dtype).min
        buffers["tokens"].zero_()
        buffers["tokens"][0, :n] = tokens
        buffers["positions"].fill_(prefix + 1)  # padding nodes: children of the root
        buffers["positions"][0, :n] = prefix + depths
        mask = buffers["mask"][0, 0]  # [size, capacity]
        mask.fill_(low)
        mask[:, :prefix] = 0
        tree = mask[:, prefix : prefix + size]
        tree[:n, :n].masked_fill_(ancestor_mask, 0)
        tree[n:, n:].diagonal().fill_(0)  # itself
        tree[n:, 0] = 0  # and the root

    def _fill_rows(self, buffers, tokens, positions, mask_rows, prefix: int) -> None:
        """Write plain rows' inputs into the bucket's buffers in place; padding rows see only themselves (their
        token and position are whatever an earlier forward left, valid values that only their own rows read)."""
        n, size = tokens.shape[0], buffers["tokens"].shape[1]
        low = torch.finfo(self.dtype).min
        buffers["tokens"][0, :n] = tokens
        buffers["positions"][0, :n] = positions
        mask = buffers["mask"][0, 0]  # [size, capacity]
        mask.fill_(low)
        if mask_rows is None:  # row j sees every cache row up to its own, prefix + j (padding rows alike)
            mask.triu_(prefix + 1)
            return
        mask[:n, : mask_rows.shape[1]] = mask_rows
        if size > n:
            mask[n:, prefix + n : prefix + size].diagonal().fill_(0)

    def _runner(self, cache, buffers) -> Callable[[], torch.Tensor]:
        def call(model) -> torch.Tensor:
            return model(input_ids=buffers["tokens"], position_ids=buffers["positions"], attention_mask=buffers["mask"],
                         **{self.cache_keyword: cache}, use_cache=True).logits[0]

        if self.mode == "static":
            return lambda: call(self.model)
        if self.mode == "compile":
            return lambda: call(self.compiled)
        return self._captured(cache, buffers, call)

    def _captured(self, cache, buffers, call) -> Callable[[], torch.Tensor]:
        """The forward on the bucket's buffers captured by ``graphs``; the cache's write position is restored around
        every warm-up and the capture, so only replays advance it."""
        # read as host numbers, once per capture: a layer's first forward (here, when a drafter's first forward is
        # short) allocates its tensors and replaces its write position with one on the layer's device
        start = [int(layer.cumulative_length) for layer in cache.layers]

        def restore() -> None:
            for layer, value in zip(cache.layers, start, strict=True):
                layer.cumulative_length.fill_(value)

        self.graphs.warm_up(lambda: call(self.model), restore)
        replay = self.graphs.capture(lambda: call(self.model))
        restore()
        # the first request is served by a replay too, so every step runs the same code
        return replay


class CudaGraphs:
    """Captures a forward as a CUDA graph on ``device`` and replays it. A replay writes its output into the tensor
    the capture returned, every time."""

    def __init__(self, device: torch.device):
        self.device = device

    def warm_up(self, run: Callable[[], torch.Tensor], restore: Callable[[], None]) -> None:
        """Run twice on a side stream before capturing (allocator, kernel selection), ``restore`` after each."""
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
                restore()
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Record ``run`` (a capture launches nothing) and return its replay."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay
