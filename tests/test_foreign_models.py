"""The public API on models the library was not written for: an NNX module annotated with mesh
axis names (as the Flax guide annotates), a raw pytree of arrays, and malformed inputs."""

from __future__ import annotations

import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnxscale as nx

DEPTH = 32
TP = nx.mesh_axis_rules(("data", "model"), sizes=(-1, 2))
BOTH = nx.auto_fsdp("data", annotations="fill", logical=TP)


class Annotated(nnx.Module):
    """The Flax guide's DotReluDot: mesh axis names on the weights, a constraint inside."""

    def __init__(self, depth: int = DEPTH, *, rngs: nnx.Rngs) -> None:
        init = nnx.initializers.lecun_normal()
        self.dot1 = nnx.Linear(
            depth,
            depth,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(init, (None, "model")),
            bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("model",)),
        )
        self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=("model", None))
        self.dropout = nnx.Dropout(0.1)

    def __call__(self, x: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        y = jax.lax.with_sharding_constraint(jax.nn.relu(self.dot1(x)), P("data", "model"))
        return self.dropout(y, deterministic=rngs is None, rngs=rngs) @ self.w2[...]


def make_annotated() -> Annotated:
    return Annotated(rngs=nnx.Rngs(0))


def mse(model: nnx.Module, batch: dict, rngs: nnx.Rngs | None) -> jax.Array:
    return jnp.mean((model(batch["x"], rngs) - batch["y"]) ** 2)


X = np.random.default_rng(0).normal(size=(16, DEPTH)).astype(np.float32)
BATCH = {"x": X, "y": np.sin(X @ np.eye(DEPTH, dtype=np.float32)[::-1])}


def batches(step: int, sharding: object) -> dict:
    return BATCH


def init_mlp(key: jax.Array, sizes: tuple[int, ...] = (DEPTH, 64, DEPTH)) -> dict:
    keys = jax.random.split(key, len(sizes) - 1)
    return {
        "layers": [
            {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
            for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
        ]
    }


def apply_mlp(params: dict, x: jax.Array) -> jax.Array:
    *hidden, last = params["layers"]
    for layer in hidden:
        x = jax.nn.gelu(x @ layer["w"] + layer["b"])
    return x @ last["w"] + last["b"]


def mlp_loss(model: nx.params.Params, batch: dict, rngs: nnx.Rngs | None) -> jax.Array:
    return jnp.mean((apply_mlp(model.arrays(), batch["x"]) - batch["y"]) ** 2)


def make_mlp() -> nx.params.Params:
    return nx.params.Params(init_mlp(jax.random.key(0)))


def test_mesh_axis_rules_follow_the_annotations() -> None:
    model, layout = nx.init_sharded(make_annotated, TP, nx.strategy_mesh(TP))
    assert layout["dot1/kernel"].spec == P(None, "model")
    assert layout["dot1/bias"].spec == P("model")
    assert layout["w2"].spec == P("model", None)
    assert model.w2.sharding.spec == P("model", None)


def test_annotations_use_ignore_and_fill() -> None:
    mesh = nx.strategy_mesh(BOTH)
    tree = nnx.state(nx.abstract(make_annotated))
    with pytest.raises(nx.rules.RuleError, match="mesh_axis_rules"):
        nx.resolve(tree, nx.auto_fsdp("data"), mesh)  # 'model' has no rule, and says the fix
    ignored = nx.resolve(tree, nx.auto_fsdp("data", annotations="ignore", logical=TP), mesh)
    assert ignored["w2"].spec == P("data", None)  # the largest dimension, annotations unused
    filled = nx.resolve(tree, BOTH, mesh)
    assert filled["w2"].spec == P("model", "data")
    assert filled["dot1/kernel"].spec == P("data", "model")
    assert filled["dot1/bias"].spec == P("model")  # nothing whole is left to fill
    assert "fill" in filled["w2"].reason
    bias = 4 * DEPTH  # bytes of the one array split in 2 only (over `model`)
    assert filled.bytes_per_device() == (filled.total_bytes() - bias) // 8 + bias // 2


def test_strict_is_honoured_by_the_automatic_axis() -> None:
    mesh = nx.make_mesh((8,), ("data",))
    odd = {"w": jnp.zeros((3, 5)), "step": jnp.zeros(())}
    layout = nx.resolve(odd, nx.auto_fsdp("data"), mesh)
    assert [p.path for p in layout.replicated()] == ["w", "step"]
    with pytest.raises(nx.rules.RuleError, match=r"w: no whole dimension of shape \(3, 5\)"):
        nx.resolve(odd, nx.auto_fsdp("data", strict=True), mesh)
    nx.resolve({"step": jnp.zeros(())}, nx.auto_fsdp("data", strict=True), mesh)  # scalars pass
    with pytest.raises(nx.rules.RuleError, match=r"no logical names.*strict"):
        nx.resolve(
            {"w": jnp.zeros((8, 8))}, nx.FSDP.replace(strict=True), nx.strategy_mesh(nx.FSDP)
        )


def test_a_large_array_left_whole_is_warned_about() -> None:
    mesh = nx.make_mesh((8,), ("data",))
    # b splits, so the rules split something: only the large array is warned about
    big = {"w": jax.ShapeDtypeStruct((1001, 1001), jnp.float32), "b": jnp.zeros(8)}
    with pytest.warns(
        nx.layout.ReplicationWarning, match=r"1 arrays of 4,008,004 bytes.*w \(1001, 1001\)"
    ):
        layout = nx.resolve(big, nx.auto_fsdp("data"), mesh)
    assert [p.path for p in layout.replicated(min_bytes=1 << 20)] == ["w"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nx.resolve(big, nx.DP, nx.strategy_mesh(nx.DP))  # replication DP asks for: no warning
        nx.resolve(big, nx.auto_fsdp("data"), mesh, warn_bytes=1 << 23)
    with pytest.warns(nx.layout.ReplicationWarning, match="no logical names"):
        unnamed = nx.resolve({"w": jnp.zeros((512, 512))}, nx.FSDP, nx.strategy_mesh(nx.FSDP))
    assert unnamed["w"].fallback  # FSDP meant to split it; it has no names and no auto axis


def test_init_sharded_and_shard_take_raw_pytrees() -> None:
    rules = nx.auto_fsdp()
    mesh = nx.strategy_mesh(rules)
    tree, layout = nx.init_sharded(lambda: init_mlp(jax.random.key(0)), rules, mesh)
    assert isinstance(tree, dict) and tree["layers"][0]["w"].sharding.spec == P(None, "data")
    assert layout["layers/0/b"].spec == P("data")
    host = init_mlp(jax.random.key(1))
    placed, again = nx.shard(host, rules, mesh)
    assert nx.trees.largest_difference(placed, host) == 0.0
    assert [p.spec for p in again.placements] == [p.spec for p in layout.placements]
    with jax.set_mesh(nx.strategy_mesh(TP)):  # Flax places annotated weights as it creates them
        module = make_annotated()
    state, _ = nx.shard(nnx.state(module), TP, nx.strategy_mesh(TP))
    assert isinstance(state, nnx.State) and state["w2"][...].sharding.spec == P("model", None)
    with pytest.raises(ValueError, match="holding no arrays"):
        nx.init_sharded(lambda: {"layers": []}, rules, mesh)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("make", "rules", "loss_fn"),
    [(make_annotated, BOTH, mse), (make_mlp, nx.auto_fsdp(), mlp_loss)],
    ids=["annotated-module", "raw-pytree"],
)
def test_foreign_models_train_like_one_device(make, rules, loss_fn) -> None:
    runs = {}
    for devices in (1, 8):
        mesh = nx.strategy_mesh(rules, devices)
        runs[devices] = nx.Trainer.create(make, nx.adamw(), rules, mesh, loss_fn=loss_fn)
    losses = {d: t.train(batches, 4) for d, t in runs.items()}
    assert losses[8][-1] < losses[8][0]
    ulp = float(np.spacing(np.float32(losses[1][0])))
    assert max(abs(a - b) for a, b in zip(losses[8], losses[1], strict=True)) <= 16 * ulp
    assert runs[8].layout.bytes_per_device() < runs[1].layout.bytes_per_device()
    # the weights: after SGD, where a gap in them is a gap in the gradients
    nx.agreement(make, rules, nx.strategy_mesh(rules), batches, loss_fn=loss_fn).check()


def test_a_concrete_module_is_placed_and_trained() -> None:
    mesh = nx.strategy_mesh(TP)
    with jax.set_mesh(mesh):  # as the Flax guide creates it: placed by its mesh axis names
        model = make_annotated()
    trainer = nx.Trainer.create(model, nx.adamw(), TP, mesh, loss_fn=mse)
    assert trainer.state["model"]["w2"][...].sharding.spec == P("model", None)
    assert trainer.state["ema"]["w2"][...].sharding.spec == P("model", None)
    assert len(trainer.train(batches, 2)) == 2
    assert trainer.config is None  # no `cfg` dataclass: nothing to record unless given


@pytest.mark.slow
def test_checkpoints_of_foreign_models_restore_on_another_mesh(tmp_path) -> None:
    grads = nx.train.loss_and_grads
    trainer = nx.Trainer.create(
        make_annotated,
        nx.adamw(),
        BOTH,
        nx.strategy_mesh(BOTH),
        loss_fn=mse,
        config={"depth": DEPTH},
    )
    trainer.train(batches, 2)
    mlp = nx.Trainer.create(
        make_mlp, nx.adamw(), nx.auto_fsdp(), nx.strategy_mesh(nx.auto_fsdp()), loss_fn=mlp_loss
    )
    mlp.train(batches, 1)
    with nx.Checkpoints(tmp_path / "dot") as checkpoints, nx.Checkpoints(tmp_path / "mlp") as raw:
        checkpoints.save(trainer)
        raw.save(mlp)
        checkpoints.wait()
        raw.wait()
        record = checkpoints.record()
        assert record.config == {"depth": DEPTH} and raw.record().config is None
        assert json.loads(json.dumps(record.config)) == record.config
        mesh = nx.strategy_mesh(TP, 4)

        def factory(config: dict) -> Annotated:
            return Annotated(config["depth"], rngs=nnx.Rngs(0))

        back = checkpoints.restore(factory, nx.adamw(), TP, mesh, grads_fn=grads)
        assert back.options.grads_fn is grads  # a custom gradient function survives the restore
        assert back.config == {"depth": DEPTH}
        again = raw.restore(
            nx.abstract(make_mlp),
            nx.adamw(),
            nx.auto_fsdp(),
            nx.strategy_mesh(nx.auto_fsdp(), 2),
            loss_fn=mlp_loss,
        )
    assert nx.trees.largest_difference(back.state, trainer.state) == 0.0
    assert back.layout.mesh.shape == {"data": 2, "model": 2}
    assert nx.trees.largest_difference(again.state, mlp.state) == 0.0
    assert again.train(batches, 1) == pytest.approx(mlp.train(batches, 1), abs=1e-6)


def test_the_step_is_traced_under_the_mesh() -> None:
    trainer = nx.Trainer.create(make_annotated, nx.adamw(), TP, nx.strategy_mesh(TP), loss_fn=mse)
    trainer.train(batches, 1)  # the model's with_sharding_constraint(P(...)) needs set_mesh
    assert np.isfinite(float(trainer.evaluate(trainer.state, trainer.place_batch(BATCH))))


def test_requirements_of_a_model_are_checked_up_front() -> None:
    mesh = nx.strategy_mesh(TP)
    with pytest.raises(TypeError, match="expected an NNX module"):
        nx.Trainer.create({"w": jnp.ones(3)}, nx.adamw(), TP, mesh)

    class Frozen(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.BatchStat(jnp.ones(3))

    with pytest.raises(ValueError, match=r"has no nnx\.Param"):
        nx.Trainer.create(Frozen(), nx.adamw(), TP, mesh)
    with pytest.raises(ValueError, match="loss_fn or grads_fn, not both"):
        nx.Trainer.create(make_annotated, nx.adamw(), TP, mesh, loss_fn=mse, grads_fn=mse)
    with pytest.raises(TypeError, match="cannot be written as JSON"):
        nx.Trainer.create(make_annotated, nx.adamw(), TP, mesh, loss_fn=mse, config={"f": len})
    with pytest.raises(TypeError, match="leaves are all arrays"):
        nx.params.Params({"name": "text"})


def test_requirements_of_a_batch_are_checked_up_front() -> None:
    trainer = nx.Trainer.create(make_annotated, nx.adamw(), TP, nx.strategy_mesh(TP), loss_fn=mse)

    def feed(batch):
        return trainer.train(lambda step, sharding: batch, 1)

    with pytest.raises(ValueError, match="holds no arrays"):
        feed({})
    with pytest.raises(ValueError, match=r"batch array 'scale' is .*first dimension"):
        feed({**BATCH, "scale": np.float32(2.0)})
    with pytest.raises(ValueError, match=r"different numbers of rows \[8, 16\]"):
        feed({"x": X, "y": BATCH["y"][:8]})
    with pytest.raises(ValueError, match="batch array 'x' of 6 rows cannot be split over the 4"):
        feed({"x": X[:6], "y": BATCH["y"][:6]})

    def vector_loss(model, batch, rngs):
        return (model(batch["x"], rngs) - batch["y"]) ** 2

    wrong = nx.Trainer.create(
        make_annotated, nx.adamw(), TP, nx.strategy_mesh(TP), loss_fn=vector_loss
    )
    with pytest.raises(ValueError, match="must return the mean loss, a scalar"):
        wrong.train(batches, 1)


def test_layout_prints_as_text() -> None:
    _, layout = nx.init_sharded(make_annotated, BOTH, nx.strategy_mesh(BOTH))
    text = str(layout)
    assert text.splitlines()[0].startswith("auto-FSDP(data) over mesh axes data/model on mesh")
    assert "w2 (32, 32) -> ('model', 'data') (16, 8)" in text


def test_every_strategy_of_the_table_builds_its_mesh() -> None:
    assert set(nx.catalogue.STRATEGIES) == {
        "DP",
        "ZeRO-1",
        "ZeRO-2",
        "FSDP",
        "TP",
        "FSDP+TP",
        "HSDP",
        "HSDP+TP",
        "PP",
        "PP+FSDP",
        "PP+FSDP+TP",
        "PP+TP",
        "TP+SP",
        "CP",
        "FSDP+CP",
        "FSDP+CP+TP",
        "PP+FSDP+CP+TP",
        "EP",
        "FSDP+EP",
        "PP+FSDP+EP",
        "FSDP+TP+SP",
        "ZeRO-1+TP",
        "PP+ZeRO-1+TP",
    }
    assert set(nx.RULE_SETS) == {"DP", "FSDP", "TP", "FSDP+TP"}
    shapes = {name: dict(nx.strategy_mesh(r).shape) for name, r in nx.catalogue.STRATEGIES.items()}
    assert shapes["TP"] == {"data": 4, "model": 2} and shapes["FSDP"] == {"data": 8, "model": 1}
    assert shapes["PP"] == {"stage": 8} and shapes["PP+FSDP"] == {"stage": 4, "fsdp": 2}
    assert shapes["HSDP"] == {"replica": 2, "data": 4} and shapes["ZeRO-1"] == shapes["FSDP"]
    assert shapes["CP"] == {"data": 1, "context": 8} and shapes["TP+SP"] == shapes["TP"]
    assert shapes["FSDP+CP"] == {"data": 4, "context": 2}
    assert shapes["PP+FSDP+EP"] == {"stage": 2, "fsdp": 2, "expert": 2}
    assert shapes["HSDP+TP"] == {"replica": 2, "data": 2, "model": 2}
    assert shapes["FSDP+CP+TP"] == {"data": 2, "context": 2, "model": 2}
    assert shapes["EP"] == {"data": 1, "expert": 8}
    assert shapes["PP+FSDP+TP"] == {"stage": 2, "fsdp": 2, "model": 2}
    assert shapes["PP+TP"] == {"stage": 4, "data": 1, "model": 2}
    assert shapes["PP+FSDP+CP+TP"] == {"stage": 1, "fsdp": 2, "context": 2, "model": 2}
    assert shapes["FSDP+EP"] == {"data": 2, "expert": 4}
    assert shapes["FSDP+TP+SP"] == shapes["ZeRO-1+TP"] == shapes["FSDP+TP"]
    assert shapes["PP+ZeRO-1+TP"] == shapes["PP+FSDP+TP"]
    assert dict(nx.strategy_mesh(nx.auto_fsdp("x")).shape) == {"x": 8}
    with pytest.raises(nx.rules.RuleError, match="at most one of them -1"):
        nx.Rules("bad", {}, axes=("a", "b"), sizes=(-1, -1))
    with pytest.raises(nx.rules.RuleError, match="at least 1"):
        nx.Rules("bad", {}, axes=("a", "b"), sizes=(0, -1))
    fixed = nx.Rules("fixed", {}, axes=("a", "b"), sizes=(2, 4))  # no -1: exactly 8 devices
    assert dict(nx.strategy_mesh(fixed).shape) == {"a": 2, "b": 4}
    with pytest.raises(nx.rules.RuleError, match=r"fixes its mesh at \{'a': 2, 'b': 4\}"):
        nx.strategy_mesh(fixed, 4)
    with pytest.raises(nx.rules.RuleError, match="lack"):
        nx.Rules("bad", {"embed": ("model",)}, axes=("data",), sizes=(-1,))
    with pytest.raises(nx.rules.RuleError, match="annotations='sometimes'"):
        nx.auto_fsdp(annotations="sometimes")
    with pytest.raises(ValueError, match="a mesh of 12 devices was asked for and JAX has 8"):
        nx.strategy_mesh(nx.TP, 12)
