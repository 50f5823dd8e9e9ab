"""The ring costs against rings that run: each collective simulated step by step on N devices,
its result checked against what the collective computes, and the bytes each device sent
counted and compared with `ring_bytes`."""

from __future__ import annotations

import numpy as np
import pytest

from nnxscale.analysis.comm import ring_bytes

ITEM = 4  # bytes of one float32 element


def ring_reduce_scatter(shards: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """The ring algorithm: N - 1 steps, each device passing one block of its running sums to
    its right neighbour. Device d ends with the sum of block d; returns (blocks, bytes sent)."""
    n = len(shards)
    blocks = [np.array_split(s.astype(np.float64), n) for s in shards]
    sent = [0] * n
    for step in range(n - 1):
        moving = [(d, (d - step - 1) % n) for d in range(n)]  # (sender, block index)
        payload = [blocks[d][b].copy() for d, b in moving]
        for (d, b), data in zip(moving, payload, strict=True):
            blocks[(d + 1) % n][b] = blocks[(d + 1) % n][b] + data
            sent[d] += data.size * ITEM
    return [blocks[d][d] for d in range(n)], sent


def ring_all_gather(pieces: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """N - 1 steps, each device forwarding the last block it received to its right."""
    n = len(pieces)
    held = [{d: pieces[d]} for d in range(n)]
    sent = [0] * n
    for step in range(n - 1):
        moving = [(d, (d - step) % n) for d in range(n)]
        for d, b in moving:
            held[(d + 1) % n][b] = held[d][b]
            sent[d] += held[d][b].size * ITEM
    return [np.concatenate([h[b] for b in range(n)]) for h in held], sent


def direct_all_to_all(buffers: list[np.ndarray]) -> tuple[list[np.ndarray], list[int]]:
    """Device d sends block e of its buffer to device e (all but its own block)."""
    n = len(buffers)
    blocks = [np.array_split(b, n) for b in buffers]
    sent = [sum(blocks[d][e].size * ITEM for e in range(n) if e != d) for d in range(n)]
    return [np.concatenate([blocks[s][d] for s in range(n)]) for d in range(n)], sent


@pytest.fixture(params=[1, 2, 3, 4, 8], ids=lambda n: f"N{n}")
def arrays(request) -> list[np.ndarray]:
    n = request.param
    rng = np.random.default_rng(n)
    return [rng.normal(size=12 * n).astype(np.float32) for _ in range(n)]


def test_reduce_scatter_sends_what_the_formula_says(arrays) -> None:
    n, full = len(arrays), arrays[0].size * ITEM
    blocks, sent = ring_reduce_scatter(arrays)
    total = np.sum(arrays, axis=0, dtype=np.float64)
    np.testing.assert_allclose(np.concatenate(blocks), total, rtol=1e-12)
    assert set(sent) == {ring_bytes("reduce-scatter", full, n)}


def test_all_gather_sends_what_the_formula_says(arrays) -> None:
    n = len(arrays)
    pieces = [a[: a.size // n] for a in arrays]
    gathered, sent = ring_all_gather(pieces)
    assert all(np.array_equal(g, np.concatenate(pieces)) for g in gathered)
    full = sum(p.size for p in pieces) * ITEM  # the all-gather's output
    assert set(sent) == {ring_bytes("all-gather", full, n)}


def test_all_reduce_as_reduce_scatter_then_all_gather(arrays) -> None:
    n, full = len(arrays), arrays[0].size * ITEM
    blocks, scattered = ring_reduce_scatter(arrays)
    summed, gathered = ring_all_gather(blocks)
    total = np.sum(arrays, axis=0, dtype=np.float64)
    assert all(np.allclose(s, total, rtol=1e-12) for s in summed)
    sent = [a + b for a, b in zip(scattered, gathered, strict=True)]
    assert set(sent) == {ring_bytes("all-reduce", full, n)}


def test_all_to_all_and_permute_send_what_the_formulas_say(arrays) -> None:
    n, full = len(arrays), arrays[0].size * ITEM
    moved, sent = direct_all_to_all(arrays)
    for d in range(n):  # device d ends with block d of every device's buffer
        for s, block in enumerate(np.array_split(moved[d], n)):
            assert np.array_equal(block, np.array_split(arrays[s], n)[d])
    assert set(sent) == {ring_bytes("all-to-all", full, n)}
    # a permute hands each device's whole buffer to its right neighbour: one buffer each
    assert {a.size * ITEM for a in arrays} == {ring_bytes("collective-permute", full, n)}


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown collective 'psum'"):
        ring_bytes("psum", 1, 2)
    with pytest.raises(ValueError, match="group_size must be at least 1"):
        ring_bytes("all-gather", 1, 0)
