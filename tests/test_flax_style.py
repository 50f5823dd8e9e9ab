"""Models written in today's Flax style: Explicit mesh axes, `out_sharding=` on every einsum,
grouped-query attention with QK-norm; Flax's own sharding metadata and rules; tensor
parallelism for a model without annotations from proposed names; replication that is never
silent; and the agreement criterion, which a wrong strategy fails."""

from __future__ import annotations

import dataclasses
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import nnxscale as nx

from conftest import run_python

F, T = "fsdp", "tensor"


@dataclasses.dataclass(frozen=True)
class GQAConfig:
    vocab: int = 64
    width: int = 32
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    hidden: int = 64
    layers: int = 1
    explicit: bool = True  # mesh axis names on weights and out_sharding= on einsums
    dtype: type = jnp.float32


class Block(nnx.Module):
    def __init__(self, cfg: GQAConfig, rngs: nnx.Rngs) -> None:
        d, h, k, e, f = cfg.width, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.hidden

        def param(shape, names, fan_in):
            value = jax.random.normal(rngs.params(), shape) / np.sqrt(fan_in)
            return nnx.Param(value, out_sharding=names if cfg.explicit else None)

        self.spec = (lambda *a: P(*a)) if cfg.explicit else (lambda *a: None)
        self.q = param((d, h, e), (F, T, None), d)
        self.k = param((d, k, e), (F, T, None), d)
        self.v = param((d, k, e), (F, T, None), d)
        self.o = param((h, e, d), (T, None, F), h * e)
        self.up = param((d, f), (F, T), d)
        self.down = param((f, d), (T, F), f)
        self.q_norm, self.k_norm = nnx.RMSNorm(e, rngs=rngs), nnx.RMSNorm(e, rngs=rngs)
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, s, _ = x.shape
        heads, spec = self.spec(F, None, T, None), self.spec
        y = self.norm1(x)
        q = self.q_norm(jnp.einsum("bsd,dhe->bshe", y, self.q[...], out_sharding=heads))
        k = self.k_norm(jnp.einsum("bsd,dke->bske", y, self.k[...], out_sharding=heads))
        v = jnp.einsum("bsd,dke->bske", y, self.v[...], out_sharding=heads)
        grouped = spec(F, None, T, None, None)
        q = q.reshape(b, s, k.shape[2], -1, q.shape[-1], out_sharding=grouped)
        scores = jnp.einsum("bskge,btke->bkgst", q, k, out_sharding=spec(F, T, None, None, None))
        causal = jnp.tril(jnp.ones((s, s), bool))
        weights = jax.nn.softmax(jnp.where(causal, scores / np.sqrt(q.shape[-1]), -1e30))
        att = jnp.einsum("bkgst,btke->bskge", weights, v, out_sharding=grouped)
        att = att.reshape(b, s, -1, att.shape[-1], out_sharding=heads)
        x = x + jnp.einsum("bshe,hed->bsd", att, self.o[...], out_sharding=spec(F, None, None))
        up = jnp.einsum("bsd,df->bsf", self.norm2(x), self.up[...], out_sharding=spec(F, None, T))
        down = jnp.einsum("bsf,fd->bsd", jax.nn.gelu(up), self.down[...], out_sharding=spec(F))
        return x + down


class GQATransformer(nnx.Module):
    def __init__(self, cfg: GQAConfig, *, rngs: nnx.Rngs) -> None:
        names = (lambda *a: a) if cfg.explicit else (lambda *a: None)
        self.cfg = cfg
        self.embed = nnx.Param(
            jax.random.normal(rngs.params(), (cfg.vocab, cfg.width)), out_sharding=names(T, F)
        )
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = nnx.RMSNorm(cfg.width, rngs=rngs)
        head = jax.random.normal(rngs.params(), (cfg.width, cfg.vocab)) / np.sqrt(cfg.width)
        self.head = nnx.Param(head, out_sharding=names(F, T))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        spec = P(F, None, None) if self.cfg.explicit else None
        x = self.embed[...].at[tokens].get(out_sharding=spec)
        for block in self.blocks:
            x = block(x)
        return jnp.einsum("bsd,dv->bsv", self.norm(x), self.head[...], out_sharding=spec)


def lm_loss(model: GQATransformer, batch: dict, rngs: nnx.Rngs | None) -> jax.Array:
    tokens = batch["tokens"]
    logp = jax.nn.log_softmax(model(tokens[:, :-1]))
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))


EXPLICIT, PLAIN = GQAConfig(), GQAConfig(explicit=False)
TOKENS = np.random.default_rng(0).integers(0, 64, (16, 9)).astype(np.int32)


def batches(step: int, sharding: object) -> dict:
    return {"tokens": TOKENS}


def make(cfg: GQAConfig = EXPLICIT):
    return lambda: GQATransformer(cfg, rngs=nnx.Rngs(0))


def explicit_mesh(shape: tuple[int, int]) -> jax.sharding.Mesh:
    devices = jax.devices()[: shape[0] * shape[1]]
    return nx.make_mesh(shape, (F, T), explicit=True, devices=devices)


# 1. both axis types


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(8, 1), (1, 2), (4, 2)], ids=["FSDP", "TP", "FSDP+TP"])
def test_an_explicit_model_trains_under_every_strategy_as_one_device(shape) -> None:
    mesh = explicit_mesh(shape)
    result = nx.agreement(make(), nx.mesh_axis_rules(mesh), mesh, batches, loss_fn=lm_loss)
    assert result.check().loss_ulps <= nx.agree.LOSS_ULPS
    assert result.losses[-1] < result.losses[0]


def test_a_model_for_explicit_axes_on_auto_axes_is_refused_before_its_step() -> None:
    rules = nx.mesh_axis_rules((F, T), sizes=(4, 2))
    trainer = nx.Trainer.create(make(), nx.adamw(), rules, nx.strategy_mesh(rules), loss_fn=lm_loss)
    with pytest.raises(nx.mesh.AxisTypeError, match=r"explicit=True.*JAX said: PartitionSpec"):
        trainer.train(batches, 1)
    trainer.check_state()  # traced, never run: the state is all there
    assert trainer.step_count() == 0


@pytest.mark.slow
def test_a_model_for_auto_axes_on_explicit_axes_is_refused() -> None:
    fsdp = nx.auto_fsdp(F)
    mesh = nx.strategy_mesh(fsdp, explicit=True)
    trainer = nx.Trainer.create(make(PLAIN), nx.adamw(), fsdp, mesh, loss_fn=lm_loss)
    with pytest.raises(nx.mesh.AxisTypeError, match=r"Explicit.*Auto axes.*out_sharding="):
        trainer.train(batches, 1)
    trainer.check_state()
    # a model that declares its axis type is refused at create

    class AutoOnly(nnx.Module):
        AXIS_TYPE = "auto"

        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones((8, 8)))

    with pytest.raises(nx.mesh.AxisTypeError, match="written for Auto mesh axes"):
        nx.Trainer.create(AutoOnly(), nx.adamw(), fsdp, mesh, loss_fn=lm_loss)
    # the same unannotated model trains on Auto axes
    auto = nx.Trainer.create(make(PLAIN), nx.adamw(), fsdp, nx.strategy_mesh(fsdp), loss_fn=lm_loss)
    assert len(auto.train(batches, 1)) == 1


def test_a_constraint_on_explicit_axes_is_named_as_such() -> None:
    class Constrained(nnx.Module):
        def __init__(self) -> None:
            self.w = nnx.Param(jnp.ones((8, 8)))

        def __call__(self, x: jax.Array) -> jax.Array:
            return jax.lax.with_sharding_constraint(x @ self.w[...], P(None, F))

    def mse(model, batch, rngs):
        return jnp.mean(model(batch["x"]) ** 2)

    mesh = explicit_mesh((8, 1))
    rules = nx.mesh_axis_rules(mesh)
    trainer = nx.Trainer.create(Constrained, nx.adamw(), rules, mesh, loss_fn=mse)
    with pytest.raises(nx.mesh.AxisTypeError, match=r"with_sharding_constraint.*Auto axes"):
        trainer.train(lambda step, sharding: {"x": np.ones((8, 8), np.float32)}, 1)


def test_a_mesh_of_mixed_axis_types_is_refused() -> None:
    mesh = jax.make_mesh(
        (4, 2),
        (F, T),
        axis_types=(jax.sharding.AxisType.Explicit, jax.sharding.AxisType.Auto),
    )
    with pytest.raises(ValueError, match="all Auto or all Explicit"):
        nx.init_sharded(make(), nx.mesh_axis_rules(mesh), mesh)


@pytest.mark.slow
def test_explicit_meshes_initialise_checkpoint_and_restore_onto_other_rules(tmp_path) -> None:
    mesh = explicit_mesh((4, 2))
    model, layout = nx.init_sharded(make(), nx.mesh_axis_rules(mesh), mesh)
    assert model.blocks[0].q.sharding.spec == P(F, T, None) == layout["blocks/0/q"].spec
    assert nx.mesh.axis_kind(model.blocks[0].q.sharding.mesh) == "explicit"
    with nnx.use_eager_sharding(False):
        host = make()()  # made on one device, as without the library
    copied, _ = nx.shard(host, nx.mesh_axis_rules(mesh), mesh)
    assert copied.blocks[0].q.sharding == model.blocks[0].q.sharding
    assert nx.trees.largest_difference(nnx.state(copied), nnx.state(host)) == 0.0
    trainer = nx.Trainer.create(
        make(), nx.adamw(), nx.mesh_axis_rules(mesh), mesh, loss_fn=lm_loss, config=EXPLICIT
    )
    trainer.train(batches, 2)
    with nx.Checkpoints(tmp_path) as checkpoints:
        checkpoints.save(trainer)
        checkpoints.wait()
        record = checkpoints.record().config
        assert record["dtype"] == "float32" and record["heads"] == 4  # a dataclass, recorded
        # tensor parallelism alone: the weights whole along `fsdp`, the batch too
        other = nx.Rules("TP alone", {F: (), T: (T,), "batch": ()}, axes=(F, T), sizes=(1, 2))
        smaller = explicit_mesh((1, 2))

        def rebuild(config: dict) -> GQATransformer:
            cfg = GQAConfig(**{**config, "dtype": jnp.dtype(config["dtype"]).type})
            return GQATransformer(cfg, rngs=nnx.Rngs(0))

        restored = checkpoints.restore(rebuild, nx.adamw(), other, smaller, loss_fn=lm_loss)
    assert nx.trees.largest_difference(restored.state, trainer.state) == 0.0
    assert dict(restored.layout.mesh.shape) == {F: 1, T: 2}
    assert restored.layout["model/blocks/0/q"].spec == P(None, T, None)
    after = restored.train(batches, 1), trainer.train(batches, 1)
    assert np.allclose(*after, rtol=0, atol=16 * np.spacing(np.float32(after[1][0])))


# 2. Flax's own metadata and rules


def test_flax_sharding_rules_metadata_and_context_are_read() -> None:
    mesh = nx.make_mesh((4, 2), ("data", "model"))

    def create() -> nnx.Module:
        init = nnx.initializers.lecun_normal()
        model = nnx.Module()
        model.w = nnx.Param(
            init(jax.random.key(0), (16, 8)),
            out_sharding=("embed", "hidden"),
            sharding_rules=(("embed", "data"), ("hidden", "model")),
        )
        model.u = nnx.Linear(
            8, 6, rngs=nnx.Rngs(0), kernel_init=nnx.with_partitioning(init, ("hidden", "out"))
        )
        return model

    base = nx.Rules("base", {"out": ("data",), "hidden": ()})
    layout = nx.resolve(nx.abstract(create), base, mesh)
    assert layout["w"].spec == P("data", "model")  # the variable's own rules
    assert layout["u/kernel"].spec == P(None, None)  # base: hidden whole; out=6 on data=4 no
    with nnx.logical_axis_rules((("hidden", "model"), ("out", None))):
        layout = nx.resolve(nx.abstract(create), base, mesh)
    assert layout["u/kernel"].spec == P("model", None)
    # Flax's rule first, the rule set's candidates as fallbacks
    layered = nx.annotations.flax_rules(
        [("out", "model")], nx.Rules("x", {"out": ("data",), "hidden": ()})
    )
    assert layered.logical["out"] == (("model",), "data") and layered.name == "Flax rules over x"
    assert nx.resolve(nx.abstract(create), layered, mesh)["u/kernel"].spec == P(None, "model")
    odd = nx.annotations.flax_rules(
        [("out", "data")], nx.Rules("y", {"out": ("model",), "hidden": ()})
    )
    assert nx.resolve(nx.abstract(create), odd, mesh)["u/kernel"].spec == P(None, "model")
    with (
        pytest.raises(nx.rules.RuleError, match="lacks"),
        nnx.logical_axis_rules((("out", "nowhere"),)),
    ):
        nx.resolve(nx.abstract(create), base, mesh)


def test_flax_rules_build_a_rule_set_with_its_mesh_and_batch() -> None:
    rules = nx.annotations.flax_rules([("embed", "fsdp"), ("mlp", "tensor"), ("vocab", None)])
    assert rules.axes == ("fsdp", "tensor") and rules.logical["batch"] == ("fsdp",)
    assert rules.logical["vocab"] == ()
    # a name's rules in Flax's order, then the base's; a None after them stops the list
    ordered = nx.annotations.flax_rules(
        [("mlp", "model"), ("mlp", "data"), ("heads", "model"), ("heads", None)], nx.FSDP_TP
    )
    assert ordered.logical["mlp"] == (("model",), ("data",))
    assert ordered.logical["heads"] == (("model",),)
    with pytest.raises(nx.rules.RuleError, match="no mesh axes given"):
        nx.annotations.flax_rules([("vocab", None)])


def test_mesh_axis_rules_infer_the_batch_axis_or_say_which_to_name() -> None:
    assert nx.mesh_axis_rules((F, T)).logical["batch"] == (F,)
    assert nx.mesh_axis_rules(explicit_mesh((4, 2))).sizes == (4, 2)
    with pytest.raises(nx.rules.RuleError, match=r"batch='x'"):
        nx.mesh_axis_rules(("x", "y"))
    with pytest.raises(nx.rules.RuleError, match=r"not among the mesh axes.*batch='fsdp'"):
        nx.mesh_axis_rules((F, T), batch="data")
    assert nx.mesh_axis_rules(("x", "y"), batch=None).logical["batch"] == ()


def test_flax_abstract_model_agrees_with_the_layout() -> None:
    mesh = explicit_mesh((4, 2))
    _, abstract_state = nnx.get_abstract_model(make(), mesh)
    layout = nx.resolve(nx.abstract(make()), nx.mesh_axis_rules(mesh), mesh)
    for path, x in nx.trees.flat(abstract_state):
        flax_spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        assert flax_spec == tuple(layout[path].spec), path


# 3. tensor parallelism for a model without annotations


@pytest.mark.slow
def test_proposed_names_give_tensor_parallelism_to_an_unannotated_model() -> None:
    proposal = nx.naming.propose(make(PLAIN))
    names = proposal.names()
    assert names["blocks/0/q"] == ("embed", "heads", "head_dim")
    assert names["blocks/0/k"] == names["blocks/0/v"] == ("embed", "kv_heads", "head_dim")
    assert names["blocks/0/o"] == ("heads", "head_dim", "embed")
    assert names["blocks/0/up"] == ("embed", "mlp") and names["blocks/0/down"] == ("mlp", "embed")
    assert names["embed"] == ("vocab", "embed") and names["head"] == ("embed", "vocab")
    assert names["blocks/0/q_norm/scale"] == (None,) and names["norm/scale"] == ("embed",)
    assert "heads" in str(proposal.table())
    tp = proposal.rules(nx.TP)
    mesh = nx.strategy_mesh(tp)
    layout = nx.resolve(nx.abstract(make(PLAIN)), tp, mesh)
    assert layout["blocks/0/k"].spec == P(None, "model", None)
    assert layout["blocks/0/up"].spec == P(None, "model")
    with warnings.catch_warnings():
        warnings.simplefilter("error", nx.layout.ReplicationWarning)  # the state splits too
        result = nx.agreement(make(PLAIN), tp, mesh, batches, loss_fn=lm_loss).check()
    assert result.share < 0.75, result  # heads, kv heads, mlp and vocab split in two
    edited = proposal.edit("blocks/0/up", ("embed", None))
    assert nx.resolve(nx.abstract(make(PLAIN)), edited.rules(nx.TP), mesh)["blocks/0/up"].spec == P(
        None, None
    )
    odd_name = proposal.edit("blocks/0/up", ("embed", "hidden_units"))  # any name: edit
    with pytest.raises(nx.rules.RuleError, match=r"no rule for the names \['hidden_units'\]"):
        odd_name.rules(nx.TP)
    own = nx.TP.replace(logical={**nx.TP.logical, "hidden_units": ("model",)})
    assert odd_name.rules(own).logical["hidden_units"] == ("model",)
    with pytest.raises(nx.rules.RuleError, match="2 names"):
        proposal.edit("blocks/0/q", ("embed", "heads"))
    # the base rule set's own path rules stay beside the proposal's
    based = proposal.rules(nx.TP.replace(paths=((r"(^|/)extra$", ("embed",)),)))
    assert based.names_for_path("model/extra") == ("embed",)
    assert based.names_for_path("ema/blocks/0/q") == ("embed", "heads", "head_dim")


def test_proposals_read_shapes_as_well_as_paths() -> None:
    shapes = {
        "tok_embed": (256, 32),
        "pos_embed": (16, 32),  # shorter than the vocabulary
        "layer/attn/q_einsum": (4, 32, 8),  # Gemma's order: heads, width, head_dim
        "layer/attn/kv_einsum": (2, 2, 32, 8),
        "layer/attn/attn_vec_einsum": (4, 8, 32),
        "layer/mlp/gate_proj": (32, 64),
        "layer/mlp/down_proj": (64, 32),
        "layer/router": (32, 4),
        "lm_head": (32, 256),
        "final_norm/scale": (32,),
    }

    def create() -> nnx.Module:
        model = nnx.Module()
        for path, shape in shapes.items():
            setattr(model, path.replace("/", "__"), nnx.Param(jnp.zeros(shape)))
        return model

    names = {path.replace("__", "/"): n for path, n in nx.naming.propose(create).names().items()}
    assert names["tok_embed"] == ("vocab", "embed") and names["pos_embed"] == (None, "embed")
    assert names["layer/attn/q_einsum"] == ("heads", "embed", "head_dim")
    assert names["layer/attn/kv_einsum"] == (None, "kv_heads", "embed", "head_dim")
    assert names["layer/attn/attn_vec_einsum"] == ("heads", "head_dim", "embed")
    assert names["layer/mlp/gate_proj"] == ("embed", "mlp")
    assert names["layer/mlp/down_proj"] == ("mlp", "embed")
    assert names["layer/router"] == ("embed", None)  # not an MLP: left for the reader
    assert names["lm_head"] == ("embed", "vocab") and names["final_norm/scale"] == ("embed",)


def test_path_rules_take_the_longest_match_and_refuse_a_tie() -> None:
    rules = nx.Rules(
        "r",
        {"embed": ("data",), "head_dim": ()},
        paths=((r"norm/scale$", ("embed",)), (r"_query_norm/scale$", ("head_dim",))),
    )
    assert rules.names_for_path("attn/_query_norm/scale") == ("head_dim",)
    assert rules.names_for_path("final_norm/scale") == ("embed",)
    tie = rules.replace(paths=((r"a/b$", ("embed",)), (r"^x/a", ("head_dim",))))
    with pytest.raises(nx.rules.RuleError, match="disagree"):
        tie.names_for_path("x/a/b")


def test_the_vocabulary_names_every_logical_axis_of_the_book() -> None:
    used = {name for rules in nx.catalogue.STRATEGIES.values() for name in rules.logical}
    assert used <= set(nx.naming.VOCABULARY), used - set(nx.naming.VOCABULARY)
    assert set(nx.naming.VOCABULARY) - used == set()


# 4. replication is never silent


def test_heads_that_do_not_divide_are_listed_and_strict_refuses() -> None:
    mesh = nx.make_mesh((2, 4), ("data", "model"))
    tp = nx.naming.propose(make(PLAIN)).rules(nx.TP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nx.layout.ReplicationWarning)
        layout = nx.resolve(nx.abstract(make(PLAIN)), tp, mesh)
    unsplit = {p.path: p.reason for p in layout.unsplit()}
    assert "blocks/0/k" in unsplit and "model (4) does not divide it" in unsplit["blocks/0/k"]
    assert layout["blocks/0/q"].spec == P(None, "model", None)  # 4 heads do divide
    with pytest.raises(nx.rules.RuleError, match="kv_heads=2 cannot be split"):
        nx.resolve(nx.abstract(make(PLAIN)), tp.replace(strict=True), mesh)


def test_a_model_asking_for_a_split_the_mesh_cannot_make_is_told_which_arrays() -> None:
    mesh = explicit_mesh((2, 4))  # 2 key/value heads on tensor = 4
    rules = nx.mesh_axis_rules(mesh)
    # said when placed, whatever the arrays' size (these are 2 KiB)
    with pytest.warns(nx.layout.ReplicationWarning, match=r"cannot split 8 arrays as their names"):
        trainer = nx.Trainer.create(make(), nx.adamw(), rules, mesh, loss_fn=lm_loss)
    assert {"model/blocks/0/k", "model/blocks/0/v"} <= {p.path for p in trainer.layout.unsplit()}
    with pytest.raises(ValueError, match=r"cannot make.*model/blocks/0/k \(32, 2, 8\)") as error:
        trainer.train(batches, 1)
    # only the arrays kept whole for this reason: not the unnamed norm scales
    assert "norm" not in str(error.value) and "no logical names" not in str(error.value)
    trainer.check_state()


def test_a_model_annotated_for_another_mesh_is_told_the_rules_of_its_own_names() -> None:
    mesh = nx.make_mesh((2, 4), ("data", "model"))
    with pytest.raises(
        nx.rules.RuleError, match=r"mesh axes 'fsdp' \(first at .*'tensor'"
    ) as error:
        nx.resolve(nx.abstract(make()), nx.mesh_axis_rules(("data", "model")), mesh)
    fixes = (
        "nx.mesh_axis_rules(('fsdp', 'tensor'))",
        "nx.annotations.flax_rules([('fsdp', 'data'), ('tensor', 'model')], "
        "axes=('data', 'model'))",
    )
    assert all(fix in str(error.value) for fix in fixes)
    pairs = [(F, "data"), (T, "model")]
    layout = nx.resolve(
        nx.abstract(make()), nx.annotations.flax_rules(pairs, axes=("data", "model")), mesh
    )
    assert layout["blocks/0/q"].spec == P("data", "model", None)


def test_rules_that_split_nothing_of_a_model_say_so() -> None:
    with pytest.warns(nx.layout.ReplicationWarning, match="no logical names"):
        layout = nx.resolve(nx.abstract(make(PLAIN)), nx.TP, nx.strategy_mesh(nx.TP))
    assert layout.replicated_bytes() == layout.total_bytes()
    assert {p.path for p in layout.unsplit()} == {p.path for p in layout.placements}


REPLICATION = textwrap.dedent(
    """
    import warnings
    import jax, nnxscale as nx
    nx.emulate_devices({n})
    warnings.simplefilter("ignore")
    model = nx.abstract(lambda: nx.create(nx.TINY))
    for rules in (nx.DP, nx.FSDP, nx.TP, nx.FSDP_TP, nx.auto_fsdp(annotations="ignore")):
        layout = nx.resolve(model, rules, nx.strategy_mesh(rules))
        whole = layout.replicated()
        assert layout.replicated_bytes() == sum(p.total_bytes for p in whole), rules.name
        assert all(p.pieces == 1 for p in whole)
        for p in layout.unsplit():
            assert p.reason, (rules.name, p.path)
        if rules is nx.TP and dict(layout.mesh.shape)["model"] == 1:
            assert layout.unsplit() and all("one device" in p.reason for p in layout.unsplit())
    print("ok", {n})
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("devices", [1, 2, 3, 4, 6, 8])
def test_replicated_bytes_and_replicated_agree_at_any_count(devices: int) -> None:
    done = run_python(REPLICATION.format(n=devices))
    assert f"ok {devices}" in done.text, done.text[-3000:]


# 5. the agreement criterion


@pytest.mark.slow
def test_a_missing_gradient_reduction_fails_the_agreement() -> None:
    mesh = nx.strategy_mesh(nx.DP)

    def local_grads(model, batch, key, micro_batches):
        """Each device's gradient of its own rows, never summed over `data`: wrong."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def local(params, tokens):
            loss, grads = jax.value_and_grad(
                lambda p: lm_loss(nnx.merge(graphdef, p, rest), {"tokens": tokens}, None)
            )(params)
            return loss, grads

        specs = jax.tree.map(lambda _: P(), params)
        return jax.shard_map(  # on the mesh the step is traced under
            local,
            in_specs=(specs, P("data")),
            out_specs=(P(), specs),
            check_vma=False,
        )(params, batch["tokens"])

    wrong = nx.agreement(make(PLAIN), nx.DP, mesh, batches, grads_fn=local_grads)
    assert not wrong.ok and wrong.weight_gap > 100 * nx.agree.WEIGHT_GAP, wrong
    with pytest.raises(AssertionError, match="does not train as one device does"):
        wrong.check()
    right = nx.agreement(make(PLAIN), nx.DP, mesh, batches, loss_fn=lm_loss)
    assert right.ok and wrong.weight_gap > 1000 * right.weight_gap, (right, wrong)


def test_agreement_holds_over_more_steps_under_automatic_fsdp() -> None:
    mesh = nx.strategy_mesh(nx.FSDP)
    result = nx.agreement(make(PLAIN), nx.auto_fsdp(), mesh, batches, loss_fn=lm_loss, steps=5)
    assert result.check().weight_gap < nx.agree.WEIGHT_GAP


# 6. clear errors early


def test_a_model_without_the_books_interface_needs_a_loss_at_create() -> None:
    mesh = explicit_mesh((8, 1))
    with pytest.raises(TypeError, match=r"no loss_fn given.*GQATransformer lacks"):
        nx.Trainer.create(make(), nx.adamw(), nx.mesh_axis_rules(mesh), mesh)


def test_configs_may_be_any_dataclass_or_carry_their_own_record() -> None:
    assert nx.train.config_record(EXPLICIT)["dtype"] == "float32"

    @dataclasses.dataclass
    class Opaque:
        act: object = jax.nn.gelu

        def to_config(self) -> dict:
            return {"act": "gelu"}

    assert nx.train.config_record(Opaque()) == {"act": "gelu"}

    @dataclasses.dataclass
    class Bare:
        act: object = jax.nn.gelu

    with pytest.raises(TypeError, match="to_config"):
        nx.train.config_record(Bare())
