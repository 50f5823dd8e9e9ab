"""Ring attention equals dense attention, moves N-1 blocks of keys and values, splits evenly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale import context
from nnxscale.hlo import collectives
from nnxscale.mesh import make_mesh

B, T, H, D = 2, 64, 4, 16


def arrays():
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, (B, T, H, D), jnp.float32) for k in keys]


@pytest.mark.parametrize("devices", [1, 4, 8])
@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ring_attention_equals_dense_attention(devices, layout, causal) -> None:
    mesh = make_mesh((devices,), ("context",), devices=jax.devices()[:devices])
    q, k, v, w = arrays()

    def dense(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal)

    def ring(q, k, v):
        return context.attention_in_order(q, k, v, mesh, layout=layout, causal=causal)

    # float32 sums of at most 64 terms in a different order: a few ulps of values near 1
    assert jnp.abs(jax.jit(ring)(q, k, v) - dense(q, k, v)).max() < 1e-5
    grads = [
        jax.jit(jax.grad(lambda *a, f=f: (f(*a) * w).sum(), argnums=(0, 1, 2)))(q, k, v)
        for f in (dense, ring)
    ]
    for a, b in zip(*grads, strict=True):
        assert jnp.abs(a - b).max() < 1e-5


def test_keys_and_values_travel_n_minus_one_hops() -> None:
    mesh = make_mesh((8,), ("context",))
    split = NamedSharding(mesh, P(None, "context"))
    q, k, v, _ = (jax.device_put(context.to_layout(x, 8, "zigzag"), split) for x in arrays())
    program = jax.jit(lambda q, k, v: context.ring_attention(q, k, v, mesh))
    report = collectives(program.lower(q, k, v).compile())
    block = B * (T // 8) * H * D * 4
    assert report.count() == report.count("collective-permute") == 2 * 7
    assert report.bytes() == 7 * 2 * block


def test_zigzag_gives_every_device_the_same_causal_work() -> None:
    assert len(set(context.causal_work(8, 64, "zigzag"))) == 1
    contiguous = context.causal_work(8, 64, "contiguous")
    assert contiguous == sorted(contiguous) and contiguous[-1] > 10 * contiguous[0]


def test_layout_round_trip() -> None:
    x = jnp.arange(2 * 32).reshape(2, 32)
    for layout in context.LAYOUTS:
        moved = context.to_layout(x, 4, layout)
        assert (context.from_layout(moved, 4, layout) == x).all()
    assert context.to_layout(x, 4, "zigzag")[0, :4].tolist() == [0, 1, 2, 3]
    assert context.to_layout(x, 4, "zigzag")[0, 4:8].tolist() == [28, 29, 30, 31]


def test_a_length_the_axis_cannot_split_is_named() -> None:
    mesh = make_mesh((4,), ("context",), devices=jax.devices()[:4])
    q = jnp.ones((1, 20, 2, 8))
    with pytest.raises(context.ContextError, match="20 tokens cannot be cut into 8 equal"):
        context.attention_in_order(q, q, q, mesh)
    with pytest.raises(context.ContextError, match="unknown layout 'striped'"):
        context.chunk_order(4, "striped")
