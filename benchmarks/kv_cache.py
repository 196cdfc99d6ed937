"""Micro-benchmark: decoding steps on the KV cache of ``kv_cache.py`` against transformers' ``DynamicCache``.

A step here is what every tree method does to the target's cache: a forward of ``--rows`` tree rows after the context,
then a commit that keeps ``--kept`` of them (a gather and a crop). transformers' cache appends with ``torch.cat`` (each
forward copies every layer's rows) and crops and gathers layer by layer; ``BlockCache`` writes in place and gathers
every layer of a device at once. For each context length both caches are filled with the same prompt, then run
``--steps`` steps in turn for ``--repeats`` rounds (alternating, so a drifting machine slows both alike); the logits
of every step are compared. Reports the median ms per step of each and their ratio (above 1: the block cache is
faster), and the torch calls per commit outside the forward.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/kv_cache.py --model smollm2-135m --contexts 256 2048 8192
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

from treegraft_cli.lm import CausalLM  # noqa: E402
from treegraft_cli.models.load import load_model  # noqa: E402
from treegraft_cli.syncs import SyncAuditor  # noqa: E402


def filled(model, kind: str, prompt: torch.Tensor, chunk: int = 512) -> CausalLM:
    """A CausalLM holding ``prompt`` in a cache of ``kind`` (``block`` or ``transformers``)."""
    lm = CausalLM(model)
    if kind == "transformers":
        lm.cache = DynamicCache(config=model.config)
    for start in range(0, prompt.numel(), chunk):
        lm.forward(prompt[start : start + chunk], logits_to_keep=1)
    return lm


def step(lm: CausalLM, rows: torch.Tensor, kept: int) -> torch.Tensor:  # rows: [n] -> [n, vocab]
    """One tree step on the cache: forward ``rows`` (causal: the tree's mask costs both alike), keep every other one of
    the first ``2 · kept`` rows."""
    prefix = lm.cache_length
    logits = lm.forward(rows)
    keep = prefix + torch.arange(0, 2 * kept, 2)
    lm.commit(keep, prefix)
    return logits


def timed(lm: CausalLM, tokens: list[torch.Tensor], kept: int) -> tuple[float, list[torch.Tensor]]:
    """ms per step over ``tokens`` (one tensor of rows per step), and each step's logits."""
    outs = []
    started = time.perf_counter()
    for rows in tokens:
        outs.append(step(lm, rows, kept))
    return 1e3 * (time.perf_counter() - started) / len(tokens), outs


def commit_calls(lm: CausalLM, rows: torch.Tensor, kept: int) -> int:
    """Torch calls of one commit (outside the forward)."""
    prefix = lm.cache_length
    lm.forward(rows)
    keep = prefix + torch.arange(0, 2 * kept, 2)
    with SyncAuditor() as auditor:
        lm.commit(keep, prefix)
    return auditor.torch_calls - 1  # the keep positions' copy to the device


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--rows", type=int, default=17, help="tree rows per forward (N = 16 and the root)")
    parser.add_argument("--kept", type=int, default=4, help="rows each commit keeps")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


@torch.inference_mode()
def main() -> None:
    args = arguments()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, args.dtype, "cpu").model
    vocab = model.config.vocab_size
    print(f"{args.model} {args.dtype}, {args.threads} thread(s): a step forwards {args.rows} rows and keeps {args.kept}; "
          f"median ms per step of {args.repeats} rounds of {args.steps} steps")
    print(f"{'context':>8} {'transformers':>13} {'block':>8} {'ratio':>6} {'max |Δ logits|':>15} {'commit calls':>13}")
    for context in args.contexts:
        generator = torch.Generator().manual_seed(context)
        prompt = torch.randint(0, vocab, (context,), generator=generator)
        tokens = [torch.randint(0, vocab, (args.rows,), generator=generator) for _ in range(args.steps * args.repeats)]
        caches = {kind: filled(model, kind, prompt) for kind in ("transformers", "block")}
        times: dict[str, list[float]] = {kind: [] for kind in caches}
        logits: dict[str, list[torch.Tensor]] = {kind: [] for kind in caches}
        for r in range(args.repeats):
            for kind, lm in caches.items():
                ms, outs = timed(lm, tokens[r * args.steps : (r + 1) * args.steps], args.kept)
                times[kind].append(ms)
                logits[kind].extend(outs)
        worst = max((a - b).abs().max().item() for a, b in zip(logits["transformers"], logits["block"], strict=True))
        calls = {kind: commit_calls(lm, tokens[0], args.kept) for kind, lm in caches.items()}
        old, new = statistics.median(times["transformers"]), statistics.median(times["block"])
        print(f"{context:>8} {old:>13.2f} {new:>8.2f} {old / new:>6.2f} {worst:>15.2e} {calls['transformers']:>6} → {calls['block']:<5}")


if __name__ == "__main__":
    main()
