"""The ulps two float32 sums of the same values may differ by when they add in other orders, and
the comparisons `agreement` refuses because they would pass any strategy."""

from __future__ import annotations

import numpy as np
import pytest

from nnxscale import TINY, create
from nnxscale.placement.catalogue import DP
from nnxscale.placement.rules import strategy_mesh
from nnxscale.train.agree import agreement, order_ulps
from nnxscale.train.data import book_batches

BATCHES = book_batches(batch_size=16)


@pytest.mark.parametrize("terms", [64, 512, 1024, 4096])
def test_sums_in_other_orders_stay_within_order_ulps(terms: int) -> None:
    worst = 0.0
    for seed in range(50):  # per-token losses of an untrained model: 0 to ln(vocab)
        x = np.random.default_rng(seed).uniform(0, 11, terms).astype(np.float32)
        pairwise = x.sum(dtype=np.float32) / np.float32(terms)  # numpy's order
        in_order, reversed_ = (
            np.add.accumulate(v, dtype=np.float32)[-1] / np.float32(terms) for v in (x, x[::-1])
        )
        ulp = np.spacing(pairwise)
        for a, b in ((in_order, pairwise), (reversed_, pairwise), (in_order, reversed_)):
            worst = max(worst, abs(float(a) - float(b)) / ulp)
    assert worst <= order_ulps(terms)
    assert worst > order_ulps(terms) / 4  # the bound is the size of the effect, not loose


def test_a_term_left_out_is_far_outside() -> None:
    x = np.random.default_rng(0).uniform(0, 11, 1024).astype(np.float32)
    whole, short = x.mean(dtype=np.float32), x[:-1].sum(dtype=np.float32) / np.float32(1024)
    assert abs(float(whole) - float(short)) / np.spacing(whole) > 100 * order_ulps(1024)


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"learning_rate": 0.0}, "must move"),
        ({"learning_rate": -0.1}, "must move"),
        ({"learning_rate": float("nan")}, "must move"),
        ({"steps": 0}, "at least 1 step"),
        ({"steps": 2.5}, "at least 1 step"),
    ],
)
def test_settings_under_which_any_strategy_passes_are_refused_first(settings, named) -> None:
    made = []
    with pytest.raises(ValueError, match=named):
        agreement(lambda: made.append(1), DP, strategy_mesh(DP), BATCHES, **settings)
    assert made == []  # refused before a model was made or a step compiled


@pytest.mark.slow
def test_runs_whose_losses_are_not_finite_are_refused() -> None:
    """At 1e30 the first step throws the weights so far that the next loss is not finite:
    `max()` over gaps that hold NaN used to pass such runs."""
    with pytest.raises(ValueError, match=r"not finite at learning_rate=1e\+30"):
        agreement(lambda: create(TINY), DP, strategy_mesh(DP), BATCHES, learning_rate=1e30)
