"""Micro-benchmark: the verify and drafter forwards with static shapes, compiled or replayed from CUDA graphs
(``--compile``), against the dynamic path, in one process. Every mode must give ``off``'s tokens (exit 1 otherwise):
exactly in fp32; in bf16 a padded bucket runs other matrix kernels than ``off``'s exact sizes, whose rounding may
flip a near-tie, so there a first divergence must be a tie of the target's own logits (``bench.lossless``, as
``gpu_check.py`` judges the methods).

The target is a random-weight model with Qwen3-8B's layer shape (4 layers; ``--small``: a tiny one) drafting for
itself with its first layer, so trees are accepted; ``ar`` shows the one-token forward, ``chain`` the drafter's
one-row forwards, ``dense`` the tree forward and the drafter's four-row ones, ``graft`` and ``treegraft`` drafter
forwards of changing sizes (every bucket they reach is captured and must replay exactly).
The first request of each mode is a warm-up (compilation and graph capture happen there); the table times the
next ``--repeats`` requests. Two speedups: of tokens/s, and of the time per step. Where bf16 ties send a mode down
other tokens, its accepted length (τ) moves with them (on random weights, by a lot), so the step time is the one to
compare there. On CPU ``cudagraphs`` is not available and ``compile`` compiles for minutes.

    python benchmarks/compile_speedup.py [--device cuda] [--modes off static cudagraphs compile] [--small]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import NamedTuple

import torch
from gpu_check import SHAPES, SMALL, Sizes, prompts, random_model

from treegraft_cli.bench.lossless import MISMATCH, TIE_TOLERANCE, check_turn
from treegraft_cli.config import DecodeConfig
from treegraft_cli.engine import SpeculativeDecoder
from treegraft_cli.lm import CausalLM
from treegraft_cli.models.load import truncate_layers

WARM_UP_PASSES = 3


def buckets_prepared(decoder: SpeculativeDecoder) -> int:
    """Static forwards made so far (one per model and bucket: a compile or a capture each, outside ``off``)."""
    models = (decoder.target, decoder.drafter)
    return sum(len(lm.static.runners) for lm in models if lm is not None and lm.static is not None)


class Timing(NamedTuple):
    tokens_per_s: float
    tau: float  # tokens per step
    ms_per_step: float


def timed(decoder: SpeculativeDecoder, inputs: list[torch.Tensor], repeats: int) -> tuple[Timing, list[list[int]], int]:
    """(the ``repeats`` passes after the warm-up, the warm-up's outputs, the buckets first reached in the timed
    passes: each one's compile or capture is in the time).

    The warm-up repeats its pass (up to ``WARM_UP_PASSES``) while a pass reaches new buckets: a method whose choices
    follow measured times (``treegraft``'s step rule) may reach a bucket only in a later pass."""
    outputs, before = [], -1
    for _ in range(WARM_UP_PASSES):
        if buckets_prepared(decoder) == before:
            break
        before = buckets_prepared(decoder)
        outputs = [decoder.generate(p).output_ids for p in inputs]  # compile / capture
    before = buckets_prepared(decoder)
    tokens, seconds, steps = 0, 0.0, 0
    for _ in range(repeats):
        for p in inputs:
            generation = decoder.generate(p)
            tokens, seconds, steps = tokens + generation.new_tokens, seconds + generation.wall_s, steps + len(generation.steps)
    return Timing(tokens / seconds, tokens / steps, 1e3 * seconds / steps), outputs, buckets_prepared(decoder) - before


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=None, help="default: off static cudagraphs (CUDA) / off static (CPU)")
    parser.add_argument("--methods", nargs="+", default=["ar", "chain", "dense", "graft", "treegraft"])
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    modes = args.modes or (["off", "static", "cudagraphs"] if device.type == "cuda" else ["off", "static"])
    sizes = Sizes.for_run(args.small)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    target = random_model(SMALL if args.small else SHAPES["qwen3-8b"], sizes, dtype, device, seed=1)
    drafter = truncate_layers(target, 1)
    inputs = prompts(sizes, sizes.vocab)
    print(f"target {'small' if args.small else 'qwen3-8b-shaped'} x {sizes.layers} layers, {args.dtype}, {device}; "
          f"tree N={sizes.tree.budget} D={sizes.tree.depth} K={sizes.tree.top_k}, {sizes.new_tokens} new tokens")
    print(f"{'method':<9} {'mode':<11} {'tok/s':>9} {'tau':>6} {'ms/step':>8} {'speedup':>8} {'per step':>9} "
          f"{'late buckets':>13}  outputs against off")
    failed = False
    for method in args.methods:
        config = DecodeConfig(method=method, tree=sizes.tree, max_new_tokens=sizes.new_tokens)
        baseline, expected = None, None
        for mode in modes:
            decoder = SpeculativeDecoder(CausalLM(target), replace(config, compile=mode), drafter=CausalLM(drafter))
            timing, outputs, late = timed(decoder, inputs, args.repeats)
            baseline, expected = (timing, outputs) if baseline is None else (baseline, expected)
            statuses = {check_turn(target, p, want, got, TIE_TOLERANCE[args.dtype]).status
                        for p, want, got in zip(inputs, expected, outputs, strict=True)}
            failed = failed or MISMATCH in statuses
            verdict = "DIFFERENT" if MISMATCH in statuses else "+".join(sorted(statuses))
            print(f"{method:<9} {mode:<11} {timing.tokens_per_s:>9.1f} {timing.tau:>6.2f} {timing.ms_per_step:>8.2f} "
                  f"{timing.tokens_per_s / baseline.tokens_per_s:>7.2f}x {baseline.ms_per_step / timing.ms_per_step:>8.2f}x "
                  f"{late:>13}  {verdict}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
