"""GPU check: every Triton kernel against its reference at real sizes, every method exactly against ``ar``
on random-weight models with Qwen3 shapes, in bf16 and fp32. Needs no model hub: models are built from
configs. Exits 1 on any mismatch. ``benchmarks/gpu_check.sh`` runs it with the micro-benchmarks.

Shapes: the drafter has Qwen3-0.6B's layer shape (hidden 1024, 16 heads, 8 KV heads), the target
Qwen3-8B's (hidden 4096, 32 heads, 8 KV heads), both with Qwen3's 151,936-token vocabulary; each keeps
4 of its layers (28 and 36 in the real models) so both dtypes fit the time. A second pair drafts with the
target's own first layer, so acceptance (and the accepted-path commit) is exercised at these shapes too.
Random weights give near-uniform logits; the LM head is scaled so greedy choices are not near-ties.
``--small`` shrinks everything: a CPU smoke run is ``TRITON_INTERPRET=1 python benchmarks/gpu_check.py --device cpu
--small`` (the kernels run interpreted).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM
from verify_kernels import graft_inputs

from treegraft_cli.bench.lossless import TIE_TOLERANCE, check_turn
from treegraft_cli.config import DecodeConfig, TreeConfig
from treegraft_cli.drafters import adjacency
from treegraft_cli.engine import Generation, SpeculativeDecoder
from treegraft_cli.kernels import triton_status
from treegraft_cli.lm import CausalLM, gather_rows
from treegraft_cli.models.load import truncate_layers
from treegraft_cli.verify import accept, argmax_choices, sample_choices, tree_buffers

METHODS = ("chain", "dense", "ngram", "adjacency", "graft", "all-small", "all-mid", "fixed:1,3", "treegraft")
VOCAB = 151_936
SHAPES = {  # Qwen3 layer shapes
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16, num_key_value_heads=8),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_attention_heads=32, num_key_value_heads=8),
}
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Sizes:
    vocab: int
    nodes: tuple[int, ...]
    layers: int
    head_dim: int
    kv_layers: int
    kv_seq: int
    prompts: int
    prompt_length: int
    new_tokens: int
    tree: TreeConfig

    @classmethod
    def for_run(cls, small: bool) -> Sizes:
        if small:
            return cls(512, (16, 32), 2, 16, 2, 64, 1, 24, 16, TreeConfig(budget=16, depth=4, top_k=4))
        return cls(VOCAB, (16, 32, 64, 128), 4, 128, 28, 1024, 2, 64, 48, TreeConfig(budget=63, depth=5, top_k=10))


# -- kernels -----------------------------------------------------------------------------------------


def random_tree(n: int, vocab: int, choices: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, n] parents (parents first, distinct siblings) and tokens that follow ``choices`` about half the time."""
    parents = torch.cat([torch.tensor([-1]), (torch.rand(n - 1, generator=generator) * torch.arange(1, n)).long()])
    tokens = torch.randint(0, vocab, (n,), generator=generator)
    seen: dict[int, int] = {}
    for i in range(1, n):
        parent = int(parents[i])
        rank = seen.get(parent, 0)
        seen[parent] = rank + 1
        hit = bool(torch.rand(1, generator=generator) < 0.5)  # the first child matches the choice half the time
        tokens[i] = (int(choices[parent]) + 2 * rank + (0 if hit else 1)) % vocab
    return parents[None], tokens[None]


def check_kernels(device: torch.device, sizes: Sizes) -> list[str]:
    """Every kernel against its reference; returns one line per failure."""
    usable, why, fix = triton_status(device)
    if not usable:
        return [f"kernels: {why} ({fix})"]
    # imported once triton is known to run here (the modules need it)
    from treegraft_cli.kernels import graft_candidates as graft_kernel
    from treegraft_cli.kernels import greedy, kv_commit, sampling, walk
    from treegraft_cli.kernels import tree_buffers as tree_kernel
    failures = []
    generator = torch.Generator().manual_seed(0)
    for n in sizes.nodes:
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(1, n, sizes.vocab, generator=generator) * 4).to(dtype).to(device)
            choices = argmax_choices(logits)
            parents, tokens = (t.to(device) for t in random_tree(n, sizes.vocab, choices[0].cpu(), generator))
            cases: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
                ("tree_buffers", lambda p=parents: tree_kernel.tree_buffers(p), lambda p=parents: tree_buffers(p)),
                ("argmax", lambda x=logits: greedy.argmax_choices(x), lambda x=logits: argmax_choices(x)),
                ("walk", lambda t=tokens, p=parents, c=choices: walk.accept(t, p, c), lambda t=tokens, p=parents, c=choices: accept(t, p, c)),
                ("verify_greedy", lambda x=logits, t=tokens, p=parents: greedy.verify_greedy(x, t, p),
                 lambda x=logits, t=tokens, p=parents: accept(t, p, argmax_choices(x))),
            ]
            # sampling: uniforms at the middle of the chosen token's CDF step, so no float lands on a boundary
            probs = torch.softmax(logits.float() / 0.8, dim=-1)
            cdf = probs.cumsum(-1)
            token = probs.argmax(-1, keepdim=True)
            upper = torch.gather(cdf, -1, token)
            uniforms = ((upper - torch.gather(probs, -1, token) / 2) / cdf[..., -1:]).squeeze(-1)
            cases.append(("sample_choices", lambda x=logits, u=uniforms: sampling.sample_choices(x, u, 0.8, 0, 1.0),
                          lambda x=logits, u=uniforms: sample_choices(x, u, 0.8, 0, 1.0)))
            if dtype == torch.float32:  # grafting reads no logits: once per tree size
                graft = graft_inputs(n, sizes.vocab, device, generator)
                cases.append(("graft_candidates", lambda g=graft: graft_kernel.graft_candidates(*g),
                              lambda g=graft: adjacency.graft_candidates(*g)))
                *candidates, count = adjacency.graft_candidates(*graft)  # tokens, node, scores, kept
                appended = (*candidates, graft[4], int(count))
                cases.append(("appended_nodes", lambda a=appended: graft_kernel.appended_nodes(*a),
                              lambda a=appended: adjacency.appended_nodes(*a)))
            for name, kernel, reference in cases:
                if not _same(kernel(), reference()):
                    failures.append(f"kernel {name}: nodes {n}, vocab {sizes.vocab}, {dtype}: differs from the reference")
        cache = [torch.randn(1, 8, sizes.kv_seq, sizes.head_dim, generator=generator).to(torch.bfloat16).to(device)
                 for _ in range(2 * sizes.kv_layers)]
        keep = (sizes.kv_seq - n + torch.nonzero(torch.rand(n, generator=generator) < 0.5).flatten()).to(device)
        want = [c.clone() for c in cache]
        gather_rows(want, keep, sizes.kv_seq - n)
        kv_commit.gather_rows(cache, keep, sizes.kv_seq - n)
        if not all(torch.equal(a, b) for a, b in zip(cache, want, strict=True)):
            failures.append(f"kernel kv_commit: {sizes.kv_layers} layers, {n} tree rows: differs from the reference")
    return failures


def _same(got, want) -> bool:
    if isinstance(got, torch.Tensor):
        return torch.equal(got, want)
    if isinstance(got, tuple):
        return all(_same(a, b) for a, b in zip(got, want, strict=True))
    return all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("path", "num_accepted", "bonus"))


# -- methods against ar ------------------------------------------------------------------------------


def random_model(shape: dict, sizes: Sizes, dtype: torch.dtype, device: torch.device, seed: int) -> PreTrainedModel:
    config = Qwen3Config(**shape, num_hidden_layers=sizes.layers, head_dim=sizes.head_dim, vocab_size=sizes.vocab,
                         max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1e6)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():  # sharpen the random head: greedy choices with clear margins, like a trained model's
        model.lm_head.weight.mul_(3.0)
    return model


def prompts(sizes: Sizes, vocab: int) -> list[torch.Tensor]:
    """Random prompts that repeat their first half, so the n-gram and retrieval drafters find matches."""
    out = []
    for seed in range(sizes.prompts):
        head = torch.randint(0, vocab, (sizes.prompt_length // 2,), generator=torch.Generator().manual_seed(seed))
        out.append(torch.cat([head, head]))
    return out


@dataclass
class MethodRow:
    pair: str
    dtype: str
    method: str
    tau: float
    tokens_per_s: float
    syncs_per_step: float
    verdict: str


def check_methods(device: torch.device, sizes: Sizes, dtypes: Sequence[str], methods: Sequence[str]) -> list[MethodRow]:
    rows = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        drafter_shape, target_shape = (SMALL, SMALL) if sizes.vocab < VOCAB else (SHAPES["qwen3-0.6b"], SHAPES["qwen3-8b"])
        target = random_model(target_shape, sizes, dtype, device, seed=1)
        names = ("small", "small") if sizes.vocab < VOCAB else ("qwen3-0.6b", "qwen3-8b")
        pairs = {
            f"{names[0]}:{names[1]} (shapes)": random_model(drafter_shape, sizes, dtype, device, seed=2),
            f"{names[1]}@layers=1:{names[1]} (shapes)": truncate_layers(target, 1),
        }
        for pair, drafter in pairs.items():
            rows.extend(_check_pair(pair, dtype_name, target, drafter, sizes, methods))
            del drafter
        del target, pairs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _check_pair(pair: str, dtype: str, target, drafter, sizes: Sizes, methods: Sequence[str]) -> list[MethodRow]:
    base = DecodeConfig(method="ar", tree=sizes.tree, max_new_tokens=sizes.new_tokens)
    inputs = prompts(sizes, sizes.vocab)
    reference = [_decode(target, drafter, base, p) for p in inputs]
    rows = []
    for method in methods:
        generations = [_decode(target, drafter, replace(base, method=method), p) for p in inputs]
        checks = [check_turn(target, p, r.output_ids, g.output_ids, TIE_TOLERANCE[dtype])
                  for p, r, g in zip(inputs, reference, generations, strict=True)]
        statuses = sorted({c.status for c in checks})
        steps = [s for g in generations for s in g.steps]
        wall = sum(g.wall_s for g in generations)
        rows.append(MethodRow(
            pair, dtype, method,
            tau=sum(s.accepted_length for s in steps) / len(steps),
            tokens_per_s=sum(g.new_tokens for g in generations) / wall,
            syncs_per_step=sum(s.syncs for s in steps) / len(steps),
            verdict="mismatch" if "mismatch" in statuses else "+".join(statuses),
        ))
    return rows


def _decode(target, drafter, config: DecodeConfig, prompt: torch.Tensor) -> Generation:
    decoder = SpeculativeDecoder(CausalLM(target), config, drafter=CausalLM(drafter) if drafter is not None else None)
    return decoder.generate(prompt)


def method_table(rows: Sequence[MethodRow]) -> str:
    head = f"{'pair':<34} {'dtype':<5} {'method':<10} {'tau':>5} {'tok/s':>8} {'syncs/step':>10}  verdict"
    lines = [head, "-" * len(head)]
    lines += [f"{r.pair:<34} {r.dtype:<5} {r.method:<10} {r.tau:>5.2f} {r.tokens_per_s:>8.1f} {r.syncs_per_step:>10.2f}  "
              f"{r.verdict}" for r in rows]
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny sizes (a CPU smoke run)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    parser.add_argument("--methods", nargs="+", default=list(METHODS))
    parser.add_argument("--skip-kernels", action="store_true")
    return parser.parse_args()


def main() -> int:
    args = arguments()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (use --device cpu --small for a smoke run)", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 must be fp32 for the exactness check
        torch.backends.cudnn.allow_tf32 = False
    sizes = Sizes.for_run(args.small)
    failures: list[str] = []
    started = time.perf_counter()
    if not args.skip_kernels:
        kernel_failures = check_kernels(device, sizes)
        print(f"kernels: {len(sizes.nodes)} tree sizes x 2 dtypes, vocab {sizes.vocab}: "
              f"{'ok' if not kernel_failures else f'{len(kernel_failures)} failed'} ({time.perf_counter() - started:.0f}s)")
        failures += kernel_failures
    rows = check_methods(device, sizes, args.dtypes, args.methods)
    print(method_table(rows))
    failures += [f"{r.method} on {r.pair} ({r.dtype}): not lossless against ar" for r in rows if r.verdict == "mismatch"]
    for failure in failures:
        print(f"FAIL {failure}", file=sys.stderr)
    print(f"gpu_check: {'FAILED' if failures else 'passed'} in {time.perf_counter() - started:.0f}s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
