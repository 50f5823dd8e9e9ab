"""The jitted train step: micro-batches, the loss, gradients where the rule set puts them, an
update applied only when finite, and evaluation."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.core.steered import Steered, steer
from nnxscale.core.trees import flat
from nnxscale.model.losses import GradsFn, LossFn, next_token_loss
from nnxscale.placement.compiling import run_under
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import Layout, ReplicationWarning, resolve
from nnxscale.placement.mesh import (
    AxisTypeError,
    axis_kind,
    constrain_to,
    partitions,
)
from nnxscale.placement.rules import Rules, strategy_mesh
from nnxscale.train.state import TrainOptions, adamw, params_by_path


def split_micro_batches(batch: Any, k: int) -> Any:
    """`batch` (any pytree of arrays) as k micro-batches stacked on a new leading axis.

    Micro-batch j takes rows j, j + k, j + 2k, ... so every device keeps contributing its own
    rows; the mean of the k micro-batch means is the mean over the batch.
    """

    for path, x in flat(batch):
        if x.shape[0] % k:
            where = f"batch array {path!r}" if path else "a batch"
            raise ValueError(
                f"{where} of {x.shape[0]} rows cannot be cut into {k} micro-batches: use a "
                f"batch size that is a multiple of {k}."
            )

    def split(x: jax.Array) -> jax.Array:
        moved = jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0)
        sharding = getattr(jax.typeof(x), "sharding", None)
        if sharding is None or not sharding.mesh.axis_names:  # no mesh: nothing is placed
            return moved
        if axis_kind(sharding.mesh) != "explicit":
            return moved
        # on Explicit axes the reshape may put the rows' axes on the micro-batch dimension
        # (a dimension of size 1 takes none), which a scan cannot step over: keep them on rows
        spec = P(None, *partitions(sharding.spec, x.ndim))
        return jax.sharding.reshard(moved, NamedSharding(sharding.mesh, spec))

    return jax.tree.map(split, batch)


DIFFERENTIATED = nnx.Any(nnx.Param, Steered)
"""What `loss_and_grads` differentiates: the parameters, and the model's `Steered` variables,
whose gradients are the statistics that move them (the dropless mixture's router biases)."""


def mean_loss(
    model: nnx.Module, loss_fn: LossFn, wrt: nnx.filterlib.Filter = nnx.Param
) -> Callable[..., jax.Array]:
    """`loss(params, batch, key)`: `loss_fn` of `model` with `params` (its `wrt` variables)
    and `key` for its dropout stream (`nnx.Rngs(dropout=key)`, or None without dropout),
    refused unless it is a scalar."""
    graphdef, _, rest = nnx.split(model, wrt, ...)

    def loss(params: nnx.State, batch: Any, key: jax.Array | None) -> jax.Array:
        rngs = None if key is None else nnx.Rngs(dropout=key)
        value = loss_fn(nnx.merge(graphdef, params, rest), batch, rngs)
        if jnp.shape(value) != ():
            raise ValueError(
                f"the loss function returned an array of shape {jnp.shape(value)}; it must "
                "return the mean loss, a scalar (e.g. end it with .mean())."
            )
        return value

    return loss


def summed_over_micro_batches(
    loss_and_grads_of: Callable[[Any, jax.Array | None], tuple[jax.Array, Any]],
    zero: tuple[jax.Array, Any],
    batch: Any,
    key: jax.Array | None,
    micro_batches: int,
) -> tuple[jax.Array, Any]:
    """The sums, from `zero`, of `loss_and_grads_of(micro_batch, key)` over `micro_batches`
    slices of `batch` in a `jax.lax.scan`, each with `key` folded with its index."""

    def accumulate(total, inputs):
        micro, index = inputs
        micro_key = None if key is None else jax.random.fold_in(key, index)
        return jax.tree.map(jnp.add, total, loss_and_grads_of(micro, micro_key)), None

    micro = split_micro_batches(batch, micro_batches)
    return jax.lax.scan(accumulate, zero, (micro, jnp.arange(micro_batches)))[0]


def loss_and_grads(
    model: nnx.Module,
    batch: Any,
    key: jax.Array | None,
    micro_batches: int = 1,
    *,
    loss_fn: LossFn = next_token_loss,
    grad_shardings: Any = None,
) -> tuple[jax.Array, nnx.State]:
    """Loss and parameter gradients of `loss_fn`, accumulated over `micro_batches` slices.

    The dropout stream is `key` (folded with the micro-batch index when there are several);
    `loss_fn` sees it as `nnx.Rngs(dropout=...)`, or None without dropout. `grad_shardings`,
    if given, is where each micro-batch's gradients and their running sum go (ZeRO-2 splits
    them while the parameters stay whole); otherwise the compiler places them.
    """
    params = nnx.state(model, DIFFERENTIATED)
    loss_of = mean_loss(model, loss_fn, DIFFERENTIATED)

    def place(grads: nnx.State) -> nnx.State:
        if grad_shardings is None:
            return grads
        weights = jax.tree.map(constrain_to, nnx.state(grads, nnx.Param), grad_shardings)
        return nnx.merge_state(weights, nnx.state(grads, Steered))

    def loss_and_grads_of(batch: Any, key: jax.Array | None) -> tuple[jax.Array, nnx.State]:
        loss, grads = jax.value_and_grad(loss_of)(params, batch, key)
        return loss, place(grads)

    if micro_batches == 1:
        return loss_and_grads_of(batch, key)
    zero = (jnp.zeros((), jnp.float32), place(jax.tree.map(jnp.zeros_like, params)))
    loss, grads = summed_over_micro_batches(loss_and_grads_of, zero, batch, key, micro_batches)
    return loss / micro_batches, jax.tree.map(lambda g: g / micro_batches, grads)


def unreduced_grads(
    model: nnx.Module,
    batch: Any,
    key: jax.Array | None,
    micro_batches: int = 1,
    *,
    loss_fn: LossFn = next_token_loss,
) -> tuple[jax.Array, nnx.State]:
    """`loss_and_grads`, with the gradients reduced once per step instead of once per
    micro-batch: on Explicit axes only, where a sharding can say "reduced".

    Every parameter is first read whole over the axes that split the batch, as the type
    `reduced` (`jax.reshard(w, P(..., reduced={"data"}))`): an all-gather for what FSDP splits,
    nothing for what DP replicates. A reduced value's gradient is *unreduced*: each device
    holds its own rows' partial sum, and autodiff sums nothing. The partial sums of the
    micro-batches add up in a carry of that type, and one reshard to each parameter's own
    layout at the end is the step's only gradient reduction (a reduce-scatter for FSDP, an
    all-reduce for DP), where `loss_and_grads` reduces inside the loop, once a micro-batch.
    The price is memory: whole weights and a whole gradient sum on every device for the
    step, as DP holds them.
    """
    params = nnx.state(model, nnx.Param)
    rows = jax.typeof(jax.tree.leaves(batch)[0]).sharding
    if axis_kind(rows.mesh) != "explicit":
        raise AxisTypeError(
            "unreduced gradients are a type, which JAX gives arrays on Explicit mesh axes only: "
            "build the mesh with nx.strategy_mesh(rules, explicit=True), or train with "
            "loss_and_grads (the default), which reduces once per micro-batch."
        )
    token_axes = set(partitions(rows.spec, 1)[0] or ())

    def whole(spec: P, ndim: int, **kinds: set[str]) -> P:
        kept = [
            tuple(a for a in (axes or ()) if a not in token_axes) or None
            for axes in partitions(spec, ndim)
        ]
        return P(*kept, **kinds)

    stored = jax.tree.map(lambda w: jax.typeof(w).sharding.spec, params)
    read = jax.tree.map(
        lambda w: jax.reshard(w, whole(jax.typeof(w).sharding.spec, w.ndim, reduced=token_axes)),
        params,
    )

    loss_of = mean_loss(model, loss_fn)

    def loss_and_grads_of(batch: Any, key: jax.Array | None) -> tuple[jax.Array, nnx.State]:
        return jax.value_and_grad(loss_of)(read, batch, key)

    def unreduced_zeros(w: jax.Array) -> jax.Array:
        spec = whole(jax.typeof(w).sharding.spec, w.ndim, unreduced=token_axes)
        return jax.reshard(jnp.zeros(w.shape, w.dtype), spec)

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(unreduced_zeros, params))
    loss, sums = summed_over_micro_batches(loss_and_grads_of, zero, batch, key, micro_batches)
    grads = jax.tree.map(lambda g, spec: jax.reshard(g, spec) / micro_batches, sums, stored)
    return loss / micro_batches, grads


def train_step(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    batch: Any,
    *,
    micro_batches: int = 1,
    dropout: bool = True,
    grads_fn: GradsFn = loss_and_grads,
) -> tuple[nnx.State, jax.Array]:
    """One optimizer step and EMA update on `batch`; returns the new state and the loss.

    When the loss, a gradient or the update the optimizer makes of them is not finite, the
    update is not applied: the weights, optimizer moments and EMA stay as they were, the step
    counter and the dropout stream move on (the batch is consumed), and the loss returned is
    NaN, so neither a bad batch nor a bad optimizer step turns the weights into NaN for good.
    The update is first computed only to be tested (the compiler fuses it into the test, so it
    is not stored), then applied under a `jax.lax.cond`: the step holds no second copy of the
    state.
    """
    ts = nnx.merge(graphdef, state)
    key = ts.rngs.dropout() if dropout else None
    loss, grads = grads_fn(ts.model, batch, key, micro_batches)
    counter = ts.optimizer.step[...]
    steered = bool(jax.tree.leaves(nnx.state(ts.model, Steered)))
    if steered and not jax.tree.leaves(nnx.state(grads, Steered)):
        names = sorted(
            {type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(ts.model, Steered))}
        )
        raise ValueError(
            f"the model's {', '.join(names)} variables (the router biases of Config.bias_rate "
            "in the book's model) move by statistics that the library's loss_and_grads returns "
            "as their gradients, and this gradient function returns none: train with the "
            "default gradients, or build the model without them: bias_rate=0."
        )

    def update(values: nnx.State) -> nnx.State:
        ts = nnx.merge(graphdef, values)
        ts.optimizer.update(ts.model, grads)
        if steered:
            steer(ts.model, grads)
        decay = ts.ema_decay
        for path, param in params_by_path(ts.model).items():
            ts.ema[path][...] = decay * ts.ema[path][...] + (1 - decay) * param[...]
        return nnx.state(ts)

    with jax.named_scope("optimizer"):  # names the update's ops in profiles
        weights = nnx.state(grads, nnx.Param)
        finite = all_finite(loss, weights, trial_update(ts.optimizer, ts.model, grads))
        values = jax.lax.cond(finite, update, lambda values: values, nnx.state(ts))
        ts = nnx.merge(graphdef, values)
        ts.optimizer.step[...] = counter + 1
    return nnx.state(ts), jnp.where(finite, loss, jnp.nan)


def trial_update(optimizer: nnx.Optimizer, model: nnx.Module, grads: nnx.State) -> Any:
    """The updates `optimizer.update(model, grads)` would add to the parameters, computed
    without applying them (the same arrays `nnx.Optimizer.update` gives its `tx`)."""
    updates, _ = optimizer.tx.update(
        nnx.as_pure(nnx.state(grads, optimizer.wrt)),
        nnx.as_pure(optimizer.opt_state),
        nnx.as_pure(nnx.state(model, optimizer.wrt)),
    )
    return updates


def all_finite(loss: jax.Array, grads: Any, updates: Any) -> jax.Array:
    """Whether the loss, every gradient and every update are finite (no NaN, no infinity):
    one boolean, from one test per parameter of its gradient and update together."""
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(updates), strict=True)
    checks = [jnp.isfinite(loss)] + [(jnp.isfinite(g) & jnp.isfinite(u)).all() for g, u in pairs]
    return jnp.stack(checks).all()


def eval_loss(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    batch: Any,
    *,
    ema: bool,
    loss_fn: LossFn = next_token_loss,
) -> jax.Array:
    """Loss on `batch` without dropout, with the model's weights or their EMA."""
    ts = nnx.merge(graphdef, state)
    return loss_fn(ts.ema_model() if ema else ts.model, batch, None)


def step_grads_fn(
    options: TrainOptions, graphdef: nnx.GraphDef, values: nnx.State, layout: Layout
) -> GradsFn:
    """The step's loss-and-gradient function: the options' `grads_fn`, or the library's
    `loss_and_grads` of their `loss_fn` with the gradients where the rule set puts them."""
    grad_shardings = gradient_shardings(graphdef, values, layout)
    if options.grads_fn is None:
        loss_fn = options.loss_fn or next_token_loss
        return partial(loss_and_grads, loss_fn=loss_fn, grad_shardings=grad_shardings)
    if grad_shardings is not None:
        raise ValueError(
            f"rule set {layout.rules.name!r} places the gradients apart from the "
            "parameters, which the library's loss_and_grads does and a custom grads_fn "
            "cannot: pass loss_fn instead, or use a rule set that splits gradients as it "
            "splits parameters (FSDP)."
        )
    return options.grads_fn


def placed_on_many(model: nnx.Module) -> bool:
    """Whether any of the model's arrays lies on more than one device."""
    return any(
        len(getattr(x, "sharding", None).device_set) > 1
        for x in jax.tree.leaves(nnx.state(model))
        if hasattr(x, "sharding")
    )


def gradient_shardings(graphdef: nnx.GraphDef, values: nnx.State, layout: Layout) -> Any:
    """Where the step puts the gradients, when the rule set places them apart from the
    parameters (ZeRO-2: split while the parameters are whole); None when they go together."""
    params = nnx.state(nnx.merge(graphdef, values).model, nnx.Param)
    return layout.gradient_shardings(params, prefix="model/")


ROLE_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
"""What each role of `role_bytes` holds, in words."""


def role_bytes(
    create: Callable[[], nnx.Module],
    rule_sets: Sequence[Rules],
    tx: optax.GradientTransformation | None = None,
    *,
    devices: int | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes each device holds of a model's parameters, their gradients and its optimizer's
    state (`tx`, default `adamw()`: two moments and a step count) under each rule set, on
    its own mesh (`strategy_mesh`), by rule set name and role: each role laid out as a step
    holds it, which is what DP, ZeRO-1, ZeRO-2 and FSDP differ in. From abstract arrays, so
    a model of any size costs no memory; with `devices`, on a mesh of that many devices
    that need not exist (its shape and names alone), to plan for a machine not at hand."""

    def mesh(rules: Rules) -> Mesh | AbstractMesh:
        if devices is None:
            return strategy_mesh(rules)
        return AbstractMesh(rules.mesh_shape(devices), rules.axes)

    def model_and_optimizer() -> tuple[nnx.Module, nnx.Optimizer]:
        model = create()
        return model, nnx.Optimizer(model, tx or adamw(), wrt=nnx.Param)

    model, optimizer = abstract(model_and_optimizer)
    params = nnx.state(model, nnx.Param)
    trees = {"params": params, "grads": params, "optimizer": nnx.state(optimizer)["opt_state"]}
    with warnings.catch_warnings():  # what stays whole shows in the bytes
        warnings.simplefilter("ignore", ReplicationWarning)
        return {
            rules.name: {
                role: resolve(tree, rules, mesh(rules), role=role).bytes_per_device()
                for role, tree in trees.items()
            }
            for rules in rule_sets
        }


def jitted(
    graphdef: nnx.GraphDef, values: nnx.State, layout: Layout, options: TrainOptions
) -> tuple[Callable[..., Any], Callable[..., jax.Array], Callable[..., jax.Array]]:
    """The train step jitted on `layout`'s shardings (the state donated), and the evaluation
    of the model and of its EMA, each run under the layout (`run_under`)."""
    shardings, batch = layout.shardings(), layout.batch_sharding
    scalar = NamedSharding(layout.mesh, P())
    step = jax.jit(
        partial(
            train_step,
            graphdef,
            micro_batches=options.micro_batches,
            dropout=options.dropout,
            grads_fn=step_grads_fn(options, graphdef, values, layout),
        ),
        in_shardings=(shardings, batch),
        out_shardings=(shardings, scalar),
        donate_argnums=0,
    )
    loss_fn = options.loss_fn or next_token_loss
    evaluate = [
        run_under(
            jax.jit(
                partial(eval_loss, graphdef, ema=ema, loss_fn=loss_fn),
                in_shardings=(shardings, batch),
                out_shardings=scalar,
                compiler_options=dict(options.compiler_options or {}) or None,
            ),
            layout,
            options.activations,
        )
        for ema in (False, True)
    ]
    return step, *evaluate
