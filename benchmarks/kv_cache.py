"""Micro-benchmark: decoding steps on the KV cache of ``kv_cache.py`` against transformers' ``DynamicCache``.

A step here is what every tree method does to the target's cache: a forward of ``--rows`` tree rows after the context,
then a commit that keeps ``--kept`` of them (a gather and a crop). transformers' cache appends with ``torch.cat`` (each
forward copies every layer's rows) and crops and gathers layer by layer; ``BlockCache`` writes in place and gathers
every layer of a device at once. For each context length both caches are filled with the same prompt, then run
``--steps`` steps in turn for ``--repeats`` rounds (alternating, so a drifting machine slows both alike); the logits
of every step are compared. Reports the median ms per step of each and their ratio (above 1: the block cache is
faster), the largest logit difference, and the torch calls per commit outside the forward; exits non-zero when a
row's greedy choice differs between the two caches.

``--shape qwen3-8b`` (or ``qwen3-0.6b``, ``small``) times a random-weight model of that shape instead of a named one,
with ``--layers`` layers: what ``benchmarks/gpu_check.sh`` runs on a GPU, where no model hub is needed.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/kv_cache.py --model smollm2-135m --contexts 256 2048 8192
    python benchmarks/kv_cache.py --shape qwen3-8b --layers 36 --device cuda --dtype bf16 --contexts 2048 8192 32768
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402

import torch  # noqa: E402
from gpu_check import DTYPES, SHAPES, SMALL, Sizes, random_model  # noqa: E402
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
    keep = prefix + torch.arange(0, 2 * kept, 2, device=rows.device)
    lm.commit(keep, prefix)
    return logits


def timed(lm: CausalLM, tokens: list[torch.Tensor], kept: int) -> tuple[float, list[torch.Tensor]]:
    """ms per step over ``tokens`` (one tensor of rows per step), and each step's logits."""
    outs = []
    synchronize(lm.device)
    started = time.perf_counter()
    for rows in tokens:
        outs.append(step(lm, rows, kept))
    synchronize(lm.device)
    return 1e3 * (time.perf_counter() - started) / len(tokens), outs


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def commit_calls(lm: CausalLM, rows: torch.Tensor, kept: int) -> int:
    """Torch calls of one commit (outside the forward)."""
    prefix = lm.cache_length
    lm.forward(rows)
    keep = prefix + torch.arange(0, 2 * kept, 2, device=rows.device)
    with SyncAuditor() as auditor:
        lm.commit(keep, prefix)
    return auditor.torch_calls - 1  # the keep positions' copy to the device


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--shape", choices=[*SHAPES, "small"], help="a random-weight model of this shape instead")
    parser.add_argument("--layers", type=int, default=36, help="with --shape: its layer count")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES))
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 2048, 8192])
    parser.add_argument("--rows", type=int, default=17, help="tree rows per forward (N = 16 and the root)")
    parser.add_argument("--kept", type=int, default=4, help="rows each commit keeps")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def chosen_model(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """The model to time and its name: a registry model, or a random-weight one of ``--shape``."""
    if args.shape is None:
        return load_model(args.model, args.dtype, args.device).model, args.model
    small = args.shape == "small"
    sizes = replace(Sizes.for_run(small), layers=args.layers)  # the vocabulary and head size of gpu_check's models
    model = random_model(SMALL if small else SHAPES[args.shape], sizes, DTYPES[args.dtype], torch.device(args.device),
                         seed=1)
    return model, f"random {args.shape}-shaped model ({args.layers} layers)"


@torch.inference_mode()
def main() -> int:
    args = arguments()
    torch.set_num_threads(args.threads)
    model, name = chosen_model(args)
    vocab, device = model.config.vocab_size, model.device
    print(f"{name} {args.dtype} on {device}, {args.threads} thread(s): a step forwards {args.rows} rows and keeps "
          f"{args.kept}; median ms per step of {args.repeats} rounds of {args.steps} steps")
    print(f"{'context':>8} {'transformers':>13} {'block':>8} {'ratio':>6} {'max |Δ logits|':>15} {'choices differ':>15} "
          f"{'commit calls':>13}")
    differing = 0
    for context in args.contexts:
        generator = torch.Generator().manual_seed(context)
        prompt = torch.randint(0, vocab, (context,), generator=generator).to(device)
        tokens = [torch.randint(0, vocab, (args.rows,), generator=generator).to(device)
                  for _ in range(args.steps * args.repeats)]
        caches = {kind: filled(model, kind, prompt) for kind in ("transformers", "block")}
        times: dict[str, list[float]] = {kind: [] for kind in caches}
        logits: dict[str, list[torch.Tensor]] = {kind: [] for kind in caches}
        for r in range(args.repeats):
            for kind, lm in caches.items():
                ms, outs = timed(lm, tokens[r * args.steps : (r + 1) * args.steps], args.kept)
                times[kind].append(ms)
                logits[kind].extend(outs)
        pairs = list(zip(logits["transformers"], logits["block"], strict=True))
        worst = max((a.float() - b.float()).abs().max().item() for a, b in pairs)
        differ = sum(int((a.argmax(-1) != b.argmax(-1)).sum()) for a, b in pairs)
        differing += differ
        calls = {kind: commit_calls(lm, tokens[0], args.kept) for kind, lm in caches.items()}
        old, new = statistics.median(times["transformers"]), statistics.median(times["block"])
        print(f"{context:>8} {old:>13.2f} {new:>8.2f} {old / new:>6.2f} {worst:>15.2e} {differ:>15} "
              f"{calls['transformers']:>6} → {calls['block']:<5}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
