"""Ring collective costs against the closed forms."""

from __future__ import annotations

import pytest

from nnxscale.comm import ring_bytes


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_formulas(n: int) -> None:
    p = 1024.0
    assert ring_bytes("all-gather", p, n) == (n - 1) / n * p
    assert ring_bytes("reduce-scatter", p, n) == (n - 1) / n * p
    assert ring_bytes("all-to-all", p, n) == (n - 1) / n * p
    assert ring_bytes("all-reduce", p, n) == 2 * (n - 1) / n * p
    assert ring_bytes("collective-permute", p, n) == p


def test_all_reduce_is_reduce_scatter_plus_all_gather() -> None:
    for n in (2, 3, 8, 64):
        total = ring_bytes("reduce-scatter", 96.0, n) + ring_bytes("all-gather", 96.0, n)
        assert ring_bytes("all-reduce", 96.0, n) == pytest.approx(total)


def test_one_device_sends_nothing() -> None:
    assert ring_bytes("all-reduce", 4096, 1) == 0


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown collective 'psum'"):
        ring_bytes("psum", 1, 2)
    with pytest.raises(ValueError, match="group_size must be at least 1"):
        ring_bytes("all-gather", 1, 0)
