"""Compare ``ar``, ``dense``, ``adjacency`` and ``graft`` on the shared prompt files (issue #4).

Loads the pair once, builds prompts from the first turn of the first ``--prompts-per-file`` questions
of every ``*.jsonl`` in the data directory (``../shared/data`` next to the repository, or
``$TREEGRAFT_DATA``), warms every method up on a throwaway prompt with throwaway decoders (so the
measured adjacency tables start from the measured prompts only), then decodes every prompt with ``ar``
and each method, prompt by prompt so a change in machine load hits every method alike. One decoder per
method serves all prompts, so the adjacency table is kept across requests as in a real run.

Prints per method: τ (tokens committed per step), tokens/s, speedup over ``ar``, drafter calls per
step, how often each graft stage fired, and how many outputs differ from ``ar``'s (in bf16 a tree
forward rounds differently from a one-token forward, so near-ties can legitimately part).

    python benchmarks/graft_compare.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b --dtype bf16 \\
        --prompts-per-file 2 --max-new-tokens 128 --budget 60
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from treegraft_cli.config import DecodeConfig, TreeConfig, parse_options  # noqa: E402
from treegraft_cli.engine import Generation  # noqa: E402
from treegraft_cli.pipeline import Pipeline, chat_messages  # noqa: E402


def data_dir() -> Path:
    """``$TREEGRAFT_DATA``, else ``../shared/data`` beside the repository (or beside its worktree folder)."""
    if "TREEGRAFT_DATA" in os.environ:
        return Path(os.environ["TREEGRAFT_DATA"])
    candidates = [REPO.parent / "shared" / "data", REPO.parent.parent / "shared" / "data"]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def load_prompts(directory: Path, per_file: int) -> list[tuple[str, str]]:
    """(file stem, first turn) for the first ``per_file`` questions of every file, files sorted."""
    prompts = []
    for path in sorted(directory.glob("*.jsonl")):
        with path.open() as lines:
            for line, _ in zip(lines, range(per_file), strict=False):
                prompts.append((path.stem, json.loads(line)["turns"][0]))
    if not prompts:
        raise SystemExit(f"no *.jsonl prompts in {directory} (set TREEGRAFT_DATA)")
    return prompts


def method_options(pairs: list[str], method: str) -> dict:
    """``--option graft.thresholds=[...]`` → the options of ``graft``."""
    prefix = f"{method}."
    return parse_options([p[len(prefix):] for p in pairs if p.startswith(prefix)])


@dataclass
class Totals:
    tokens: int = 0
    steps: int = 0
    accepted: int = 0
    wall_s: float = 0.0
    mismatches: int = 0
    calls: Counter = field(default_factory=Counter)
    by_file: Counter = field(default_factory=Counter)  # file → seconds

    def add(self, generation: Generation, file: str, reference: list[int] | None) -> None:
        self.tokens += generation.new_tokens
        self.steps += len(generation.steps)
        self.accepted += sum(s.accepted_length for s in generation.steps)
        self.wall_s += generation.wall_s
        self.by_file[file] += generation.wall_s
        for step in generation.steps:
            self.calls.update(step.drafter_calls)
        if reference is not None and generation.output_ids != reference:
            self.mismatches += 1

    @property
    def tau(self) -> float:
        return self.accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0


def config_for(args, method: str, max_new_tokens: int) -> DecodeConfig:
    return DecodeConfig(
        method=method,
        tree=TreeConfig(budget=args.budget, depth=args.depth, top_k=args.top_k),
        max_new_tokens=max_new_tokens,
        method_options=method_options(args.option, method),
    )


def run(args) -> dict:
    prompts = load_prompts(data_dir(), args.prompts_per_file)
    methods = ["ar"] + [m for m in args.methods.split(",") if m != "ar"]
    pipeline = Pipeline.load(args.pair, args.dtype, args.device)
    warm_prompt = pipeline.encode_chat(chat_messages(["Say hello."]))
    for method in methods:  # throwaway decoders: no table state leaks into the measurement
        pipeline.decoder(config_for(args, method, 8)).generate(warm_prompt)
    decoders = {m: pipeline.decoder(config_for(args, m, args.max_new_tokens)) for m in methods}
    totals = {m: Totals() for m in methods}
    for i, (file, text) in enumerate(prompts):
        ids = pipeline.encode_chat(chat_messages([text]))
        reference = None
        for method in methods:
            generation = decoders[method].generate(ids)
            totals[method].add(generation, file, reference)
            if method == "ar":
                reference = generation.output_ids
        line = "  ".join(f"{m} {totals[m].tokens_per_s:.2f}" for m in methods)
        print(f"[{i + 1}/{len(prompts)}] {file}: tok/s so far  {line}", file=sys.stderr, flush=True)
    return {"args": vars(args), "prompts": len(prompts), "totals": totals}


def report(result: dict) -> None:
    totals: dict[str, Totals] = result["totals"]
    ar = totals["ar"].tokens_per_s
    print(f"\n{result['prompts']} prompts, pair {result['args']['pair']}, {result['args']['dtype']}, "
          f"N={result['args']['budget']} D={result['args']['depth']} K={result['args']['top_k']}")
    print(f"{'method':<10} {'tau':>6} {'tok/s':>7} {'speedup':>8} {'steps':>6} {'model/step':>10} "
          f"{'differs':>8}  stages fired")
    for method, t in totals.items():
        stages = {k: v for k, v in sorted(t.calls.items()) if k.startswith("graft_stage_")}
        fired = sum(stages.values())
        stage_text = " ".join(f"{k.removeprefix('graft_')}={v} ({v / t.steps:.0%})" for k, v in stages.items())
        if stages or method == "graft":
            stage_text += f" none={t.steps - fired} ({(t.steps - fired) / max(t.steps, 1):.0%})"
        forwards = sum(v for k, v in t.calls.items() if k != "adjacency" and not k.startswith("graft_"))
        print(f"{method:<10} {t.tau:>6.2f} {t.tokens_per_s:>7.2f} {t.tokens_per_s / ar:>7.2f}x {t.steps:>6} "
              f"{forwards / max(t.steps, 1):>10.2f} {t.mismatches:>8}  {stage_text}")


def to_json(result: dict) -> dict:
    out = {"args": result["args"], "prompts": result["prompts"], "methods": {}}
    for method, t in result["totals"].items():
        out["methods"][method] = {
            "tau": t.tau, "tokens_per_s": t.tokens_per_s, "tokens": t.tokens, "steps": t.steps,
            "wall_s": t.wall_s, "differs_from_ar": t.mismatches, "calls": dict(t.calls),
            "wall_s_by_file": dict(t.by_file),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen2.5-coder-0.5b:qwen2.5-coder-1.5b")
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts-per-file", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--budget", type=int, default=60, help="N, the same for every method")
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--methods", default="dense,adjacency,graft", help="comma-separated; ar always runs")
    parser.add_argument("--option", action="append", default=[],
                        help="METHOD.KEY=VALUE (YAML value), e.g. graft.thresholds=[0.3,0.2,0.05]; repeatable")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    started = time.perf_counter()
    result = run(args)
    report(result)
    print(f"total {time.perf_counter() - started:.0f}s")
    if args.json:
        args.json.write_text(json.dumps(to_json(result), indent=2, default=str))


if __name__ == "__main__":
    main()
