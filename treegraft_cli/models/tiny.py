"""Tiny random-weight Llama models and a byte-level tokenizer, built in code for tests and smoke runs.

Deterministic (seeded), no files, seconds on CPU. The target and the drafter share one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of one tiny-random model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    seed: int
    logit_scale: float = 4.0  # sharpens the random LM head so greedy paths are not near-ties


TINY_SPECS = {
    "tiny-random": TinySpec(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, seed=1),
    "tiny-random-drafter": TinySpec(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, seed=2),
}


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """256 byte tokens + ChatML specials; a real tokenizer with a chat template, built offline."""
    byte_chars = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_chars))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(spec: TinySpec, vocab_size: int, eos_token_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.hidden_size * 2,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=4096,
        eos_token_id=eos_token_id,
        tie_word_embeddings=False,
    )
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(spec.seed)
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(generator_state)
    with torch.no_grad():
        model.lm_head.weight.mul_(spec.logit_scale)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, do_sample=False)
    return model.eval()
