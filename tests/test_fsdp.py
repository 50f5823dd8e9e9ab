"""Hand-written FSDP computes what one device computes, with the collectives of the formulas."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from nnxscale import TINY, Trainer, adamw, comm, create, fsdp
from nnxscale.analysis.hlo import collectives
from nnxscale.core.memory import CompiledMemory
from nnxscale.placement.catalogue import DP, FSDP
from nnxscale.placement.rules import strategy_mesh
from nnxscale.train import loss_and_grads
from nnxscale.train.data import book_batches

CFG = TINY.replace(scan_layers=True)
BATCHES = book_batches(batch_size=16)
MESH = strategy_mesh(FSDP)
N = 8
MODES = {
    "regather": fsdp.Options(),
    "keep": fsdp.Options(regather=False),
    "all at once": fsdp.Options(per_layer=False, regather=False),
    "prefetch": fsdp.Options(prefetch=True, regather=False),
}


@pytest.fixture(scope="module")
def placed() -> tuple[nnx.Module, jax.Array]:
    trainer = Trainer.create(create(CFG), adamw(), FSDP, MESH)
    return trainer.model(), trainer.batch(BATCHES)


@pytest.fixture(scope="module")
def reference(placed) -> tuple[jax.Array, nnx.State]:
    model, tokens = placed
    return jax.jit(lambda m, t: loss_and_grads(m, t, None))(model, tokens)


@pytest.fixture(scope="module")
def compiled(placed) -> dict[str, jax.stages.Compiled]:
    model, tokens = placed
    return {
        name: jax.jit(lambda m, t, o=options: fsdp.loss_and_grads(m, t, None, mesh=MESH, options=o))
        .lower(model, tokens)
        .compile()
        for name, options in MODES.items()
    }


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_equal_the_compilers(placed, reference, compiled, mode) -> None:
    model, tokens = placed
    loss, grads = compiled[mode](model, tokens)
    ref_loss, ref_grads = reference
    assert abs(float(loss) - float(ref_loss)) <= 1e-6
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    for got, want, param in zip(*map(jax.tree.leaves, (grads, ref_grads)), params, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
        assert got.sharding.is_equivalent_to(param.sharding, got.ndim)  # sharded like the param


def params_bytes(model: nnx.Module) -> tuple[int, int]:
    """Bytes of all parameters, and of the block matrices (not the norm scales)."""
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    total = sum(v[...].nbytes for _, v in flat)
    matrices = sum(v[...].nbytes for p, v in flat if p[0] == "blocks" and "norm" not in str(p))
    return total, matrices


@pytest.mark.parametrize("mode", MODES)
def test_collective_bytes_match_the_formulas(placed, compiled, mode) -> None:
    model, _ = placed
    p, matrices = params_bytes(model)
    report = collectives(compiled[mode])
    gathered = p + (matrices if mode == "regather" else 0)  # the backward gathers them again
    assert report.bytes("all-gather") == (N - 1) / N * gathered
    assert report.bytes("reduce-scatter") == (N - 1) / N * p
    assert report.bytes("all-reduce") == 2 * (N - 1) / N * 4  # the loss
    assert report.count("reduce-scatter") > 0


def test_gathering_per_layer_needs_less_memory_than_all_at_once(compiled) -> None:
    temp = {name: CompiledMemory.of(c).temp for name, c in compiled.items()}
    assert temp["regather"] < temp["keep"] < temp["all at once"]


def test_the_remat_policy_saves_no_gathered_weight() -> None:
    model = create(CFG)
    graphdef, params, rest = nnx.split(model.blocks, nnx.Param, ...)
    layer = jax.tree.map(lambda a: a[0], params)

    def apply(weights: nnx.State, h: jax.Array) -> jax.Array:
        named = jax.tree.map(lambda w: checkpoint_name(w * 1.0, comm.GATHERED), weights)
        return nnx.merge(graphdef, named, rest)(h, None).sum()

    x = np.ones((2, 8, CFG.embed), np.float32)
    policy = fsdp.save_all_but_gathered
    ours = fsdp.saved_for_backward(jax.checkpoint(apply, policy=policy), layer, x)
    assert ours and not any(comm.GATHERED in line for line in ours)
    builtin = jax.checkpoint_policies.save_anything_except_these_names(comm.GATHERED)
    theirs = fsdp.saved_for_backward(jax.checkpoint(apply, policy=builtin), layer, x)
    assert sum(comm.GATHERED in line for line in theirs) == 7  # JAX 0.12 saves them anyway


@pytest.mark.slow
def test_training_equals_the_compilers_fsdp() -> None:
    def losses(rules, mesh, **options) -> list[float]:
        trainer = Trainer.create(create(CFG), adamw(), rules, mesh, dropout=False, **options)
        return trainer.train(BATCHES, 4)

    one = losses(DP, strategy_mesh(DP, 1))
    by_hand = losses(FSDP, MESH, grads_fn=fsdp.grads_fn(MESH))
    np.testing.assert_allclose(by_hand, one, rtol=0, atol=1e-5)
    with_dropout = Trainer.create(create(CFG), adamw(), FSDP, MESH,
                                  grads_fn=fsdp.grads_fn(MESH)).train(BATCHES, 2)  # fmt: skip
    assert all(np.isfinite(with_dropout))


def test_bad_options_and_models_are_refused(placed) -> None:
    with pytest.raises(ValueError, match="prefetch"):
        fsdp.Options(prefetch=True)
    model, tokens = placed
    with pytest.raises(ValueError, match="scan_layers=True"):
        fsdp.loss_and_grads(create(TINY), tokens, None, mesh=MESH)
    with pytest.raises(ValueError, match="micro_batches=1"):
        fsdp.loss_and_grads(model, tokens, None, 2, mesh=MESH)


def test_layer_bytes_are_each_layers_weights_stacked_or_not() -> None:
    """A layer's bytes are its weights' (query, key, value, out, gate, up, down, two norm
    scales), whether the layers are stacked for a scan or separate modules."""
    e, mlp, heads = TINY.embed, TINY.mlp, TINY.heads + TINY.kv_heads
    one = 4 * (2 * e * heads * TINY.head_dim + 3 * e * mlp + 2 * e)
    assert fsdp.layer_bytes(CFG) == [one] * CFG.layers
    assert fsdp.layer_bytes(TINY.replace(layers=3)) == [one] * 3
    stacked = nnx.state(create(CFG).blocks, nnx.Param)
    assert sum(fsdp.layer_bytes(CFG)) == sum(a.nbytes for a in jax.tree.leaves(stacked))


def test_loop_carries_count_what_a_scan_keeps_between_iterations(placed) -> None:
    """A scan's carry, nested in jit and shard_map; with prefetch the layer loops carry one
    gathered layer more, forward and backward."""
    carry = jax.numpy.zeros((3, 5), jax.numpy.float32)

    def looped(x):
        return jax.lax.scan(lambda c, _: (c * 2.0, None), x, None, length=4)[0].sum()

    assert fsdp.loop_carries(jax.jit(looped), carry) == [60]
    assert fsdp.loop_carries(lambda x: x.sum(), carry) == []
    model, tokens = placed

    def carries(options):
        return fsdp.loop_carries(
            lambda m, t: fsdp.loss_and_grads(m, t, None, mesh=MESH, options=options),
            model,
            tokens,
        )

    gap = [
        a - b for a, b in zip(carries(MODES["prefetch"]), carries(MODES["regather"]), strict=True)
    ]
    assert gap == [fsdp.layer_bytes(CFG)[0]] * 2  # the forward loop's, the backward's
