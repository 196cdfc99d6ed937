"""Micro-benchmark: host overhead per step of this checkout against another commit's, in one process.

Host ms per step (``StepStats.host_overhead_s``, as ``host_overhead.py`` measures it) moves 10–30 % between two
processes on a small VM, more than most changes to the hot path. Here both versions decode in the same process:
the baseline is another checkout's ``treegraft_cli`` loaded under another name (the package imports itself
relatively), each method's passes alternate between the two (the order reversed every round), and the table gives
both medians, their ratio and the median of the per-round ratios. The outputs are compared token for token.

    git worktree add /tmp/base HEAD~3
    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/host_overhead_ab.py /tmp/base [--methods dense all-mid] [--rounds 7]

Tensor calls and synchronisations per step: ``host_overhead.py`` in each checkout (the counters are per package).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import torch  # noqa: E402
from host_overhead import add_workload_arguments, prompts  # noqa: E402

import treegraft_cli  # noqa: E402

BASELINE = "treegraft_baseline"


def load_baseline(checkout: Path) -> ModuleType:
    """``checkout``'s ``treegraft_cli`` package, imported as ``treegraft_baseline``."""
    package = checkout / "treegraft_cli"
    if not (package / "__init__.py").is_file():
        raise SystemExit(f"{checkout} holds no treegraft_cli package: give a checkout of the baseline commit "
                         "(git worktree add /tmp/base <commit>)")
    if package.resolve() == Path(treegraft_cli.__file__).parent.resolve():
        raise SystemExit(f"{checkout} is this checkout: give another commit's")
    spec = importlib.util.spec_from_file_location(BASELINE, package / "__init__.py", submodule_search_locations=[str(package)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[BASELINE] = module
    spec.loader.exec_module(module)
    return module


def decoders(package: str, args: argparse.Namespace, warm_up: torch.Tensor) -> dict:
    """One decoder per method from ``package`` (``treegraft_cli`` or the baseline), warmed up."""
    config = importlib.import_module(f"{package}.config")
    pipeline = importlib.import_module(f"{package}.pipeline").Pipeline.load(args.pair, args.dtype, "cpu")
    tree = config.TreeConfig(budget=args.budget, depth=args.depth, top_k=args.top_k)
    out = {}
    for method in args.methods:
        decoder = pipeline.decoder(config.DecodeConfig(tree=tree, max_new_tokens=args.max_new_tokens, method=method))
        decoder.generate(warm_up)
        out[method] = decoder
    return out


def timed_pass(decoder, inputs: list[torch.Tensor]) -> tuple[float, list[list[int]]]:
    """Mean host ms per step over the prompts, and the outputs."""
    generations = [decoder.generate(p) for p in inputs]
    steps = [step for g in generations for step in g.steps]
    return 1e3 * sum(step.host_overhead_s for step in steps) / len(steps), [g.output_ids for g in generations]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("baseline", type=Path, help="a checkout of the commit to compare against")
    add_workload_arguments(parser)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    load_baseline(args.baseline)
    inputs = prompts(args.prompts, args.prompt_length, 256)  # the tiny pair's vocabulary, as host_overhead.py caps it
    versions = {"baseline": decoders(BASELINE, args, inputs[0]), "this": decoders("treegraft_cli", args, inputs[0])}
    host_ms = {(version, m): [] for version in versions for m in args.methods}
    outputs = {}
    for round_ in range(args.rounds):
        order = list(versions) if round_ % 2 == 0 else list(reversed(versions))
        for method in args.methods:
            for version in order:
                ms, outputs[version, method] = timed_pass(versions[version][method], inputs)
                host_ms[version, method].append(ms)
    print(f"{args.pair} {args.dtype} cpu, 1 thread, {args.prompts} prompts, {args.max_new_tokens} tokens, "
          f"N={args.budget} D={args.depth} K={args.top_k}: host ms per step, medians of {args.rounds} rounds; "
          f"baseline {args.baseline}")
    print(f"{'method':<12} {'baseline':>9} {'this':>7} {'ratio':>6} {'per round':>10} {'range':>11}  outputs")
    for method in args.methods:
        before, after = host_ms["baseline", method], host_ms["this", method]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        same = "same" if outputs["baseline", method] == outputs["this", method] else "DIFFER"
        print(f"{method:<12} {statistics.median(before):>9.3f} {statistics.median(after):>7.3f} "
              f"{statistics.median(after) / statistics.median(before):>6.3f} {statistics.median(ratios):>10.3f} "
              f"{min(ratios):>5.2f}-{max(ratios):<5.2f}  {same}")


if __name__ == "__main__":
    main()
