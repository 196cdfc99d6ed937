"""Micro-benchmark: where a method's host time goes, per treegraft function, under cProfile.

``host_overhead.py`` says how much host time a step takes; this says which code takes it. Each row is one
treegraft function's own time plus the time of the torch calls it made itself (a launch on a GPU, a small op on a
CPU), in ms per step, so a function that issues many small tensor ops ranks by what they cost it. Model forwards
(transformers' code, and torch's module machinery) are left out. The profiler slows Python, so read the rows
against each other, not as the unprofiled host time (which the header gives beside the profiled one).

    OMP_NUM_THREADS=1 python benchmarks/host_profile.py --methods graft adjacency [--device cuda --compile cudagraphs]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import cProfile  # noqa: E402
import pstats  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
from host_overhead import add_workload_arguments, per_step, prompts  # noqa: E402

from treegraft_cli.capture import MODES  # noqa: E402
from treegraft_cli.config import DecodeConfig, TreeConfig  # noqa: E402
from treegraft_cli.pipeline import Pipeline  # noqa: E402

PACKAGE = f"treegraft_cli{os.sep}"


def own_time(stats: pstats.Stats) -> dict[str, float]:
    """Seconds per treegraft function: its own time, and that of the built-in (torch) calls it made directly."""
    def name(func: tuple[str, int, str]) -> str | None:
        path, line, function = func
        return f"{path.split(PACKAGE, 1)[1]}:{line}({function})" if PACKAGE in path else None

    seconds: dict[str, float] = {}
    for func, (_, _, own, _, callers) in stats.stats.items():
        if func[0] == "~":  # a built-in: charged to the treegraft functions that called it
            charged = [(name(caller), caller_own) for caller, (_, _, caller_own, _) in callers.items()]
        else:
            charged = [(name(func), own)]
        for function, spent in charged:
            if function is not None:
                seconds[function] = seconds.get(function, 0.0) + spent
    return seconds


def profile(decoder, inputs: list[torch.Tensor], passes: int) -> tuple[dict[str, float], int, float]:
    """(seconds per function, steps, profiled host ms per step) over ``passes`` passes after two warm-up requests."""
    for prompt in inputs[:2]:
        decoder.generate(prompt)
    profiler = cProfile.Profile()
    profiler.enable()
    generations = [decoder.generate(prompt) for _ in range(passes) for prompt in inputs]
    profiler.disable()
    steps = sum(len(g.steps) for g in generations)
    return own_time(pstats.Stats(profiler)), steps, 1e3 * per_step(generations, lambda s: s.host_overhead_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--compile", default="off", choices=MODES)
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--top", type=int, default=25, help="rows per method")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pipeline = Pipeline.load(args.pair, args.dtype, args.device)
    inputs = [p.to(pipeline.device) for p in prompts(args.prompts, args.prompt_length, min(pipeline.target.model.config.vocab_size, 256))]
    base = DecodeConfig(tree=TreeConfig(budget=args.budget, depth=args.depth, top_k=args.top_k),
                        max_new_tokens=args.max_new_tokens, kernels=args.kernels, compile=args.compile)
    for method in args.methods:
        seconds, steps, host_ms = profile(pipeline.decoder(replace(base, method=method)), inputs, args.passes)
        print(f"{method}: {steps} steps, {args.device} --compile {args.compile} --kernels {args.kernels}; host ms/step "
              f"{host_ms:.3f} profiled, treegraft functions {1e3 * sum(seconds.values()) / steps:.3f}")
        for function, total in sorted(seconds.items(), key=lambda item: -item[1])[: args.top]:
            print(f"{1e3 * total / steps:9.3f}  {function}")


if __name__ == "__main__":
    main()
