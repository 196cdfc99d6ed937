"""`treegraft generate`: decode one chat prompt with one method."""

from __future__ import annotations

from typing import Annotated

import typer

from ..methods import check_method
from ..models.load import parse_dtype
from ..models.packed_linear import resolve_linear
from ..pipeline import Pipeline, chat_messages
from . import console
from .options import (
    DEFAULT_PAIR,
    DEFAULTS,
    Budget,
    Compile,
    Depth,
    Device,
    Dtype,
    Kernels,
    Linear,
    MaxNewTokens,
    Method,
    MethodOptions,
    Pair,
    Seed,
    Temperature,
    Thinking,
    TopK,
    TopP,
    TreeTopK,
    decode_config,
)
from .resolve import has_drafter


def generate(
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="The user message.")],
    pair: Pair = DEFAULT_PAIR,
    method: Method = "dense",
    max_new_tokens: MaxNewTokens = DEFAULTS.max_new_tokens,
    temperature: Temperature = 0.0,
    top_k: TopK = 0,
    top_p: TopP = 1.0,
    seed: Seed = 0,
    budget: Budget = DEFAULTS.tree.budget,
    depth: Depth = DEFAULTS.tree.depth,
    tree_top_k: TreeTopK = DEFAULTS.tree.top_k,
    kernels: Kernels = "auto",
    option: MethodOptions = None,
    dtype: Dtype = "bf16",
    device: Device = "cpu",
    system: Annotated[str | None, typer.Option("--system", help="System message (none by default).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of text.")] = False,
    thinking: Thinking = None,
    compile: Compile = None,
    linear: Linear = None,
) -> None:
    """Decode one chat prompt with one method; --json prints one JSON object."""
    config = decode_config(
        method, max_new_tokens, temperature, top_k, top_p, seed, budget, depth, tree_top_k, kernels, option, compile
    )
    parse_dtype(dtype)
    linear = resolve_linear(linear or "default", dtype, device, config.compile)
    check_method(config, has_drafter(pair))  # a typo in --pair, --method or -o fails before any model loads
    with console.fetch_progress() as progress:
        pipeline = Pipeline.load(pair, dtype, device, progress, thinking, linear)
    decoder = pipeline.decoder(config)
    prompt_ids = pipeline.encode_chat(chat_messages([prompt], system=system))
    generation = decoder.generate(prompt_ids)
    text = pipeline.decode(generation.output_ids)
    if as_json:
        console.json_line(
            {
                "pair": pair,
                "method": method,
                "output_ids": generation.output_ids,
                "text": text,
                "steps": len(generation.steps),
                "new_tokens": generation.new_tokens,
                "mean_accepted_length": generation.mean_accepted_length,
                "tokens_per_s": generation.tokens_per_s,
                "wall_s": generation.wall_s,
                **generation.time_split(),
            }
        )
        return
    console.result(text)
    console.info(
        f"[dim]{generation.new_tokens} tokens in {generation.wall_s:.2f}s "
        f"({generation.tokens_per_s:.1f} tok/s), {len(generation.steps)} steps, "
        f"τ={generation.mean_accepted_length:.2f}[/]"
    )

