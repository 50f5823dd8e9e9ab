"""Training under every rule set computes what one device computes."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale import TINY, Trainer, TrainOptions, adamw, costs, create, trainer_for
from nnxscale.analysis.hlo import collectives
from nnxscale.core.memory import CompiledMemory, device_bytes
from nnxscale.core.trees import largest_difference
from nnxscale.model.losses import cross_entropy
from nnxscale.placement.catalogue import DP, FSDP, FSDP_TP, TP
from nnxscale.placement.compiling import two_at_a_time
from nnxscale.placement.mesh import AxisTypeError
from nnxscale.placement.rules import strategy_mesh
from nnxscale.train import loss_and_grads, params_by_path, unreduced_grads
from nnxscale.train.agree import agreement
from nnxscale.train.data import Batches, arithmetic_text, encode

STEPS = 4
BATCHES = Batches(encode(arithmetic_text(2000)), batch_size=16, length=32)


def trainer(rules, devices: int = 8, **options) -> Trainer:
    cfg = options.pop("cfg", TINY)
    return trainer_for(rules, devices, cfg, tx=optax.adam(3e-3), **options)


@pytest.fixture(scope="module")
def single() -> tuple[list[float], Trainer]:
    run = trainer(DP, devices=1)
    return run.train(BATCHES, STEPS), run


@pytest.mark.slow
@pytest.mark.parametrize("rules", [DP, FSDP, TP, FSDP_TP], ids=lambda r: r.name)
def test_every_strategy_matches_one_device(single, rules) -> None:
    losses, _ = single
    run = trainer(rules)
    got = run.train(BATCHES, STEPS)
    np.testing.assert_allclose(got, losses, rtol=0, atol=1e-5)  # f32, a few ulps of drift
    assert run.step_count() == STEPS
    # the weights under SGD (nx.agreement): Adam divides each gradient by its running size,
    # so a weight whose gradient sums terms that cancel (RoPE's slowest pair of query
    # dimensions here) can end 0.4% of a step apart on a correct run
    mesh = run.layout.mesh
    agreement(lambda: create(TINY), rules, mesh, BATCHES, dropout=False).check()


def test_loss_falls(single) -> None:
    losses, _ = single
    assert losses[-1] < losses[0] - 1.0


def test_fsdp_state_is_split_over_all_devices() -> None:
    run = trainer(FSDP)
    held = device_bytes(run.state)
    assert set(held.values()) == {run.layout.bytes_per_device()}
    replicated = run.layout.replicated_bytes()
    assert run.layout.bytes_per_device() * 8 == run.layout.total_bytes() + 7 * replicated


@pytest.mark.slow
def test_the_step_donates_the_state() -> None:
    run = trainer(FSDP)
    compiled = run.compile(run.batch(BATCHES))
    assert CompiledMemory.of(compiled).alias == run.layout.bytes_per_device()
    assert run.compile(run.batch(BATCHES, 1)) is compiled  # compiled once, then reused


@pytest.mark.slow
def test_accumulating_micro_batches_equals_the_whole_batch() -> None:
    model = create(TINY)
    tokens = BATCHES.rows(0)
    loss, grads = loss_and_grads(model, tokens, None)
    micro_loss, micro_grads = loss_and_grads(model, tokens, None, micro_batches=4)
    np.testing.assert_allclose(micro_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(micro_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)  # f32 sums in another order
    with pytest.raises(ValueError, match="cannot be cut into 3 micro-batches"):
        loss_and_grads(model, tokens, None, micro_batches=3)


def test_micro_batches_too_small_for_the_data_axis() -> None:
    run = trainer(FSDP, micro_batches=4)  # 16 rows: micro-batches of 4 rows on 8 devices
    with pytest.raises(ValueError, match="each of 4 micro-batches of 4 rows cannot be split"):
        run.train(BATCHES, 1)


@pytest.mark.slow
def test_accumulated_training_follows_whole_batch_training() -> None:
    batches = Batches(BATCHES.tokens, batch_size=32, length=32)
    whole = trainer(FSDP, dropout=False)
    micro = trainer(FSDP, dropout=False, micro_batches=4)
    np.testing.assert_allclose(micro.train(batches, 3), whole.train(batches, 3), atol=1e-5)


@pytest.mark.slow
def test_ema_starts_at_the_parameters_and_follows_them() -> None:
    run = trainer(FSDP, dropout=False)
    state = nnx.merge(run.graphdef, run.state)
    before = {k: np.asarray(v[...]) for k, v in state.ema.items()}
    params = params_by_path(state.model)
    assert before.keys() == params.keys()
    for key, value in before.items():
        np.testing.assert_array_equal(value, params[key][...])  # not zeros
    run.train(BATCHES, 1)
    after = nnx.merge(run.graphdef, run.state)
    new = params_by_path(after.model)
    for key, value in after.ema.items():
        expected = 0.9 * before[key] + 0.1 * np.asarray(new[key][...])
        np.testing.assert_allclose(np.asarray(value[...]), expected, rtol=1e-6, atol=1e-7)
    tokens = run.batch(BATCHES, 100)
    assert float(run.evaluate_ema(run.state, tokens)) != float(run.evaluate(run.state, tokens))


def test_mixed_precision_keeps_float32_master_weights() -> None:
    run = trainer(FSDP, cfg=TINY.replace(compute_dtype="bfloat16"))
    losses = run.train(BATCHES, 2)
    assert np.isfinite(losses).all()
    for leaf in jax.tree.leaves(nnx.state(nnx.merge(run.graphdef, run.state), nnx.Param)):
        assert leaf.dtype == np.float32


def test_two_at_a_time_returns_every_result_in_order() -> None:
    calls = [lambda i=i: jax.jit(lambda x: x * i).lower(1.0).compile()(2.0) for i in range(5)]
    assert [float(r) for r in two_at_a_time(calls)] == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_time_steps_runs_the_steps_it_times() -> None:
    run = trainer(FSDP)
    run.train(BATCHES, 1)
    times = run.time_steps(BATCHES, 2, first=1)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert run.step_count() == 3


def test_largest_difference_reads_keys_and_any_devices() -> None:
    a = {"w": jax.numpy.ones(3), "key": jax.random.key(0)}
    b = {"w": jax.device_put(jax.numpy.ones(3) * 1.5, jax.devices()[1]), "key": jax.random.key(0)}
    assert largest_difference(a, b) == 0.5
    assert largest_difference(a, a) == 0.0


@pytest.mark.slow
def test_a_batch_of_another_shape_gets_its_own_program() -> None:
    """One program per kind of batch (shapes, dtypes, shardings): a shorter batch compiles
    its own step instead of being fed to the first one, and the first is reused after it."""
    run = trainer(DP, devices=2)
    shorter = Batches(BATCHES.tokens, batch_size=16, length=16)
    first = run.compile(run.batch(BATCHES))
    losses = run.train(shorter, 1)
    assert run.compiled is not first and np.isfinite(losses).all()
    assert run.train(BATCHES, 1) and run.compiled is first and len(run.programs) == 2


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"micro_batches": 0}, "at least 1"),
        ({"micro_batches": 2.5}, "whole number"),
        ({"ema_decay": 1.0}, r"\[0, 1\)"),
        ({"loss_fn": lambda *a: 0.0, "grads_fn": loss_and_grads}, "not both"),
    ],
)
def test_options_refuse_what_cannot_train(changes, match) -> None:
    with pytest.raises(ValueError, match=match):
        TrainOptions(**changes)


def test_an_unknown_option_names_the_known_ones() -> None:
    with pytest.raises(TypeError, match=r"unknown training options \['micro_batch'\].*"):
        trainer(DP, devices=1, micro_batch=2)


@pytest.mark.slow
def test_one_options_object_reaches_the_step() -> None:
    """The options given to `create` are the trainer's, unchanged, and its programs use them:
    with activations=False the model's activation constraints are not in the program."""
    options = TrainOptions(dropout=False, micro_batches=2, activations=False)
    run = trainer_for(FSDP, 2, options=options)
    assert run.options is options
    free = run.compile(run.batch(BATCHES)).as_text()
    named = trainer_for(FSDP, 2, options=options.replace(activations=True))
    assert named.compile(named.batch(BATCHES)).as_text() != free


def test_role_bytes_split_what_each_zero_stage_splits() -> None:
    from nnxscale import Config
    from nnxscale.model import count_params
    from nnxscale.placement.catalogue import ZERO1, ZERO2
    from nnxscale.placement.init import abstract
    from nnxscale.train import role_bytes

    small = Config(vocab=16, embed=8, heads=2, head_dim=4, mlp=16, layers=1, max_len=8)
    params = 4 * count_params(abstract(lambda: create(small)))
    held = role_bytes(lambda: create(small), [DP, ZERO1, ZERO2, FSDP])
    n = jax.device_count()  # every array of `small` has a dimension n divides
    count = 4  # AdamW's step count, held whole
    assert held["DP"] == {"params": params, "grads": params, "optimizer": 2 * params + count}
    assert held["ZeRO-1"] == {
        "params": params,
        "grads": params,
        "optimizer": 2 * params // n + count,
    }
    assert held["ZeRO-2"] == {
        "params": params,
        "grads": params // n,
        "optimizer": 2 * params // n + count,
    }
    assert held["FSDP"] == {
        "params": params // n,
        "grads": params // n,
        "optimizer": 2 * params // n + count,
    }


def test_role_bytes_plan_for_devices_this_machine_has_not() -> None:
    from nnxscale import Config
    from nnxscale.model import count_params
    from nnxscale.placement.catalogue import ZERO2
    from nnxscale.placement.init import abstract
    from nnxscale.train import role_bytes

    small = Config(vocab=64, embed=32, heads=2, head_dim=16, mlp=64, layers=1, max_len=8)
    params = 4 * count_params(abstract(lambda: create(small)))
    held = role_bytes(lambda: create(small), [ZERO2, FSDP], devices=32)["ZeRO-2"]
    assert held == {"params": params, "grads": params // 32, "optimizer": 2 * params // 32 + 4}
    assert role_bytes(lambda: create(small), [DP], devices=32) == role_bytes(
        lambda: create(small), [DP]
    )  # DP splits nothing, on any count


def test_evaluations_compile_with_the_trainer_s_options() -> None:
    run = trainer(DP, options=TrainOptions(compiler_options={"xla_no_such_option": True}))
    with pytest.raises(Exception, match="xla_no_such_option"):
        run.evaluate(run.state, run.batch(BATCHES))


@pytest.mark.slow
@pytest.mark.parametrize("rules", [DP, FSDP_TP], ids=lambda r: r.name)
def test_the_transformer_trains_alike_on_explicit_and_auto_axes(rules) -> None:
    """On Explicit axes every product and lookup of the model says where its output goes;
    the losses are those of Auto axes, where the compiler chooses."""
    runs = {}
    for explicit in (False, True):
        mesh = strategy_mesh(rules, explicit=explicit)
        runs[explicit] = Trainer.create(create(TINY), adamw(), rules, mesh).train(BATCHES, STEPS)
    np.testing.assert_allclose(runs[True], runs[False], rtol=0, atol=1e-5)


def test_cross_entropy_on_a_split_vocabulary_picks_by_one_hot_on_explicit_axes() -> None:
    """On Explicit axes JAX refuses a gather from logits split over the vocabulary; the loss
    then picks with one-hot vectors, the same numbers."""
    mesh = strategy_mesh(TP, explicit=True)
    logits = jax.random.normal(jax.random.key(0), (4, 8, 32))
    targets = jax.random.randint(jax.random.key(1), (4, 8), 0, 32)
    split = jax.device_put(logits, NamedSharding(mesh, P(None, None, "model")))
    with pytest.raises(Exception, match="out_sharding"):
        jax.jit(lambda x, t: optax.softmax_cross_entropy_with_integer_labels(x, t))(split, targets)
    got = jax.jit(cross_entropy)(split, targets)
    np.testing.assert_allclose(got, cross_entropy(logits, targets), rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("rules", [DP, FSDP], ids=lambda r: r.name)
def test_unreduced_gradients_are_reduced_once_per_step(rules) -> None:
    """With 4 micro-batches the library's step reduces about 4 P bytes of gradients (inside
    the loop); unreduced_grads reduces exactly P once, besides the loss of each micro-batch
    (4 bytes), and trains the same losses."""
    m, mesh = 4, strategy_mesh(rules, explicit=True)
    batches = Batches(encode(arithmetic_text(2000)), batch_size=32, length=32)
    runs, reduced = {}, {}
    for name, grads_fn in (("per micro-batch", None), ("per step", unreduced_grads)):
        run = Trainer.create(create(TINY), adamw(), rules, mesh, micro_batches=m, grads_fn=grads_fn)
        report = collectives(run.compile(run.batch(batches))).without_flags()
        reduced[name] = report.array_bytes("all-reduce") + report.array_bytes("reduce-scatter")
        runs[name] = run.train(batches, STEPS)
    p = 4 * sum(x.size for x in jax.tree.leaves(nnx.state(create(TINY), nnx.Param)))
    assert reduced["per step"] == p + 4 * m
    setup = costs.Setup.of(rules, dict(mesh.shape), m, reduce_once=True)
    sizes = costs.sizes_of(TINY, setup, 32, 32)
    priced = costs.step_cost(TINY, setup, "H100", 32, 32).collectives
    grads = [c for c in priced if c.transfer.what == "gradients"]
    assert sum(c.array_bytes * c.transfer.passes(sizes) for c in grads) == p  # the cost model
    assert (m - 1) * p < reduced["per micro-batch"] <= m * p + 4 * m
    np.testing.assert_allclose(runs["per step"], runs["per micro-batch"], rtol=0, atol=1e-5)


def test_unreduced_gradients_need_explicit_axes() -> None:
    run = Trainer.create(create(TINY), adamw(), DP, strategy_mesh(DP), grads_fn=unreduced_grads)
    with pytest.raises(AxisTypeError, match="explicit=True"):
        run.train(BATCHES, 1)


@pytest.mark.parametrize("factory", [True, False], ids=["created in shards", "from a module"])
def test_a_trainer_resolves_its_rules_once(factory: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One pass over the train state places every array and, where a rule set places
    gradients apart from parameters (ZeRO-2), every gradient: the same specs a separate
    resolution for the gradients' role gives."""
    from nnxscale.placement import layout
    from nnxscale.placement.catalogue import ZERO2

    made = []
    original = layout.Layout.__init__
    monkeypatch.setattr(
        layout.Layout, "__init__", lambda self, *a, **k: made.append(original(self, *a, **k))
    )
    for rules in (FSDP, ZERO2):
        made.clear()
        model = (lambda: create(TINY)) if factory else create(TINY)
        trainer = Trainer.create(model, adamw(), rules, strategy_mesh(rules))
        assert len(made) == 1, rules.name
    params = nnx.state(trainer.model(), nnx.Param)
    apart = layout.resolve(params, ZERO2, trainer.layout.mesh, role="grads").shardings()
    read = trainer.layout.gradient_shardings(params, prefix="model/")
    assert jax.tree.map(lambda s: s.spec, read) == jax.tree.map(lambda s: s.spec, apart)
    assert any(s.spec != P() for s in jax.tree.leaves(read))  # ZeRO-2 splits the gradients
    assert (
        trainer.layout.gradient_specs
        and not layout.resolve(params, FSDP, trainer.layout.mesh).gradient_specs
    )
