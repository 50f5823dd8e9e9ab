"""Sharded initialisation: straight into shards, the same weights on any mesh, optimizer alike."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale import TINY, Config, create
from nnxscale.analysis.hlo import largest_array
from nnxscale.core.memory import CompiledMemory, device_bytes
from nnxscale.placement.catalogue import FSDP, RULE_SETS
from nnxscale.placement.init import (
    InitPrograms,
    abstract,
    compile_init,
    compile_whole,
    draws_by_split,
    init_sharded,
)
from nnxscale.placement.rules import strategy_mesh

# Each sharded init compiles for about 3 s (XLA's CPU backend, one random-normal call site per
# parameter), so the matrix is: FSDP on 1, 2, 4 and 8 devices; every rule set on 8.
MESHES = [("FSDP", 1), ("FSDP", 2), ("FSDP", 4), ("FSDP", 8), ("DP", 8), ("TP", 8), ("FSDP+TP", 8)]


def leaves(model: nnx.Module) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


@pytest.fixture(scope="module")
def reference() -> list[np.ndarray]:
    return leaves(create(TINY))


def test_abstract_models_hold_no_memory() -> None:
    state = nnx.state(abstract(lambda: create(TINY)))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(state))


@pytest.mark.slow
@pytest.mark.parametrize(("name", "devices"), MESHES)
def test_same_weights_on_every_mesh(reference, name: str, devices: int) -> None:
    mesh = strategy_mesh(RULE_SETS[name], devices)
    model, _ = init_sharded(lambda: create(TINY), RULE_SETS[name], mesh)
    for want, got in zip(reference, leaves(model), strict=True):
        np.testing.assert_array_equal(got, want)  # bit for bit


def test_shards_and_bytes_are_what_the_layout_says() -> None:
    model, layout = init_sharded(lambda: create(TINY), FSDP, strategy_mesh(FSDP))
    state = nnx.state(model, nnx.Param)
    arrays = jax.tree.leaves(state)
    for placement, array in zip(layout.placements, arrays, strict=True):
        assert {s.data.shape for s in array.addressable_shards} == {placement.shard_shape}
        assert array.sharding.spec == placement.spec
    assert set(device_bytes(state).values()) == {layout.bytes_per_device()}
    assert layout.bytes_per_device() * 8 == layout.total_bytes()


def test_no_device_materialises_a_whole_parameter() -> None:
    compiled, _, layout = compile_init(lambda: create(TINY), FSDP, strategy_mesh(FSDP))
    biggest, _ = largest_array(compiled)
    largest_param = max(p.total_bytes for p in layout.placements)
    largest_shard = max(p.bytes_per_device for p in layout.placements)
    assert biggest <= 2 * largest_shard < largest_param  # 2x: threefry's counter pairs
    assert CompiledMemory.of(compiled).output >= layout.bytes_per_device()


def test_partitionable_random_numbers_are_forced(reference) -> None:
    with jax.threefry_partitionable(False):
        model, _ = init_sharded(lambda: create(TINY), FSDP, strategy_mesh(FSDP))
        legacy = leaves(create(TINY))  # what the legacy generator draws, unsharded
    for want, got in zip(reference, leaves(model), strict=True):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(legacy[0], reference[0])  # the setting changes the values


def test_optimizer_state_is_sharded_like_the_parameters() -> None:
    def both():
        model = create(TINY)
        return model, nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)

    (model, optimizer), _ = init_sharded(both, FSDP, strategy_mesh(FSDP))
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    for moment in ("mu", "nu"):
        moments = nnx.to_flat_state(nnx.state(optimizer)["opt_state"][0][moment])
        assert len(moments) == len(params)
        for (path, p), (mpath, m) in zip(params, moments, strict=True):
            assert path == mpath
            assert m.sharding == p.sharding and m.shape == p.shape, path


@pytest.mark.parametrize("devices", [1, 2, 4, 8])
def test_dropout_masks_do_not_depend_on_the_mesh(devices: int) -> None:
    mesh = strategy_mesh(FSDP, devices)
    shape = (8, 16, 64)

    @jax.jit
    def mask(key):
        x = nnx.Dropout(0.5)(jnp.ones(shape), rngs=key)
        return jax.lax.with_sharding_constraint(x != 0, NamedSharding(mesh, P("data")))

    single = nnx.Dropout(0.5)(jnp.ones(shape), rngs=jax.random.key(3)) != 0
    np.testing.assert_array_equal(mask(jax.random.key(3)), single)


SMALL = Config(vocab=16, embed=8, heads=2, head_dim=4, mlp=16, layers=1, max_len=8)
"""A model that compiles in a fraction of TINY's time."""


def test_the_whole_build_and_the_sharded_one_make_the_same_model() -> None:
    programs = InitPrograms.compile(lambda: create(SMALL), FSDP)
    memory, layout = programs.memory(), programs.layout
    assert memory["whole"].output >= layout.total_bytes()
    assert layout.bytes_per_device() <= memory["sharded"].output
    assert memory["sharded"].output < layout.bytes_per_device() + 1024  # + the output table
    whole = nnx.merge(programs.graphdef, programs.whole())
    for want, got in zip(leaves(whole), leaves(programs.create()), strict=True):
        np.testing.assert_array_equal(got, want)
    with jax.threefry_partitionable(False):  # the whole build draws compile_init's numbers
        again = nnx.merge(programs.graphdef, compile_whole(lambda: create(SMALL))())
    np.testing.assert_array_equal(leaves(again)[0], leaves(whole)[0])


def test_a_pytree_is_built_whole_as_it_is() -> None:
    built = compile_whole(lambda: {"w": jnp.ones((4, 2)), "b": jnp.zeros(2)})()
    assert set(built) == {"w", "b"} and built["w"].shape == (4, 2)


def test_draws_are_the_same_whatever_the_split_even_or_not() -> None:
    """JAX issue 40232's shape (496 rows) on 1 to 8 devices, and 3, 5, 6 and 7, which do not
    divide it: split at rest where they divide, inside the program (padded) where they do not."""
    draws = draws_by_split((496, 8), range(1, 9))
    assert all(d.identical for d in draws)
    uneven = {d.devices for d in draws if "padded" in d.split}
    assert uneven == {3, 5, 6, 7}
    assert [d.rows for d in draws if d.devices in (4, 8)] == ["124", "62"]
    mesh = strategy_mesh(FSDP, 3)  # JAX keeps no uneven split at rest
    with pytest.raises(ValueError, match="should evenly divide the shape"):
        jax.device_put(np.zeros((496, 8)), NamedSharding(mesh, P("data")))
