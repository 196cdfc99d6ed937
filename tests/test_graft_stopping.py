"""The pricing of ``benchmarks/graft_stopping.py``: where a threshold stops, what a stop is worth, the oracle bound."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from graft_stopping import (  # noqa: E402
    GRID,
    Prices,
    Step,
    best_grid,
    layer_thresholds,
    oracle_rate,
    rate,
    stop_layer,
)

PRICES = Prices(forward_ms=100.0, rest_ms=300.0)


def test_a_step_stops_at_the_first_layer_whose_confidence_is_below_its_threshold():
    step = Step("qa", (0.9, 0.5, 0.2, 0.1), tau=3)
    assert stop_layer(step, (0.0, 0.0, 0.0, 0.0)) == 3  # never fires: every layer drafted
    assert stop_layer(step, (0.3, 0.6, 0.3, 0.0)) == 1
    assert stop_layer(step, (0.95, 0.6, 0.3, 0.0)) == 0


def test_a_stop_keeps_at_most_the_drafted_depths_and_the_bonus():
    deep = Step("qa", (0.9, 0.9, 0.9, 0.9), tau=5)
    # after layer 0: one forward, depth 1 and the bonus
    assert rate([deep], PRICES, lambda step: 0) == pytest.approx(2 / 400)
    assert rate([deep], PRICES, lambda step: 3) == pytest.approx(5 / 700)


def test_the_oracle_stops_only_the_steps_whose_later_layers_earn_nothing():
    deep = Step("code", (0.9, 0.9, 0.9, 0.9), tau=5)
    missed = Step("qa", (0.1, 0.1, 0.1, 0.1), tau=1)
    # dense: 6 tokens in 1400 ms; stopping the missed step after layer 0 spares three forwards
    assert rate([deep, missed], PRICES, lambda step: 3) == pytest.approx(6 / 1400)
    assert oracle_rate([deep, missed], PRICES) == pytest.approx(6 / 1100)
    # and a threshold between the two confidences does as well
    grid_rate, thresholds = best_grid([deep, missed], PRICES, depth=4)
    assert grid_rate == pytest.approx(6 / 1100) and thresholds[0] > 0.1


def test_no_threshold_beats_the_oracle():
    generator = random.Random(0)
    steps = [Step("qa", tuple(sorted((generator.random() for _ in range(4)), reverse=True)), generator.randint(1, 5))
             for _ in range(40)]
    bound = oracle_rate(steps, PRICES)
    for t0 in GRID:
        for t1 in GRID:
            assert rate(steps, PRICES, lambda step, t=(t0, t1, 0.0): stop_layer(step, t)) <= bound * (1 + 1e-9)


def test_graft_checkpoints_past_the_last_drafted_layer_are_checked_on_it():
    options = {"checkpoints": [0, 1, 5], "thresholds": [0.3, 0.7, 0.1]}
    assert layer_thresholds(options, depth=4) == (0.3, 0.7, 0.0, 0.1)
    # two checkpoints on one layer: a confidence below either threshold stops there
    assert layer_thresholds({"checkpoints": [0, 3, 5], "thresholds": [0.3, 0.1, 0.2]}, depth=4) == (0.3, 0.0, 0.0, 0.2)
