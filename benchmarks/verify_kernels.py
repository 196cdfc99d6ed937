"""Micro-benchmark: torch reference vs Triton kernel for tree verification and grafting.

Trees of 8–128 nodes, vocabularies of 32k–152k. ``graft`` works out a graft's candidates onto a tree of half the
nodes, the other half's slots retrieved from a table of every token's 8 successors (``drafters/adjacency.py``);
``graft append`` lays the kept ones out as the nodes the graft appends. On CPU only the references run (the Triton kernels need
CUDA; the interpreter is a correctness tool, not a speed one); on CUDA both run, with the speedup.

    python benchmarks/verify_kernels.py [--nodes 8 32 128] [--vocab 32000 152064] [--reps 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from treegraft_cli import lm, verify
from treegraft_cli.drafters import adjacency
from treegraft_cli.drafters.rank_template import BASE_TEMPLATE, RankTemplate, build_template, scale_counts
from treegraft_cli.kernels import triton_status

SAMPLING = {  # (temperature, top-k, top-p): each filter on its own and both (the costliest path)
    "sample": (0.7, 0, 1.0),
    "sample k": (0.7, 50, 1.0),
    "sample p": (0.7, 0, 0.9),
    "sample k+p": (0.7, 50, 0.9),
}
KV = dict(layers=28, heads=8, seq=1024, head_dim=128)  # a 7-8B-class cache, bf16


def timer(device: torch.device, reps: int) -> Callable[[Callable[[], object]], float]:
    """Median milliseconds of ``fn``; CUDA uses triton's do_bench (events, cache flush)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=5, rep=max(20, reps * 5), return_mode="median")

    def measure(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[len(times) // 2]

    return measure


def random_tree(n: int, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, n] parents (parents first, about 4 children each) and tokens."""
    parents = torch.cat([torch.tensor([-1]), torch.arange(1, n) // 4]).to(device)[None]
    tokens = torch.randint(0, vocab, (1, n), device=device)
    return parents, tokens


def graft_inputs(n: int, vocab: int, device: torch.device, generator: torch.Generator | None = None,
                 table_k: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, RankTemplate, int, int]:
    """A graft's inputs (``adjacency.graft_candidates``): a table with every row written, a drafted tree of ``n // 2``
    nodes (at least the root) whose tokens follow the table (so candidates merge into it), and a template of ``n``
    candidates for the other ``n - n // 2`` slots."""
    successors = torch.randint(0, vocab, (vocab + 2, table_k), generator=generator)
    successors[vocab:] = vocab + 1  # the scratch and sentinel rows
    drafted = max(1, n // 2)
    parents = torch.cat([torch.tensor([-1]), torch.arange(1, drafted) // 3])  # about 3 children each
    tokens = torch.zeros(drafted, dtype=torch.long)
    tokens[0] = int(torch.randint(0, vocab, (1,), generator=generator))
    for node in range(1, drafted):
        tokens[node] = successors[tokens[parents[node]], (node - 1) % 3]
    scores = torch.cat([torch.zeros(1), -torch.rand(drafted - 1, generator=generator).cumsum(0)])
    slots = n - n // 2
    template = build_template(scale_counts(BASE_TEMPLATE, max(slots, 1), table_k), n, table_k, device)
    depth = int(verify.tree_buffers(parents[None])[1].max())
    return successors.to(device), tokens.to(device), parents.to(device), scores.to(device), template, slots, depth


def cases(n: int, vocab: int, device: torch.device, dtype: torch.dtype):
    """(name, reference call, kernel call or None) for one tree size and vocabulary."""
    parents, tokens = random_tree(n, vocab, device)
    logits = torch.randn(1, n, vocab, device=device, dtype=dtype)
    uniforms = torch.rand(1, n, device=device)
    kv = [torch.randn(1, KV["heads"], KV["seq"], KV["head_dim"], device=device, dtype=torch.bfloat16) for _ in range(2 * KV["layers"])]
    keep = torch.arange(KV["seq"] - n, KV["seq"], 4, device=device)
    start = KV["seq"] - n
    graft = graft_inputs(n, vocab, device)
    *candidates, count = adjacency.graft_candidates(*graft)  # tokens, node, scores, kept
    appended = (*candidates, graft[4], int(count))
    kernels = None
    if triton_status(device)[0] and device.type == "cuda":
        from treegraft_cli.kernels import graft_candidates, greedy, kv_commit, sampling, tree_buffers

        kernels = {
            "tree_buffers": lambda: tree_buffers.tree_buffers(parents),
            "greedy": lambda: greedy.verify_greedy(logits, tokens, parents),
            **{name: lambda f=filters: sampling.verify_sampling(logits, tokens, parents, uniforms, *f)
               for name, filters in SAMPLING.items()},
            "kv_commit": lambda: kv_commit.gather_rows(kv, keep, start),
            "graft": lambda: graft_candidates.graft_candidates(*graft),
            "graft append": lambda: graft_candidates.appended_nodes(*appended),
        }
    references = {
        "tree_buffers": lambda: verify.tree_buffers(parents),
        "greedy": lambda: verify.verify_greedy(logits, tokens, parents),
        **{name: lambda f=filters: verify.verify_sampling(logits, tokens, parents, uniforms, *f)
           for name, filters in SAMPLING.items()},
        "kv_commit": lambda: lm.gather_rows(kv, keep, start),
        "graft": lambda: adjacency.graft_candidates(*graft),
        "graft append": lambda: adjacency.appended_nodes(*appended),
    }
    for name, reference in references.items():
        yield name, reference, (kernels or {}).get(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--vocab", type=int, nargs="+", default=[32000, 152064])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    measure = timer(device, args.reps)
    print(f"device {device}, logits {dtype}, KV commit over {KV['layers']} layers x {KV['heads']} heads, bf16")
    print(f"{'op':<13}{'nodes':>6}{'vocab':>8}{'torch ms':>11}{'triton ms':>11}{'speedup':>9}")
    for vocab in args.vocab:
        for n in args.nodes:
            for name, reference, kernel in cases(n, vocab, device, dtype):
                if name in ("tree_buffers", "kv_commit", "graft", "graft append") and vocab != args.vocab[0]:
                    continue  # independent of the vocabulary: one row per tree size
                ref_ms = measure(reference)
                row = f"{name:<13}{n:>6}{vocab:>8}{ref_ms:>11.3f}"
                if kernel is not None:
                    kernel_ms = measure(kernel)
                    row += f"{kernel_ms:>11.3f}{ref_ms / kernel_ms:>8.1f}x"
                else:
                    row += f"{'-':>11}{'-':>9}"
                print(row, flush=True)


if __name__ == "__main__":
    main()
