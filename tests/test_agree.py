"""The ulps two float32 sums of the same values may differ by when they add in other orders."""

from __future__ import annotations

import numpy as np
import pytest

from nnxscale.train.agree import order_ulps


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
