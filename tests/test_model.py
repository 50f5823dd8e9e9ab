"""The Transformer: sizes, logical names, causality, dropout, scan and remat variants."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from nnxscale import TINY, Transformer, create
from nnxscale.model import BENCH, LOGICAL_AXES, compute_copy, count_params, remat_policy
from nnxscale.placement.init import abstract

TOKENS = jnp.arange(2 * 16).reshape(2, 16) % TINY.vocab


def test_sizes() -> None:
    assert count_params(create(TINY)) == 139_584
    assert count_params(abstract(lambda: Transformer(BENCH, rngs=nnx.Rngs(0)))) == 32_514_560


@pytest.mark.parametrize("scan", [False, True])
def test_every_parameter_has_logical_names_only(scan: bool) -> None:
    state = nnx.state(create(TINY.replace(scan_layers=scan)), nnx.Param)
    for path, variable in nnx.to_flat_state(state):
        names = variable.get_metadata()["out_sharding"]
        assert len(names) == variable.ndim, path
        assert set(names) <= set(LOGICAL_AXES), (path, names)
        assert (names[0] == "layers") == (scan and path[0] == "blocks"), (path, names)


def test_logits_shape_and_causality() -> None:
    model = create(TINY)
    logits = model(TOKENS)
    assert logits.shape == (2, 16, TINY.vocab) and logits.dtype == jnp.float32
    changed = model(TOKENS.at[:, 10].set(0))
    np.testing.assert_array_equal(logits[:, :10], changed[:, :10])
    assert not np.allclose(logits[:, 10:], changed[:, 10:])


def test_dropout_only_when_keyed_and_reproducible() -> None:
    model = create(TINY.replace(dropout=0.1))
    plain = model(TOKENS)
    np.testing.assert_array_equal(plain, model(TOKENS))
    key = jax.random.key(1)
    dropped = model(TOKENS, dropout_key=key)
    assert not np.allclose(plain, dropped)
    np.testing.assert_array_equal(dropped, model(TOKENS, dropout_key=key))
    assert not np.allclose(dropped, model(TOKENS, dropout_key=jax.random.key(2)))


def stacked_from_list(listed: Transformer) -> Transformer:
    """The scan-over-layers model holding the same weights as a list-of-blocks model."""
    scanned = create(TINY.replace(scan_layers=True))
    blocks = [nnx.state(b, nnx.Param) for b in listed.blocks]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *blocks)
    nnx.update(scanned.blocks, stacked)
    for name in ("embed", "head"):
        getattr(scanned, name)[...] = getattr(listed, name)[...]
    scanned.final_norm.scale[...] = listed.final_norm.scale[...]
    return scanned


@pytest.mark.parametrize("remat", [False, True, "dots"])
def test_scan_over_layers_computes_the_same_function(remat) -> None:
    listed = create(TINY)
    scanned = stacked_from_list(listed)
    scanned.cfg = TINY.replace(scan_layers=True, remat=remat)
    # f32 and the same operations in the same order: equal up to rounding of the loop form
    np.testing.assert_allclose(scanned(TOKENS), listed(TOKENS), rtol=1e-5, atol=1e-5)


def test_remat_changes_nothing_but_memory() -> None:
    model = create(TINY)
    remat = create(TINY.replace(remat=True))
    np.testing.assert_array_equal(model(TOKENS), remat(TOKENS))


def test_too_long_a_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="sequence length 33 exceeds max_len 32"):
        create(TINY)(jnp.zeros((1, 33), jnp.int32))


def test_remat_policies_are_named_or_refused() -> None:
    assert [remat_policy(r) for r in (False, True, "full", "dots")] == [
        None,
        "full",
        "full",
        "dots",
    ]
    with pytest.raises(ValueError, match="remat='selective' is not a remat policy"):
        TINY.replace(remat="selective")


def test_the_compute_copy_is_cast_where_stored() -> None:
    """Under bfloat16 compute the weights the products read are bfloat16 copies, and the
    gradients that come back through them are float32, as the parameters are."""
    model = create(TINY.replace(compute_dtype="bfloat16"))
    copy = compute_copy(model.blocks[0].attention.query, jnp.bfloat16)
    assert copy.dtype == jnp.bfloat16
    grad = jax.grad(lambda p: compute_copy(p, jnp.bfloat16).astype(jnp.float32).sum())(
        model.blocks[0].attention.query
    )
    assert grad[...].dtype == jnp.float32
    assert compute_copy(model.head, jnp.float32) is model.head[...]  # nothing to cast
