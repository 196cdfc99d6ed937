"""Report: how much Graft's early stop can earn over ``dense`` on this device, priced from dense's own steps.

Graft stops drafting at the first checkpoint whose confidence ``c_d`` (the best cumulative probability among the
nodes layer ``d`` drafted) is below its threshold ``τ_d``. Whether that pays depends on the device: a stop after
layer ``d`` (0-based) spares the drafter forwards of the layers after it, and gives up the tokens those layers
would have had accepted. This script decodes the questions with ``dense`` and records, per step, every layer's
``c_d``, the accepted length τ and the measured drafter forward and verification times. It then prices a stop
after layer ``d`` as ``d + 1`` drafter forwards plus the step's measured verification and host time, with at most
``d + 2`` accepted tokens (the drafted depths and the bonus), and reports against ``dense``:

- ``thresholds``: the modelled speed of stopping at the given thresholds (default: the profile's graft options);
- ``best grid``: the best thresholds on a grid (chosen on these very steps, so an upper estimate for them);
- ``oracle``: every step stops where it is best for it, knowing its τ (a bound no confidence rule can beat).

What the model leaves out: graft's retrieved nodes (accepted 2–5 % of the time on a CPU,
``acceptance_by_origin.py``), the verification time a smaller tree would save (graft fills the budget), and a
stop that prunes the accepted path away (graft keeps the best nodes by score, where the accepted path mostly is).
So it measures what confidence stopping alone can earn here: when even the oracle is close to 1, no threshold
tuning will make graft much faster than ``dense`` on this device.

    OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/graft_stopping.py --pair qwen2.5-coder-0.5b:qwen2.5-coder-1.5b \\
        --first-prompt 14 --num-prompts 1
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported

import argparse  # noqa: E402
import itertools  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, replace  # noqa: E402

import torch  # noqa: E402

from treegraft_cli.bench.suites import suite_questions  # noqa: E402
from treegraft_cli.config import DecodeConfig  # noqa: E402
from treegraft_cli.pipeline import Pipeline, chat_messages  # noqa: E402
from treegraft_cli.profiles import load_profile, profile_for_pair  # noqa: E402

GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)  # thresholds searched at every checkpoint but the last


@dataclass(frozen=True)
class Step:
    benchmark: str
    confidences: tuple[float, ...]  # c_d per drafted layer d
    tau: int  # accepted length, bonus included


@dataclass(frozen=True)
class Prices:
    forward_ms: float  # one drafter forward
    rest_ms: float  # a step's verification and host time


def stop_layer(step: Step, thresholds: tuple[float, ...]) -> int:
    """The layer after which a graft with ``thresholds`` (one per layer, 0: never fires) stops drafting."""
    for layer, (confidence, threshold) in enumerate(zip(step.confidences, thresholds, strict=False)):
        if confidence < threshold:
            return layer
    return len(step.confidences) - 1


def tokens_and_ms(step: Step, layer: int, prices: Prices) -> tuple[int, float]:
    return min(step.tau, layer + 2), (layer + 1) * prices.forward_ms + prices.rest_ms


def rate(steps: list[Step], prices: Prices, layer_of) -> float:
    """Accepted tokens per ms when each step stops after ``layer_of(step)``."""
    tokens = ms = 0.0
    for step in steps:
        t, m = tokens_and_ms(step, layer_of(step), prices)
        tokens, ms = tokens + t, ms + m
    return tokens / ms if ms else 0.0


def best_layer(step: Step, prices: Prices, r: float) -> int:
    """The layer to stop after that maximises the step's tokens − ``r`` · ms."""
    def value(layer: int) -> float:
        tokens, ms = tokens_and_ms(step, layer, prices)
        return tokens - r * ms
    return max(range(len(step.confidences)), key=value)


def oracle_rate(steps: list[Step], prices: Prices) -> float:
    """Each step stops where τ − R·T is largest at the rate R this yields (Dinkelbach's iteration for a ratio: R
    rises every round until no step changes its layer)."""
    current = rate(steps, prices, lambda step: len(step.confidences) - 1)
    while True:
        improved = rate(steps, prices, lambda step, r=current: best_layer(step, prices, r))
        if improved <= current * (1 + 1e-9):
            return current
        current = improved


def best_grid(steps: list[Step], prices: Prices, depth: int) -> tuple[float, tuple[float, ...]]:
    """The best rate over thresholds from ``GRID`` at layers 0..D−2 (a stop after the last layer spares nothing)."""
    best = (0.0, ())
    for thresholds in itertools.product(GRID, repeat=depth - 1):
        best = max(best, (rate(steps, prices, lambda step, t=thresholds: stop_layer(step, t)), thresholds))
    return best


def record_steps(pipeline: Pipeline, config: DecodeConfig, questions) -> tuple[list[Step], Prices]:
    """Decode each question's first turn with ``dense``; every step's confidences, τ, and the mean prices.

    Each layer's best score stays on the device until the question is decoded (one read then), so recording adds
    no synchronisation to the steps it times."""
    decoder = pipeline.decoder(config)
    method = decoder.method
    drafted_layers = method.layers
    best_scores: list[torch.Tensor] = []  # per drafted layer, [] log c_d

    def recording(committed: torch.Tensor) -> Iterator:
        for drafted in drafted_layers(committed):
            best_scores.append(drafted.best_score())
            yield drafted

    method.layers = recording  # this decoder's method only
    depth = config.tree.depth
    steps, forward_s, calls, rest_s = [], 0.0, 0, 0.0
    for question in questions:
        prompt = pipeline.encode_chat(chat_messages(question.turns[:1]))
        best_scores.clear()
        generation = decoder.generate(prompt)
        confidences = torch.stack(best_scores).exp().tolist()
        for index, stats in enumerate(generation.steps):
            steps.append(Step(question.benchmark, tuple(confidences[index * depth : (index + 1) * depth]),
                              stats.accepted_length))
            forward_s += stats.drafter_forward_s
            calls += sum(stats.drafter_calls.values())
            rest_s += stats.verify_s + stats.host_overhead_s
    count = max(len(steps), 1)
    return steps, Prices(1e3 * forward_s / max(calls, 1), 1e3 * rest_s / count)


def report(steps: list[Step], prices: Prices, thresholds: tuple[float, ...], depth: int) -> list[str]:
    dense = rate(steps, prices, lambda step: depth - 1)
    given = rate(steps, prices, lambda step: stop_layer(step, thresholds))
    grid_rate, grid_thresholds = best_grid(steps, prices, depth)
    lines = [
        f"{len(steps)} steps of dense, τ {sum(s.tau for s in steps) / len(steps):.2f}; a drafter forward "
        f"{prices.forward_ms:.0f} ms, verification and host {prices.rest_ms:.0f} ms a step",
        f"{'stopping':<44} {'/ dense':>8}",
        f"{'thresholds ' + str(thresholds):<44} {given / dense:8.3f}",
        f"{'best grid ' + str(grid_thresholds):<44} {grid_rate / dense:8.3f}",
        f"{'oracle (knows each step τ)':<44} {oracle_rate(steps, prices) / dense:8.3f}",
    ]
    for benchmark in dict.fromkeys(step.benchmark for step in steps):
        part = [step for step in steps if step.benchmark == benchmark]
        part_dense = rate(part, prices, lambda step: depth - 1)
        lines.append(f"  {benchmark:<42} oracle {oracle_rate(part, prices) / part_dense:6.3f}")
    return lines


def layer_thresholds(options: dict, depth: int) -> tuple[float, ...]:
    """Per drafted layer, the confidence below which the graft options stop there: the largest threshold of the
    checkpoints on it (graft fires the first of them whose threshold the confidence is below; checkpoints past the
    last drafted layer are checked on it); 0 where none."""
    thresholds = [0.0] * depth
    for checkpoint, threshold in zip(options["checkpoints"], options["thresholds"], strict=True):
        layer = min(checkpoint, depth - 1)
        thresholds[layer] = max(thresholds[layer], threshold)
    return tuple(thresholds)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pair", default="qwen2.5-coder-0.5b:qwen2.5-coder-1.5b")
    parser.add_argument("--profile", help="profile name or YAML (default: the pair's)")
    parser.add_argument("--dtype", default=None, help="default: the profile's")
    parser.add_argument("--suite", default="quick")
    parser.add_argument("--first-prompt", type=int, default=1)
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("-n", "--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    profile = load_profile(args.profile) if args.profile else profile_for_pair(args.pair)
    if profile is None or "graft" not in profile.method_options:
        parser.error(f"no profile with graft options for {args.pair}: pass --profile NAME_OR_YAML")
    dtype = args.dtype or profile.dtype
    pipeline = Pipeline.load(args.pair, dtype, profile.device, thinking=profile.thinking, linear=profile.linear)
    tree = profile.decode.tree
    config = replace(profile.decode, method="dense", max_new_tokens=args.max_new_tokens)
    questions = suite_questions(args.suite, num_prompts=args.num_prompts, first_prompt=args.first_prompt)
    steps, prices = record_steps(pipeline, config, questions)
    thresholds = layer_thresholds(profile.method_options["graft"], tree.depth)
    print(f"{args.pair} {dtype}, N={tree.budget} D={tree.depth} K={tree.top_k}, {len(questions)} questions from "
          f"question {args.first_prompt} of each file, {args.max_new_tokens} new tokens")
    print("\n".join(report(steps, prices, thresholds, tree.depth)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
