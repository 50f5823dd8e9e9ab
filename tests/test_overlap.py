"""The collective matmul against the all-gather and product it replaces, and the readings of
the compiled program that say what may overlap: sends independent of products, and the
asynchronous start/done pairs of a schedule."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import nnxscale as nx
from nnxscale import overlap
from nnxscale.train.agree import order_ulps

WIDTH = 96


def operands(n: int, rows: int = 8) -> tuple[jax.Array, jax.Array]:
    x = jax.random.normal(jax.random.key(0), (rows * n, WIDTH))
    w = jax.random.normal(jax.random.key(1), (WIDTH, 4 * n))
    return x, w


@pytest.mark.slow
@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_the_collective_matmul_equals_the_gathered_product(n: int) -> None:
    mesh = nx.make_mesh((n,), ("model",), devices=jax.devices()[:n])
    x, w = operands(n)
    ring = overlap.collective_matmul(mesh, "model")(x, w)
    plain = overlap.gathered_matmul(mesh, "model")(x, w)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    # a float32 dot of WIDTH terms: sqrt(WIDTH) ulps of the sum of the terms' magnitudes
    scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(w))
    bound = order_ulps(WIDTH) * np.finfo(np.float32).eps * scale
    for result in (ring, plain):
        assert (np.abs(np.asarray(result) - exact) <= bound).all()
    if n > 1:
        assert ring.sharding.spec == P(None, "model")


def test_each_send_is_independent_of_the_product_beside_it() -> None:
    mesh = nx.make_mesh((8,), ("model",))
    x, w = operands(8)
    program = overlap.collective_matmul(mesh, "model").lower(x, w).compile()
    report = nx.collectives(program)
    assert report.count("collective-permute") == 7 and report.count("all-gather") == 0
    assert report.bytes("collective-permute") == 7 * 8 * WIDTH * 4
    pairs = overlap.independent_pairs(program)
    assert len(pairs) == 7
    assert len({p.transfer for p in pairs}) == len({p.product for p in pairs}) == 7


def test_a_send_of_a_product_is_not_independent_of_it() -> None:
    def serial(x: jax.Array, w: jax.Array, axis: str) -> jax.Array:
        # each step sends on what it just multiplied: the send waits for the product
        n = jax.lax.axis_size(axis)
        block = x @ w[:, :1] * x
        for _ in range(n - 1):
            block = jax.lax.ppermute(block @ w[:, :1] * x, axis, overlap._ring(n))
        return block[:, :1] * w[:1]

    mesh = nx.make_mesh((4,), ("model",), devices=jax.devices()[:4])
    x = jax.random.normal(jax.random.key(0), (8 * 4, WIDTH))
    w = jax.random.normal(jax.random.key(1), (WIDTH, WIDTH))
    mapped = jax.shard_map(
        functools.partial(serial, axis="model"), mesh=mesh,
        in_specs=(P("model", None), P(None, None)), out_specs=P("model", None),
    )  # fmt: skip
    program = jax.jit(mapped).lower(x, w).compile()
    assert nx.collectives(program).count("collective-permute") == 3
    assert overlap.independent_pairs(program) == []


SCHEDULED = """HloModule m, is_scheduled=true, num_partitions=2

ENTRY %main (p: f32[8,4], q: f32[4,4]) -> (f32[16,4], f32[8,4]) {
  %p = f32[8,4]{1,0} parameter(0)
  %q = f32[4,4]{1,0} parameter(1)
  %ags = (f32[8,4]{1,0}, f32[16,4]{1,0}) all-gather-start(%p), channel_id=1, \
replica_groups={{0,1}}, dimensions={0}, use_global_device_ids=true
  %d = f32[8,4]{1,0} dot(%p, %q), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %agd = f32[16,4]{1,0} all-gather-done(%ags)
  ROOT %r = (f32[16,4]{1,0}, f32[8,4]{1,0}) tuple(%agd, %d)
}
"""


def test_an_async_pair_holds_the_work_scheduled_between_its_halves() -> None:
    # what XLA's latency-hiding scheduler makes on GPU and TPU: the product inside the gather
    assert overlap.async_pairs(SCHEDULED) == [overlap.Async("ags", "agd", ("d",))]


def test_the_cpu_backend_compiles_collectives_synchronously() -> None:
    mesh = nx.make_mesh((8,), ("model",))
    x, w = operands(8)
    for build in (overlap.collective_matmul, overlap.gathered_matmul):
        program = build(mesh, "model").lower(x, w).compile()
        assert nx.collectives(program).count() > 0
        assert overlap.async_pairs(program) == []
