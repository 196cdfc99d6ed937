"""Compare the TreeGraft policies against plain decoding on the six benchmark files.

Loads the pair once, takes the first turn of the first P prompts of each file in ``../shared/data``
(override with ``$TREEGRAFT_DATA``), measures the cost model once (or takes ``--verify-ms/--strong-ms``)
and hands it to every TreeGraft method, warms every method up, then runs ``ar`` and each method on the
same prompts. Prints τ, tokens/s, speedup vs ``ar``, strong calls per step and greedy mismatches vs
``ar`` (in bf16 a near-tie of the target's top-2 can part outputs; fp32 must give 0).

    python benchmarks/treegraft_compare.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --dtype bf16 \\
        --prompts-per-file 2 --max-new-tokens 128
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from treegraft_cli.config import DecodeConfig, TreeConfig  # noqa: E402
from treegraft_cli.grafting.costs import measure_costs  # noqa: E402
from treegraft_cli.pipeline import Pipeline, chat_messages  # noqa: E402

FILES = ("mt_bench", "gsm8k", "humaneval", "alpaca", "cnn_dm", "qa")
DEFAULT_METHODS = ("all-small", "all-mid", "fixed:1,3", "treegraft", "ngram")
TREEGRAFT_METHODS = ("treegraft", "all-small", "all-mid", "fixed")
WARMUP_TOKENS = 8


def data_dir() -> Path:
    """``$TREEGRAFT_DATA``, else the nearest ``shared/data`` beside the repository or one of its parents."""
    override = os.environ.get("TREEGRAFT_DATA")
    if override:
        return Path(override)
    repo = Path(__file__).resolve().parents[1]
    for parent in repo.parents:
        if (parent / "shared" / "data").is_dir():
            return parent / "shared" / "data"
    raise SystemExit("benchmark data not found: set TREEGRAFT_DATA to the folder holding the six .jsonl files")


def load_prompts(per_file: int) -> list[tuple[str, str]]:
    """(file, first turn) for the first ``per_file`` questions of each benchmark file."""
    prompts = []
    for name in FILES:
        with open(data_dir() / f"{name}.jsonl") as handle:
            for line, _ in zip(handle, range(per_file), strict=False):
                prompts.append((name, json.loads(line)["turns"][0]))
    return prompts


@dataclass
class Row:
    method: str
    tokens: int = 0
    seconds: float = 0.0
    decode_seconds: float = 0.0  # wall time minus the prefill: what drafting can speed up
    steps: int = 0
    accepted: int = 0
    strong_calls: int = 0
    mismatches: int = 0
    per_prompt_tps: list[float] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def decode_config(method: str, args, costs: dict[str, float]) -> DecodeConfig:
    options = dict(costs) if method.partition(":")[0] in TREEGRAFT_METHODS else {}
    tree = TreeConfig(budget=args.budget, depth=args.depth, top_k=args.top_k)
    return DecodeConfig(method=method, tree=tree, max_new_tokens=args.max_new_tokens, method_options=options)


def run_method(pipeline: Pipeline, method: str, args, costs, prompts, reference) -> tuple[Row, list[list[int]]]:
    config = decode_config(method, args, costs)
    warm = pipeline.decoder(dataclasses.replace(config, max_new_tokens=WARMUP_TOKENS))
    warm.generate(prompts[0])
    decoder = pipeline.decoder(config)
    row, outputs = Row(method), []
    for i, prompt in enumerate(prompts):
        generation = decoder.generate(prompt)
        outputs.append(generation.output_ids)
        row.tokens += generation.new_tokens
        row.seconds += generation.wall_s
        row.decode_seconds += generation.wall_s - generation.prefill_s
        row.steps += len(generation.steps)
        row.accepted += sum(s.accepted_length for s in generation.steps)
        row.strong_calls += sum(s.drafter_calls.get("model", 0) for s in generation.steps)
        row.per_prompt_tps.append(generation.tokens_per_s)
        if reference is not None and generation.output_ids != reference[i]:
            row.mismatches += 1
    print(f"[{method}] {row.tokens} tokens in {row.seconds:.1f}s", file=sys.stderr, flush=True)
    return row, outputs


def report(rows: list[Row], costs: dict[str, float]) -> dict:
    ar = rows[0]
    print(f"costs: verify {costs['verify_ms']:.1f} ms, strong {costs['strong_ms']:.1f} ms")
    print(f"{'method':<14}{'tau':>7}{'tok/s':>9}{'speedup':>9}{'decode tok/s':>14}{'calls/step':>12}{'mismatch':>10}")
    summary = {"costs": costs, "methods": {}}
    for row in rows:
        speedup = row.tokens_per_s / ar.tokens_per_s if ar.tokens_per_s else 0.0
        calls = row.strong_calls / row.steps if row.steps else 0.0
        decode = row.tokens / row.decode_seconds if row.decode_seconds else 0.0
        print(f"{row.method:<14}{row.tau:>7.2f}{row.tokens_per_s:>9.2f}{speedup:>9.2f}{decode:>14.2f}{calls:>12.2f}{row.mismatches:>10d}")
        summary["methods"][row.method] = {
            "tau": row.tau, "tokens_per_s": row.tokens_per_s, "speedup": speedup, "strong_calls_per_step": calls,
            "decode_tokens_per_s": decode, "mismatches_vs_ar": row.mismatches, "mean_prompt_tokens_per_s": statistics.fmean(row.per_prompt_tps),
        }
    by_name = {row.method: row.tokens_per_s for row in rows}
    if {"treegraft", "all-small", "all-mid"} <= set(by_name):
        ratio = by_name["treegraft"] / max(by_name["all-small"], by_name["all-mid"])
        summary["treegraft_vs_best_fixed"] = ratio
        print(f"treegraft / max(all-small, all-mid) tokens/s: {ratio:.3f} (target >= 1.15)")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pair", default="qwen2.5-coder-0.5b:qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts-per-file", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated, fixed:1,3 allowed")
    parser.add_argument("--budget", type=int, default=63)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--verify-ms", type=float, default=0.0, help="0: measure once at warm-up")
    parser.add_argument("--strong-ms", type=float, default=0.0, help="0: measure once at warm-up")
    parser.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = parser.parse_args()
    methods = _split_methods(args.methods)

    pipeline = Pipeline.load(args.pair, args.dtype, args.device)
    prompts = [pipeline.encode_chat(chat_messages([turn])) for _, turn in load_prompts(args.prompts_per_file)]
    costs = {"verify_ms": args.verify_ms, "strong_ms": args.strong_ms}
    if not (costs["verify_ms"] and costs["strong_ms"]):
        drafter = pipeline.drafter.model if pipeline.drafter is not None else None
        measured = measure_costs(pipeline.target.model, drafter, prompts[0][-64:], args.budget, args.top_k)
        costs = {"verify_ms": costs["verify_ms"] or measured.verify_ms, "strong_ms": costs["strong_ms"] or measured.strong_ms}
    rows = []
    ar_row, reference = run_method(pipeline, "ar", args, costs, prompts, None)
    rows.append(ar_row)
    for method in methods:
        rows.append(run_method(pipeline, method, args, costs, prompts, reference)[0])
    summary = report(rows, costs)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))


def _split_methods(text: str) -> list[str]:
    """Split on commas, re-attaching ``fixed:1,3``'s layer list (digits after a comma belong to it)."""
    methods: list[str] = []
    for part in text.split(","):
        part = part.strip()
        if part.isdigit() and methods and ":" in methods[-1]:
            methods[-1] += f",{part}"
        elif part:
            methods.append(part)
    return methods


if __name__ == "__main__":
    main()
