"""Micro-benchmark: one model forward with torch's default linear kernels against ``--linear packed``.

Each model of the pair is loaded once; its forward of ``rows`` new tokens after a ``--context``-token prompt is timed
with the default kernels and with the packed weights in turn (the two alternate, ``--repeats`` rounds, so a drifting
machine slows both alike), and the logits of one same input are compared bit for bit. Reports the median ms per
forward of each and their ratio (default / packed: above 1, packing pays).

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/packed_linear.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --dtype bf16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

from treegraft_cli.lm import CausalLM  # noqa: E402
from treegraft_cli.models.load import load_pair  # noqa: E402
from treegraft_cli.models.packed_linear import PackedForward, check_linear, pack_linears  # noqa: E402


def packed_forwards(model: torch.nn.Module) -> dict[torch.nn.Module, PackedForward]:
    """Every linear layer's ``PackedForward`` (after ``pack_linears``), to switch it off and on again."""
    return {m: m.__dict__["forward"] for m in model.modules() if isinstance(m.__dict__.get("forward"), PackedForward)}


def use_packed(forwards: dict[torch.nn.Module, PackedForward], on: bool) -> None:
    for module, forward in forwards.items():
        if on:
            module.forward = forward
        else:
            module.__dict__.pop("forward", None)  # the class's forward: torch's default kernel


def forward_ms(model: CausalLM, context: torch.Tensor, rows: torch.Tensor) -> tuple[float, torch.Tensor]:
    """One forward of ``rows`` after ``context`` (the context's forward untimed): ms and logits ``[rows, vocab]``."""
    model.reset()
    model.forward(context)
    started = time.perf_counter()
    logits = model.forward(rows)
    return 1e3 * (time.perf_counter() - started), logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", default="qwen2.5-coder-0.5b:qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 17])
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    check_linear("packed", args.dtype, "cpu")
    drafter, target = load_pair(args.pair, args.dtype, "cpu")
    generator = torch.Generator().manual_seed(0)
    print(f"{args.pair} {args.dtype}, {args.threads} thread(s), {args.context} context tokens, median of {args.repeats}")
    print(f"{'model':<28} {'rows':>4} {'default ms':>11} {'packed ms':>10} {'ratio':>6}  logits equal")
    for loaded in (target, drafter):
        if loaded is None:
            continue
        pack_linears(loaded.model)  # a layer-truncated drafter shares the target's layers: packed once
        forwards = packed_forwards(loaded.model)
        model = CausalLM(loaded.model)
        vocab = loaded.model.config.vocab_size
        context = torch.randint(0, vocab, (args.context,), generator=generator)
        for count in args.rows:
            rows = torch.randint(0, vocab, (count,), generator=generator)
            times: dict[bool, list[float]] = {False: [], True: []}
            logits: dict[bool, torch.Tensor] = {}
            for _ in range(args.repeats):
                for packed in (False, True):
                    use_packed(forwards, packed)
                    ms, logits[packed] = forward_ms(model, context, rows)
                    times[packed].append(ms)
            default, packed = statistics.median(times[False]), statistics.median(times[True])
            print(f"{loaded.name:<28} {count:>4} {default:>11.1f} {packed:>10.1f} {default / packed:>6.2f}  "
                  f"{torch.equal(logits[False], logits[True])}", flush=True)
        use_packed(forwards, True)


if __name__ == "__main__":
    main()
