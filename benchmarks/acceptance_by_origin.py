"""Report: how often each drafter's nodes are accepted, by tree depth, from a bench ``results.json``.

For every method (and, with ``--per-benchmark``, every benchmark) and every origin of verified nodes
(``model``, ``ngram``, ``adjacency``): the nodes verified per step at each depth, the accepted share
``accepted / verified``, and the accepted tokens per step the origin supplied. It answers whether the
slots a method gives one drafter pay: Graft's grafted ``adjacency`` nodes, for instance, against the
``model`` nodes they replaced.

    python benchmarks/acceptance_by_origin.py RESULTS.json [--methods graft dense] [--per-benchmark]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def rows(name: str, entry: Mapping[str, Any]) -> list[str]:
    """One line per origin: verified per step and acceptance rate at each depth, accepted tokens per step."""
    steps = entry.get("steps") or 0
    lines = []
    for origin, counts in entry.get("acceptance_by_origin", {}).items():
        cells = []
        for verified, rate in zip(counts["verified"], counts["rate"], strict=True):
            share = "   -" if rate is None else f"{rate:4.2f}"
            cells.append(f"{verified / steps:4.1f} {share}" if steps else "-")
        accepted = sum(counts["accepted"]) / steps if steps else 0.0
        lines.append(f"{name:<24} {origin:<10} {accepted:6.2f}  " + "  ".join(cells))
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--methods", nargs="*", help="methods to show (default: every method with tree nodes)")
    parser.add_argument("--per-benchmark", action="store_true", help="a line per benchmark as well")
    args = parser.parse_args()
    results = json.loads(args.results.read_text())
    print("per origin: accepted tokens/step, then per depth 1, 2, ...: nodes verified/step and the share accepted")
    print(f"{'method':<24} {'origin':<10} {'acc/st':>6}  depth 1, 2, ...")
    for method, entry in results["methods"].items():
        if args.methods and method not in args.methods:
            continue
        for line in rows(method, entry):
            print(line)
        if args.per_benchmark:
            for benchmark, part in entry.get("per_benchmark", {}).items():
                for line in rows(f"  {benchmark}", part):
                    print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
