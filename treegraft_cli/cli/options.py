"""Options shared by the commands that decode, and the one place they become a DecodeConfig."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import typer

from ..config import DecodeConfig, SamplingConfig, TreeConfig, parse_options
from ..methods import method_names
from ..pipeline import DEFAULT_PAIR

Pair = Annotated[str, typer.Option("--pair", help="DRAFTER:TARGET (aliases, paths, hub ids, NAME@layers=K; drafter eagle3:PATH for an EAGLE-3 head).")]
Method = Annotated[str, typer.Option("--method", "-m", help="Decoding method: " + ", ".join(method_names())
                                     + " (`treegraft methods` shows their syntax and -o settings).")]
Dtype = Annotated[str, typer.Option("--dtype", help="bf16 | fp16 | fp32.")]
Device = Annotated[str, typer.Option("--device", help="cpu | cuda | auto (auto spreads a target over GPUs).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", "-n", help="Tokens to generate.")]
Temperature = Annotated[float, typer.Option("--temperature", "-t", help="0 is greedy.")]
TopK = Annotated[int, typer.Option("--top-k", help="Sampling top-k (0: off).")]
TopP = Annotated[float, typer.Option("--top-p", help="Sampling top-p (1.0: off).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the sampling uniforms.")]
Budget = Annotated[int, typer.Option("--budget", "-N", help="Tree budget: non-root nodes per verification.")]
Depth = Annotated[int, typer.Option("--depth", "-D", help="Tree depth (chain length for `chain`).")]
TreeTopK = Annotated[int, typer.Option("--tree-top-k", "-K", help="Frontier width / children per expanded node.")]
Kernels = Annotated[str, typer.Option("--kernels", help="auto | torch | triton verification backend.")]
Compile = Annotated[
    str | None,
    typer.Option(
        "--compile",
        help="off | static | compile | cudagraphs: the verify forward's static shapes and capture (default off).",
    ),
]
Linear = Annotated[
    str | None,
    typer.Option(
        "--linear",
        help="default | packed | auto: packed gives the linear layers oneDNN-packed weights, CPU fp32 or bf16, twice "
        "the weights' memory; it pays where torch's kernels are slow (`benchmarks/packed_linear.py`); auto: packed "
        "in fp32 on CPU and in bf16 on a CPU with bf16 instructions, default elsewhere.",
    ),
]
Thinking = Annotated[
    bool | None,
    typer.Option(
        "--thinking/--no-thinking",
        help="Chat template's enable_thinking (Qwen3 templates think by default; default: the profile's, else the template's).",
    ),
]
FirstPrompt = Annotated[
    int,
    typer.Option(
        "--first-prompt",
        help="First question taken from each benchmark file (1-based): --first-prompt 5 --num-prompts 4 is questions 5-8.",
    ),
]
MethodOptions = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        "-o",
        help="Method-specific setting KEY=VALUE (value read as YAML), repeatable: -o thresholds=[0.3,0.2,0.05]; "
        "`treegraft methods` lists each method's keys and defaults.",
    ),
]

DEFAULTS = DecodeConfig()


def decode_config(
    method: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    seed: int,
    budget: int,
    depth: int,
    tree_top_k: int,
    kernels: str,
    options: Sequence[str] | None = None,
    compile: str | None = None,
) -> DecodeConfig:
    return DecodeConfig(
        method=method,
        tree=TreeConfig(budget=budget, depth=depth, top_k=tree_top_k),
        sampling=SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p),
        max_new_tokens=max_new_tokens,
        seed=seed,
        kernels=kernels,
        compile=compile or "off",
        method_options=parse_options(options or ()),
    )


__all__ = ["DEFAULT_PAIR", "DEFAULTS", "decode_config"]
