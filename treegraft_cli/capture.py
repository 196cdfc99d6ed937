"""A verify forward with static shapes, run eagerly, compiled, or replayed from CUDA graphs (``--compile``).

``DecodeConfig.compile``:

- ``off``: the dynamic path (``CausalLM`` with a growing ``DynamicCache``, a mask as wide as the cache);
- ``static``: static shapes run eagerly: what ``compile`` and ``cudagraphs`` capture, for testing and debugging;
- ``compile``: static shapes through ``torch.compile`` (``reduce-overhead`` on CUDA);
- ``cudagraphs``: static shapes, one CUDA graph per tree-size bucket, captured at first use and replayed.

Static shapes: the target's cache is a transformers ``StaticCache`` of ``capacity`` rows (its tensors never move,
so a captured graph keeps pointing at them), the tree is padded to a power-of-two bucket (1, 2, 4, ... nodes), and
the attention mask spans the whole cache. Padding nodes hang from the root and see only the root and themselves;
their logits are dropped before verification and their cache rows are cut at the commit, so they are never
accepted and change nothing a real node computes: outputs are exact like every other path. The drafter's
forwards stay dynamic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import ConfigError

MODES = ("off", "static", "compile", "cudagraphs")


def bucket(n: int) -> int:
    """The padded tree size: the next power of two."""
    return 1 << max(0, n - 1).bit_length()


def check_mode(mode: str, device: torch.device) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown --compile mode {mode!r}", f"use one of: {', '.join(MODES)}")
    if mode == "cudagraphs" and device.type != "cuda":
        raise ConfigError("--compile cudagraphs needs a CUDA target", "use --compile off, static or compile on this device")


class StaticVerifier:
    """Runs the padded verify forward of one model for one ``StaticCache`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, mode: str, capacity: int, dtype: torch.dtype, device: torch.device):
        self.model, self.mode, self.capacity = model, mode, capacity
        self.dtype, self.device = dtype, device
        self.runners: dict[int, Callable[[], torch.Tensor]] = {}  # bucket → run the forward on its buffers
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}
        self.compiled = torch.compile(model, mode="reduce-overhead" if device.type == "cuda" else "default",
                                      dynamic=False) if mode == "compile" else None

    def forward(
        self,
        cache,  # the model's StaticCache, ``prefix`` rows in use
        tokens: torch.Tensor,  # [n] tree tokens, root first
        depths: torch.Tensor,  # [n]
        ancestor_mask: torch.Tensor,  # [n, n] bool
        prefix: int,
    ) -> torch.Tensor:  # [n, vocab]
        n, size = tokens.shape[0], bucket(tokens.shape[0])
        if prefix + size > self.capacity:
            raise ConfigError(f"the static cache holds {self.capacity} rows, a step needs {prefix + size}",
                              "raise max new tokens' headroom or use --compile off")
        buffers = self._buffers(size)
        self._fill(buffers, tokens, depths, ancestor_mask, prefix)
        if size not in self.runners:
            self.runners[size] = self._runner(cache, buffers)
        return self.runners[size]()[:n]

    def _buffers(self, size: int) -> dict[str, torch.Tensor]:
        if size not in self.buffers:
            self.buffers[size] = {
                "tokens": torch.zeros(1, size, dtype=torch.long, device=self.device),
                "positions": torch.zeros(1, size, dtype=torch.long, device=self.device),
                "mask": torch.zeros(1, 1, size, self.capacity, dtype=self.dtype, device=self.device),
            }
        return self.buffers[size]

    def _fill(self, buffers, tokens, depths, ancestor_mask, prefix: int) -> None:
        """Write this step's inputs into the bucket's buffers in place (a captured graph reads them there)."""
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
        padding = torch.arange(n, size, device=self.device)
        tree[padding, padding] = 0  # itself
        tree[n:, 0] = 0  # and the root

    def _runner(self, cache, buffers) -> Callable[[], torch.Tensor]:
        def call(model) -> torch.Tensor:
            return model(input_ids=buffers["tokens"], position_ids=buffers["positions"], attention_mask=buffers["mask"],
                         cache=cache, use_cache=True).logits[0]

        if self.mode == "static":
            return lambda: call(self.model)
        if self.mode == "compile":
            return lambda: call(self.compiled)
        return self._captured(cache, buffers, call)

    def _captured(self, cache, buffers, call) -> Callable[[], torch.Tensor]:
        """A CUDA graph of the forward on the bucket's buffers; the cache's write position is restored around
        every warm-up and the capture, so only replays advance it."""
        lengths = [layer.cumulative_length for layer in cache.layers]
        start = [length.clone() for length in lengths]

        def restore() -> None:
            for length, value in zip(lengths, start, strict=True):
                length.copy_(value)

        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside the graph (allocator, kernel selection)
                call(self.model)
                restore()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = call(self.model)
        restore()

        def replay() -> torch.Tensor:
            graph.replay()
            return logits

        # the first request is served by a replay too, so every step runs the same code
        return replay
