"""Tokens/s of two methods of one ``treegraft bench`` run, over all turns and over the turns where both
produced the same text.

In bf16 a method's tree changes the target's rounding, so greedy decoding may take another branch at
a near-tie (the bench's lossless check allows it). Two methods then decode different texts, and a
text that repeats its prompt decodes several times faster than one that does not: a per-benchmark
comparison can measure the text rather than the method. The same-text rate compares like with like
(on a subset biased towards the turns where no near-tie came up).

    python benchmarks/same_text.py runs/bench treegraft all-small all-mid
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

Turn = tuple[str, int, int]  # benchmark, question id, turn


def turns(run: Path, method: str) -> dict[Turn, tuple[str, int, float]]:
    """(text, new tokens, wall seconds) of every turn ``method`` answered in ``run``."""
    found = {}
    for line in (run / "answers" / f"{method}.jsonl").read_text().splitlines():
        answer = json.loads(line)
        choice = answer["choices"][0]
        for turn, row in enumerate(zip(choice["turns"], choice["new_tokens"], choice["wall_time"], strict=True)):
            found[(answer["benchmark"], answer["question_id"], turn)] = row
    return found


def rate(rows: dict[Turn, tuple[str, int, float]], keys: list[Turn]) -> float:
    return sum(rows[k][1] for k in keys) / sum(rows[k][2] for k in keys)


def main(run: Path, method: str, baselines: list[str]) -> None:
    mine = turns(run, method)
    for baseline in baselines:
        theirs = turns(run, baseline)
        same = [key for key in mine if key in theirs and mine[key][0] == theirs[key][0]]
        everything = rate(mine, list(mine)) / rate(theirs, list(theirs))
        line = f"{method} / {baseline}: all {len(mine)} turns {everything:.3f}"
        if same:
            tokens = sum(mine[key][1] for key in same)
            line += f"; same text on {len(same)} turns ({tokens} tokens) {rate(mine, same) / rate(theirs, same):.3f}"
        print(line)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit("usage: python benchmarks/same_text.py RUN_DIR METHOD BASELINE [BASELINE ...]")
    main(Path(sys.argv[1]), sys.argv[2], sys.argv[3:])
