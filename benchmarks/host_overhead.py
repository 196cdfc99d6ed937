"""Micro-benchmark: host overhead and host-device synchronisations per step, per method.

Host overhead is ``StepStats.host_overhead_s``: step time outside any model forward (tree building, masks,
acceptance, KV commit, drafter bookkeeping); "of step" is its share of the whole step (forwards included), the
figure that tells whether host work matters next to the device's forwards. Synchronisations per step are counted
twice: by the step itself (``HostReads``, what bench records) and by a ``SyncAuditor`` over a separate, untimed pass
(every synchronising torch call outside model forwards; on CUDA also the driver's count). The two agree when the hot
path reads nothing behind the counter's back.

Defaults are the tiny pair of issue 17: fp32, one thread, 4 prompts, 64 new tokens, N=16 D=4 K=4.
Timings are the median and the fastest of ``--repeats`` passes in this process, taken round the methods so that a
drifting machine slows each alike; run it at two commits on a quiet machine (``taskset -c 1`` pins it to one core)
to compare.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/host_overhead.py [--methods ar dense treegraft] [--json out.json]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from collections import Counter  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402

from treegraft_cli.capture import MODES  # noqa: E402
from treegraft_cli.config import DecodeConfig, TreeConfig, parse_options  # noqa: E402
from treegraft_cli.engine import Generation  # noqa: E402
from treegraft_cli.pipeline import Pipeline  # noqa: E402
from treegraft_cli.syncs import SyncAuditor, cuda_sync_debug  # noqa: E402

METHODS = ("ar", "chain", "dense", "ngram", "adjacency", "graft", "all-small", "all-mid", "fixed:1,3", "treegraft")


def prompts(count: int, length: int, vocab: int) -> list[torch.Tensor]:
    """Random prompts whose second half repeats part of the first, so n-gram drafters find matches."""
    out = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        head = torch.randint(0, vocab, (length // 2,), generator=generator)
        out.append(torch.cat([head, head[: length - head.numel()]]))
    return out


def per_step(generations: list[Generation], value) -> float:
    steps = [step for g in generations for step in g.steps]
    return sum(value(step) for step in steps) / len(steps) if steps else 0.0


def timed_pass(decoder, inputs: list[torch.Tensor], device: torch.device) -> tuple[float, float, int, float]:
    """One pass over the prompts: mean host ms per step, mean accepted length, steps, mean ms per whole step."""
    generations = [decoder.generate(p.to(device)) for p in inputs]
    steps = sum(len(g.steps) for g in generations)
    step_ms = 1e3 * per_step(generations, lambda s: s.draft_s + s.verify_s + s.host_s)
    return 1e3 * per_step(generations, lambda s: s.host_overhead_s), per_step(generations, lambda s: s.accepted_length), steps, step_ms


def audit(decoder, inputs: list[torch.Tensor], device: torch.device) -> dict:
    """Syncs and torch calls per step from an untimed pass under a ``SyncAuditor``."""
    auditor = SyncAuditor()
    with cuda_sync_debug(device) as driver, auditor:
        audited = [decoder.generate(p.to(device)) for p in inputs]
    audited_steps = sum(len(g.steps) for g in audited)
    return {
        "syncs_per_step": per_step(audited, lambda s: s.syncs),
        "audited_syncs_per_step": per_step(audited, lambda s: s.audited_syncs or 0),
        "driver_syncs_per_step": len(driver) / audited_steps if device.type == "cuda" and audited_steps else None,
        # where the driver's synchronisations came from, per step: the lines to look at when it counts more than the audit
        "driver_sync_sites": {site: count / audited_steps for site, count in Counter(driver).most_common(5)} if audited_steps else {},
        "torch_calls_per_step": auditor.torch_calls / audited_steps if audited_steps else 0.0,
        "audited_calls": dict(sorted(auditor.calls.items())),
    }


def measure(pipeline: Pipeline, configs: dict[str, DecodeConfig], inputs: list[torch.Tensor], repeats: int) -> dict[str, dict]:
    """Every method: host ms/step over ``repeats`` passes, then syncs per step from an audited pass.

    The passes go round the methods (method A's first, B's first, ..., A's second, ...), so a machine whose speed
    drifts over the run slows every method alike; the table gives each method's median pass and its fastest, the
    better estimate of what the code costs when the machine is noisy (noise only ever adds time)."""
    device = pipeline.device
    decoders = {name: pipeline.decoder(config) for name, config in configs.items()}
    for decoder in decoders.values():
        decoder.generate(inputs[0].to(device))  # warm-up: allocations, cost measurement, first-call paths
    passes: dict[str, list[tuple[float, float, int, float]]] = {name: [] for name in decoders}
    for _ in range(repeats):
        for name, decoder in decoders.items():
            passes[name].append(timed_pass(decoder, inputs, device))
    rows = {}
    for name, decoder in decoders.items():
        host_ms = [p[0] for p in passes[name]]
        rows[name] = {
            "steps": passes[name][-1][2],
            "tau": statistics.median(p[1] for p in passes[name]),
            "host_ms_per_step": statistics.median(host_ms),
            "host_ms_best": min(host_ms),
            "host_ms_spread": max(host_ms) - min(host_ms),
            "step_ms_per_step": statistics.median(p[3] for p in passes[name]),
            **audit(decoder, inputs, device),
        }
    return rows


def short(site: str) -> str:
    """``sync_site``'s frames with each path cut to its last two parts."""
    return " < ".join("/".join(frame.rsplit("/", 2)[-2:]) for frame in site.split(" < "))


def table(rows: dict[str, dict]) -> str:
    head = (f"{'method':<12} {'steps':>6} {'tau':>5} {'host ms/step':>13} {'best':>6} {'±':>6} {'of step':>8} {'syncs/step':>11} "
            f"{'audited':>8} {'torch calls':>12}")
    lines = [head, "-" * len(head)]
    for name, r in rows.items():
        driver = f" driver {r['driver_syncs_per_step']:.2f}" if r["driver_syncs_per_step"] is not None else ""
        lines.append(
            f"{name:<12} {r['steps']:>6} {r['tau']:>5.2f} {r['host_ms_per_step']:>13.3f} {r['host_ms_best']:>6.3f} {r['host_ms_spread']:>6.3f} "
            f"{r['host_ms_per_step'] / r['step_ms_per_step']:>8.1%} {r['syncs_per_step']:>11.2f} {r['audited_syncs_per_step']:>8.2f} {r['torch_calls_per_step']:>12.1f}{driver}"
        )
    for name, r in rows.items():  # where the driver counts clearly more than the step's own reads
        if r["driver_syncs_per_step"] is not None and r["driver_syncs_per_step"] > r["syncs_per_step"] + 0.05:
            sites = "; ".join(f"{short(site)} {per_step:.2f}" for site, per_step in r["driver_sync_sites"].items())
            lines.append(f"  {name}: the driver's synchronisations per step by line: {sites}")
    return "\n".join(lines)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The pair, methods, prompts and tree: issue 17's tiny-pair setup by default (``host_overhead_ab.py`` too)."""
    parser.add_argument("--pair", default="tiny-random@layers=2:tiny-random")
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=4)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kernels", default="auto")
    parser.add_argument("--compile", default="off", choices=MODES, help="static shapes for the forwards (capture.py)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--option", "-o", action="append", default=[], metavar="KEY=VALUE",
                        help="a method option given to every method (e.g. device_layers=false), repeatable")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--show-calls", action="store_true", help="print which calls the auditor counted")
    return parser.parse_args()


def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    pipeline = Pipeline.load(args.pair, args.dtype, args.device)
    vocab = min(pipeline.target.model.config.vocab_size, 256)
    inputs = prompts(args.prompts, args.prompt_length, vocab)
    base = DecodeConfig(
        tree=TreeConfig(budget=args.budget, depth=args.depth, top_k=args.top_k),
        max_new_tokens=args.max_new_tokens,
        kernels=args.kernels,
        compile=args.compile,
        method_options=parse_options(args.option),
    )
    rows = measure(pipeline, {method: replace(base, method=method) for method in args.methods}, inputs, args.repeats)
    print(f"{args.pair} {args.dtype} {args.device}, --compile {args.compile}, {args.threads} thread(s), {args.prompts} prompts, "
          f"{args.max_new_tokens} tokens, N={args.budget} D={args.depth} K={args.top_k}, median and best of {args.repeats} "
          "passes taken round the methods")
    print(table(rows))
    if args.show_calls:
        for name, r in rows.items():
            print(f"{name}: {r['audited_calls']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)


if __name__ == "__main__":
    main()
