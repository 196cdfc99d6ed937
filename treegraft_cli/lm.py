"""CausalLM: a Hugging Face causal LM with its own KV cache, driven one tree at a time.

All model code stays in transformers: tree attention goes through a 4-D additive float mask and
explicit position ids, which llama, qwen2 and gemma3 accept in transformers 5.x.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class CausalLM:
    """A model plus its KV cache. ``cache_length`` counts the rows the cache holds."""

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.forward_calls = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def cache_length(self) -> int:
        return self.cache.get_seq_length()

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # [n]
        position_ids: torch.Tensor | None = None,  # [n]; default: continue after the cache
        visible: torch.Tensor | None = None,  # [n, cache_length + n] bool; default: causal
    ) -> torch.Tensor:
        """Append ``input_ids`` to the cache and return their logits ``[n, vocab]``."""
        n = input_ids.shape[0]
        start = self.cache_length
        if position_ids is None:
            position_ids = torch.arange(start, start + n, device=self.device)
        attention_mask = None
        if visible is not None:
            attention_mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            attention_mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
            attention_mask = attention_mask[None, None]
        out = self.model(
            input_ids=input_ids[None],
            position_ids=position_ids[None],
            attention_mask=attention_mask,
            cache=self.cache,
            use_cache=True,
        )
        self.forward_calls += 1
        return out.logits[0]

    def forward_tree(
        self,
        tokens: torch.Tensor,  # [n] tree tokens, root first
        depths: torch.Tensor,  # [n]
        ancestor_mask: torch.Tensor,  # [n, n] bool
    ) -> torch.Tensor:
        """Verification forward: each node sees the whole cache plus its own ancestors."""
        prefix = self.cache_length
        n = tokens.shape[0]
        if n == 1:
            return self.forward(tokens)
        visible = torch.cat(
            [torch.ones(n, prefix, dtype=torch.bool, device=self.device), ancestor_mask], dim=1
        )
        return self.forward(tokens, prefix + depths, visible)

    @torch.no_grad()
    def commit(self, keep_positions: torch.Tensor, start: int) -> None:
        """Move the cache rows at ``keep_positions`` ([m], ascending) to ``start..start+m`` and drop all rows after.

        One gather per layer for keys and values: the accepted path becomes contiguous.
        """
        m = keep_positions.numel()
        end = start + m
        for layer in self.cache.layers:
            if not getattr(layer, "is_initialized", True) or layer.keys is None:
                continue
            if m:
                layer.keys[..., start:end, :] = layer.keys.index_select(-2, keep_positions)
                layer.values[..., start:end, :] = layer.values.index_select(-2, keep_positions)
            layer.keys = layer.keys[..., :end, :]
            layer.values = layer.values[..., :end, :]

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cache rows."""
        empty = torch.empty(0, dtype=torch.long, device=self.device)
        self.commit(empty, length)
