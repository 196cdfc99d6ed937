"""The EAGLE-3 draft head as a small nn.Module built from transformers' Llama building blocks.

transformers has no EAGLE-3 class, so this module assembles one from ``LlamaAttention``,
``LlamaMLP``, ``LlamaRMSNorm`` and ``LlamaRotaryEmbedding``. Parameter names follow the published
checkpoint layout (``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``), so a
checkpoint's state dict loads as is.

Data flow for one position t: the target's low / mid / high hidden states at t are fused by ``fc``
into one feature ``h_t`` (or, for a drafted tree node, the head's own output at the node's parent
is used); the decoder layer attends over ``concat(input_layernorm(embed(x_{t+1})), hidden_norm(h_t))``
with the residual stream carrying ``h_t``; ``lm_head(norm(out))`` gives logits over the reduced draft
vocabulary for ``x_{t+2}``, and ``out`` is the feature the node's children receive.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding

from ..kv_cache import cache_keyword


def target_hidden_size(config: LlamaConfig) -> int:
    """Hidden size of the target whose states ``fc`` fuses (the head's own size unless the config says)."""
    return getattr(config, "target_hidden_size", None) or config.hidden_size


def draft_vocab_size(config: LlamaConfig) -> int:
    return getattr(config, "draft_vocab_size", None) or config.vocab_size


class Eagle3Layer(nn.Module):
    """One decoder layer whose attention reads the token embedding and the feature side by side."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden = config.hidden_size
        self.self_attn = LlamaAttention(config, layer_idx=0)
        self.cache_keyword = cache_keyword(self.self_attn)
        # q/k/v read concat(embedding, feature): twice the hidden size
        head_dim = self.self_attn.head_dim
        bias = config.attention_bias
        self.self_attn.q_proj = nn.Linear(2 * hidden, config.num_attention_heads * head_dim, bias=bias)
        self.self_attn.k_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.self_attn.v_proj = nn.Linear(2 * hidden, config.num_key_value_heads * head_dim, bias=bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(
        self,
        embeds: torch.Tensor,  # [1, n, hidden] embeddings of the tokens x_{t+1}
        features: torch.Tensor,  # [1, n, hidden] fused target states or parent outputs h_t
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor,  # [1, 1, n, kv] additive
        cache,
    ) -> torch.Tensor:  # [1, n, hidden]
        attn_input = torch.cat([self.input_layernorm(embeds), self.hidden_norm(features)], dim=-1)
        attn_output, _ = self.self_attn(
            hidden_states=attn_input,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            **{self.cache_keyword: cache},
        )
        hidden = features + attn_output
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Head(nn.Module):
    """An EAGLE-3 head. ``embed_tokens`` is the target's input embedding unless the checkpoint has its own."""

    def __init__(self, config: LlamaConfig, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        config._attn_implementation = "sdpa"  # explicit 4-D masks; sdpa runs on every device
        self.config = config
        hidden = config.hidden_size
        self.owns_embeddings = embed_tokens is None
        self.embed_tokens = embed_tokens if embed_tokens is not None else nn.Embedding(config.vocab_size, hidden)
        self.fc = nn.Linear(3 * target_hidden_size(config), hidden, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = LlamaRMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab_size(config), bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        # target_id = draft_id + d2t[draft_id]; t2d marks the target ids the draft vocabulary covers
        self.register_buffer("d2t", torch.zeros(draft_vocab_size(config), dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def draft_to_target(self) -> torch.Tensor:  # [draft_vocab] target token id of each draft id
        return torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t

    def fuse(self, target_states: torch.Tensor) -> torch.Tensor:  # [n, 3 * target_hidden] -> [n, hidden]
        """The feature of committed positions: the target's low / mid / high states through ``fc``."""
        return self.fc(target_states.to(self.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] tokens x_{t+1}
        features: torch.Tensor,  # [n, hidden] features h_t
        position_ids: torch.Tensor,  # [n]
        attention_mask: torch.Tensor,  # [1, 1, n, kv] additive
        cache,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocabulary logits ``[n, draft_vocab]`` and output features ``[n, hidden]``."""
        embeds = self.embed_tokens(input_ids[None]).to(self.dtype)
        features = features[None].to(self.dtype)
        position_embeddings = self.rotary_emb(features, position_ids[None])
        out = self.midlayer(embeds, features, position_embeddings, attention_mask, cache)
        return self.lm_head(self.norm(out))[0], out[0]

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds: everything but an embedding borrowed from the target."""
        state = self.state_dict()
        if not self.owns_embeddings:
            state.pop("embed_tokens.weight")
        return state
