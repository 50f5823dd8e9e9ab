"""Training: a train state sharded by a rule set, and one jitted step for every strategy.

The state holds the model (any NNX module), its optimizer, an exponential moving average
(EMA) of the parameters and the dropout RNG stream; every array in it is laid out by the same
rule set. The step is one compiled program with the layout's shardings on both sides and the
state's buffers donated, so a step updates the state in place. The strategy (DP, FSDP, TP, ...)
is only the layout: the step's code is the same for all of them, and for every model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import cache, partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.core.trees import flat, is_key, place
from nnxscale.model.losses import GradsFn, LossFn, next_token_loss
from nnxscale.model.transformer import TINY, Config, create
from nnxscale.placement.init import abstract, compile_init
from nnxscale.placement.layout import Layout, ReplicationWarning, activation_rules, resolve
from nnxscale.placement.mesh import (
    AXIS_TYPES,
    AxisTypeError,
    axis_kind,
    axis_type_error,
    constrain_to,
    partitions,
)
from nnxscale.placement.rules import Rules, strategy_mesh
from nnxscale.train.data import check_batch_splits


class EMA(nnx.Variable):
    """An exponential moving average of a parameter, annotated with the parameter's names."""


def params_by_path(model: nnx.Module) -> dict[str, nnx.Variable]:
    """The model's parameters keyed by their `/`-joined paths (the EMA's keys)."""
    return {
        "/".join(str(k) for k in path): variable
        for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


class TrainState(nnx.Module):
    """Model, optimizer, EMA of the parameters (started at the parameters) and dropout RNG."""

    def __init__(
        self,
        model: nnx.Module,
        tx: optax.GradientTransformation,
        *,
        seed: int = 0,
        ema_decay: float = 0.9,
    ) -> None:
        check_model(model)
        with nnx.use_eager_sharding(False):  # rule sets, not Flax, decide where arrays go
            self.model = model
            self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
            self.ema = nnx.Dict(
                {
                    path: EMA(jnp.array(p[...], copy=True), **_names(p))
                    for path, p in params_by_path(self.model).items()
                }
            )
            self.ema_decay = ema_decay
            self.rngs = nnx.Rngs(dropout=seed + 1)

    def ema_model(self) -> nnx.Module:
        """A copy of the model holding the EMA weights."""
        model = nnx.clone(self.model)
        for path, param in params_by_path(model).items():
            param[...] = self.ema[path][...]
        return model


def _names(param: nnx.Variable) -> dict[str, Any]:
    """The parameter's logical names (and Flax rules) as metadata for its EMA, if it has any."""
    metadata = param.get_metadata()
    return {k: metadata[k] for k in ("out_sharding", "sharding_rules") if metadata.get(k)}


def check_model(model: object) -> None:
    """Raise a clear error unless `model` is an NNX module with parameters to train."""
    if not isinstance(model, nnx.Module):
        what = type(model).__name__
        raise TypeError(
            f"expected an NNX module (flax.nnx.Module) to train, got a {what}. Wrap a pytree "
            "of arrays in a module whose weights are nnx.Param, or pass a function that "
            "creates the module."
        )
    if not jax.tree.leaves(nnx.state(model, nnx.Param)):
        raise ValueError(
            f"{type(model).__name__} has no nnx.Param: the optimizer trains nnx.Param "
            "variables only. Declare its weights as nnx.Param(...)."
        )


def check_optimizer(tx: optax.GradientTransformation) -> None:
    """Raise a clear error when `tx`'s first update of a weight with gradient 1 is not finite,
    or not a descent (a NaN, infinite or negative learning rate): checked once, on one number,
    before a step could write such an update into every weight."""
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"expected an optax optimizer (optax.GradientTransformation), got {tx!r}: pass one "
            "such as nx.adamw() or optax.adamw(3e-3)."
        )
    weight, grad = {"w": jnp.zeros((), jnp.float32)}, {"w": jnp.ones((), jnp.float32)}
    update = float(tx.update(grad, tx.init(weight), weight)[0]["w"])
    if not math.isfinite(update) or update > 0:
        raise ValueError(
            f"the optimizer's first update of a weight whose gradient is 1 is {update}: "
            "with a finite learning rate of 0 or more it would be a finite step down. Check "
            "the learning rate (and schedule) the optimizer was built with."
        )


@cache
def accepts(platform: str, option: str, value: Any) -> bool:
    """Whether the backend of `platform` compiles a program with `option` set to `value`:
    XLA refuses an option it does not know, and each release adds and removes some."""
    where = jax.sharding.SingleDeviceSharding(jax.devices(platform)[0])
    probe = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jnp.float32, sharding=where))
    try:
        probe.compile(compiler_options={option: value})
    except jax.errors.JaxRuntimeError:  # "No such compile option", or a value it cannot read
        return False
    return True


LEARNING_RATE = 3e-3
"""The chapters' learning rate: one AdamW step moves a weight by about this much."""


def adamw(
    learning_rate: float = LEARNING_RATE, weight_decay: float = 1e-4
) -> optax.GradientTransformation:
    """The optimizer the chapters train with: AdamW with a small weight decay."""
    for name, value in (("learning_rate", learning_rate), ("weight_decay", weight_decay)):
        if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
            raise ValueError(
                f"{name}={value!r}: it scales every update, so it must be a finite number, 0 "
                "or more (a NaN or infinite one would make every weight NaN)."
            )
    return optax.adamw(learning_rate, weight_decay=weight_decay)


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


def mean_loss(model: nnx.Module, loss_fn: LossFn) -> Callable[..., jax.Array]:
    """`loss(params, batch, key)`: `loss_fn` of `model` with `params` for its parameters and
    `key` for its dropout stream (`nnx.Rngs(dropout=key)`, or None without dropout), refused
    unless it is a scalar."""
    graphdef, _, rest = nnx.split(model, nnx.Param, ...)

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
    params = nnx.state(model, nnx.Param)
    loss_of = mean_loss(model, loss_fn)

    def place(grads: nnx.State) -> nnx.State:
        if grad_shardings is None:
            return grads
        return jax.tree.map(constrain_to, grads, grad_shardings)

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

    def update(values: nnx.State) -> nnx.State:
        ts = nnx.merge(graphdef, values)
        ts.optimizer.update(ts.model, grads)
        decay = ts.ema_decay
        for path, param in params_by_path(ts.model).items():
            ts.ema[path][...] = decay * ts.ema[path][...] + (1 - decay) * param[...]
        return nnx.state(ts)

    with jax.named_scope("optimizer"):  # names the update's ops in profiles
        finite = all_finite(loss, grads, trial_update(ts.optimizer, ts.model, grads))
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


def model_config(model: nnx.Module) -> dict[str, Any] | None:
    """A JSON-able record of how `model` was configured: its `cfg` dataclass, if it has one."""
    cfg = getattr(model, "cfg", None)
    return config_record(cfg) if dataclasses.is_dataclass(cfg) else None


NONFINITE = ("skip", "raise")
"""The policies for a step whose loss, a gradient or an update is not finite
(`TrainOptions.nonfinite`)."""


def new_run() -> str:
    """A new run's identity, the same in every process of a distributed run (process 0's)."""
    ident = np.frombuffer(uuid.uuid4().bytes, dtype=np.uint32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        ident = np.asarray(multihost_utils.broadcast_one_to_all(ident))
    return ident.astype(np.uint32).tobytes().hex()


class StateLostError(RuntimeError):
    """The train state was consumed by a step that failed while running."""


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients were not finite, under `nonfinite="raise"`."""


@dataclasses.dataclass(frozen=True)
class TrainOptions:
    """How a trainer trains, listed once: `Trainer.create`, `Trainer.from_layout` and
    `Checkpoints.restore` take these unchanged, so a restored run compiles the saved run's step.

    `loss_fn(model, batch, rngs)` is the loss (default: the book's next-token loss);
    `grads_fn` replaces the whole loss-and-gradient computation (`nnxscale.fsdp`,
    `nnxscale.pipeline`). `compiler_options` go to XLA when the step and the evaluations compile;
    `activations=False` leaves the model's activations to the compiler (no constraints).
    """

    loss_fn: LossFn | None = None
    grads_fn: GradsFn | None = None
    micro_batches: int = 1
    dropout: bool = True
    seed: int = 0
    ema_decay: float = 0.9
    compiler_options: Mapping[str, Any] | None = None
    activations: bool = True
    nonfinite: str = "skip"
    """What `Trainer.train` does after a step whose loss, a gradient or an update was not
    finite (the step never applies such an update): "skip" lists it in `Trainer.skipped` and
    goes on, "raise" raises NonFiniteError."""

    def __post_init__(self) -> None:
        kinds = {"seed": int, "dropout": bool, "activations": bool, "ema_decay": int | float}
        for name, kind in kinds.items():
            value = getattr(self, name)
            if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
                raise TypeError(f"{name}={value!r}: expected {getattr(kind, '__name__', kind)}")
        for name in ("loss_fn", "grads_fn"):
            if getattr(self, name) is not None and not callable(getattr(self, name)):
                raise TypeError(f"{name}={getattr(self, name)!r}: expected a function, or None")
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"nonfinite={self.nonfinite!r}: choose {' or '.join(map(repr, NONFINITE))}."
            )
        if self.loss_fn is not None and self.grads_fn is not None:
            raise ValueError(
                "pass loss_fn or grads_fn, not both: grads_fn computes the loss itself (wrap "
                "your loss in it), loss_fn is differentiated by the library's loss_and_grads."
            )
        if (
            isinstance(self.micro_batches, bool)
            or not isinstance(self.micro_batches, int)
            or self.micro_batches < 1
        ):
            raise ValueError(
                f"micro_batches={self.micro_batches!r}: the step cuts each batch into this "
                "many slices, so it must be a whole number of at least 1."
            )
        if not 0 <= self.ema_decay < 1:
            raise ValueError(
                f"ema_decay={self.ema_decay!r}: the EMA keeps this share of itself each step, "
                "so it must lie in [0, 1) (0.9 to 0.9999 are usual)."
            )

    def replace(self, **changes: Any) -> TrainOptions:
        """These options with `changes`; an unknown name is refused with the known ones."""
        known = {field.name for field in dataclasses.fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise TypeError(f"unknown training options {unknown}: the options are {sorted(known)}")
        return dataclasses.replace(self, **changes) if changes else self

    def recorded(self) -> dict[str, Any]:
        """What a checkpoint keeps of these options: the values, and the functions' names."""
        record = {
            name: getattr(self, name)
            for name in ("micro_batches", "dropout", "activations", "compiler_options", "nonfinite")
        }
        record["compiler_options"] = dict(self.compiler_options or {}) or None
        for name in ("loss_fn", "grads_fn"):
            fn = getattr(self, name)
            record[name] = None if fn is None else getattr(fn, "__qualname__", type(fn).__name__)
        return record

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> TrainOptions:
        """The options a checkpoint recorded, without the functions (they are not recorded)."""
        return cls(**{k: v for k, v in record.items() if k not in ("loss_fn", "grads_fn")})


@dataclasses.dataclass
class Trainer:
    """A train state laid out by a rule set on a mesh, with its compiled steps.

    `config` is an opaque, JSON-able record of the model's configuration that checkpoints
    keep (for the book's Transformer its `Config`), so a restore can rebuild the model.
    """

    graphdef: nnx.GraphDef
    state: nnx.State
    layout: Layout
    options: TrainOptions
    step: Callable[[nnx.State, Any], tuple[nnx.State, jax.Array]]
    evaluate: Callable[[nnx.State, Any], jax.Array]
    evaluate_ema: Callable[[nnx.State, Any], jax.Array]
    config: dict[str, Any] | None = None
    compiled: jax.stages.Compiled | None = None
    """The step's program compiled last (`compile`)."""
    programs: dict[tuple[object, ...], jax.stages.Compiled] = dataclasses.field(
        default_factory=dict, repr=False
    )
    """The step's programs, one per kind of batch (`batch_kind`)."""
    run: str = dataclasses.field(default_factory=new_run)
    """The run this state belongs to: new for a created trainer, the saved run's for a
    restored one. A checkpoint directory holds the steps of one run."""
    skipped: list[int] = dataclasses.field(default_factory=list)
    """Steps whose update was skipped because their loss, a gradient or an update was not finite."""

    @classmethod
    def create(
        cls,
        model: nnx.Module | Callable[[], nnx.Module],
        tx: optax.GradientTransformation,
        rules: Rules,
        mesh: Mesh,
        options: TrainOptions | None = None,
        *,
        config: dict[str, Any] | None = None,
        **changes: Any,
    ) -> Trainer:
        """A trainer for `model` (an NNX module, or a function that creates one) with `tx`,
        laid out by `rules` on `mesh`, training as `options` with `changes` say.

        Given a module, the train state is built beside it and copied into its layout; given a
        function, every array is created straight into its shards (`nnxscale.init`).
        `config` is recorded in checkpoints (default: `model.cfg`).
        """
        options = (options or TrainOptions()).replace(**changes)
        check_optimizer(tx)
        if not callable(model):
            check_model(model)
        if isinstance(model, nnx.Module):
            # variables that Flax placed as it created them need their mesh; entering it
            # otherwise would recompile every eager operation of the state's creation
            context = jax.set_mesh(mesh) if _placed(model) else contextlib.nullcontext()
            with context:
                state = TrainState(model, tx, seed=options.seed, ema_decay=options.ema_decay)
            graphdef, values = nnx.split(state)
            layout = resolve(values, rules, mesh)
        else:
            factory = model

            def create_state() -> TrainState:
                return TrainState(factory(), tx, seed=options.seed, ema_decay=options.ema_decay)

            compiled, graphdef, layout = compile_init(create_state, rules, mesh)
            values = compiled()
        config = config if config is not None else model_config(nnx.merge(graphdef, values).model)
        return cls.from_layout(graphdef, values, layout, options, config=config)

    @classmethod
    def from_layout(
        cls,
        graphdef: nnx.GraphDef,
        values: nnx.State,
        layout: Layout,
        options: TrainOptions | None = None,
        *,
        config: dict[str, Any] | None = None,
        run: str | None = None,
    ) -> Trainer:
        """A trainer for a split train state already resolved into `layout` (placed there if
        it is not), with its step and evaluations jitted on the layout's shardings; it
        continues `run` (default: a new run)."""
        options = options or TrainOptions()
        model = nnx.merge(graphdef, values).model
        check_loss(options, model)
        check_axis_type(model, layout.mesh)
        config = config_record(config)
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
        rules = layout.rules if options.activations else None
        loss_fn = options.loss_fn or next_token_loss
        evaluate = [
            _under_mesh(
                jax.jit(
                    partial(eval_loss, graphdef, ema=ema, loss_fn=loss_fn),
                    in_shardings=(shardings, batch),
                    out_shardings=scalar,
                    compiler_options=dict(options.compiler_options or {}) or None,
                ),
                layout.mesh,
                rules,
            )
            for ema in (False, True)
        ]
        placed = place(values, shardings)
        run = run or new_run()
        return cls(graphdef, placed, layout, options, step, *evaluate, config=config, run=run)

    @property
    def batch_sharding(self) -> NamedSharding:
        """Where every array of a batch goes: split on its first dimension (`Layout`'s)."""
        return self.layout.batch_sharding

    def batch(self, batches: Callable[[int, NamedSharding], Any], step: int = 0) -> Any:
        """Batch `step` of `batches` (`batches(step, sharding)` gives any pytree of arrays),
        with every array where the step takes it (`batch_sharding`)."""
        return self.place_batch(batches(step, self.batch_sharding))

    def train(self, batches: Callable[[int, NamedSharding], Any], steps: int) -> list[float]:
        """Run `steps` steps on the batches of `batches` from the current step; the losses."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"steps={steps!r}: how many steps to train, a whole number, 0 or more")
        self.check_state()
        first = int(self.step_count())
        losses = []
        for step in range(first, first + steps):
            batch = self.batch(batches, step)
            compiled = self.compile(batch)
            try:
                self.state, loss = compiled(self.state, batch)
                losses.append(float(loss))
            except Exception as error:
                self.check_state(f"step {step} failed while running ({type(error).__name__})")
                raise
            if not math.isfinite(losses[-1]):
                self.nonfinite(step)
        return losses

    def check_state(self, failure: str = "a step failed while running") -> None:
        """Raise StateLostError if the train state's arrays are gone: a step that fails while
        running has already been given them (donated), and nothing can bring them back."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.state) if hasattr(x, "is_deleted")):
            raise StateLostError(
                f"{failure}, after the train state had been handed to it (donated, so that the "
                "step updates it in place): the state's arrays are gone. Restore the newest "
                "checkpoint into this trainer (Checkpoints(directory).restore_into(trainer)) "
                "and train on; the batches are validated before a step starts, so what fails "
                "here is the program itself (a callback, memory)."
            )

    def nonfinite(self, step: int) -> None:
        """After step `step` skipped its update (its loss, a gradient or an update was not
        finite): note it in `skipped`, or raise NonFiniteError, as the options' `nonfinite`
        says."""
        self.skipped.append(step)
        if self.options.nonfinite == "raise":
            raise NonFiniteError(
                f"step {step}: the loss, a gradient or the optimizer's update was not finite (NaN "
                "or infinite), so the step did not change the weights, optimizer moments or "
                "EMA; only its counter moved past the batch. Look for NaN, infinite or huge "
                "values in that batch, or an optimizer setting that divides by zero or a "
                "schedule that is not finite at this step; "
                'TrainOptions(nonfinite="skip") skips such steps and goes on.'
            )

    def place_batch(self, batch: Any) -> Any:
        """`batch` with every array on `batch_sharding` (arrays already there stay), checked
        first: a bad batch is refused before a step could consume the state."""
        check_batch(batch, self.batch_sharding, self.options.micro_batches)
        placed = place(batch, jax.tree.map(lambda _: self.batch_sharding, batch))
        vocab = (self.config or {}).get("vocab") if isinstance(self.config, dict) else None
        if isinstance(vocab, int):
            check_tokens(placed, vocab)
        return placed

    def time_steps(
        self,
        batches: Callable[[int, NamedSharding], Any],
        steps: int,
        first: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> list[float]:
        """Seconds on `clock` (by default the wall's) of each of `steps` steps on batches
        first, first + 1, ... (data ready)."""
        times = []
        for step in range(first, first + steps):
            batch = jax.block_until_ready(self.batch(batches, step))
            compiled = self.compile(batch)
            start = clock()
            self.state, loss = compiled(self.state, batch)
            jax.block_until_ready(loss)
            times.append(clock() - start)
        return times

    def compile(self, batch: Any) -> jax.stages.Compiled:
        """The step compiled for batches like `batch`: once per kind of batch (its arrays'
        shapes, dtypes and shardings), for running and analysis.

        It is traced under `jax.set_mesh(mesh)`, so a model's own sharding constraints apply,
        and compiled with the options' `compiler_options`.
        """
        kind = batch_kind(batch)
        if kind not in self.programs:
            check_batch(batch, self.batch_sharding, self.options.micro_batches)
            if self.programs:
                check_same_kind(next(iter(self.programs)), kind)
            rules = self.layout.rules if self.options.activations else None
            with jax.set_mesh(self.layout.mesh), activation_rules(rules, self.layout.mesh):
                lowered = traced(self.step.lower, self.layout.mesh, self.layout)(self.state, batch)
                compiler_options = dict(self.options.compiler_options or {}) or None
                self.programs[kind] = lowered.compile(compiler_options=compiler_options)
        self.compiled = self.programs[kind]
        return self.compiled

    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.state["optimizer"]["step"][...])

    def model(self) -> nnx.Module:
        """The model, with its current (sharded) weights."""
        return nnx.merge(self.graphdef, self.state).model


def trainer_for(
    rules: Rules,
    devices: int | None = None,
    model: Config | nnx.Module | Callable[[], nnx.Module] = TINY,
    *,
    mesh: Mesh | None = None,
    explicit: bool = False,
    tx: optax.GradientTransformation | None = None,
    options: TrainOptions | None = None,
    **changes: Any,
) -> Trainer:
    """A trainer for `model` under `rules` on `devices` devices (`strategy_mesh`, with
    Explicit axes if `explicit`), or on `mesh`: the book's Transformer for a `Config` (default
    `TINY`), or any module or function that creates one; trained with `tx` (default `adamw()`)
    as `options` with `changes` say."""
    mesh = mesh if mesh is not None else strategy_mesh(rules, devices, explicit=explicit)
    model = create(model) if isinstance(model, Config) else model
    return Trainer.create(model, tx or adamw(), rules, mesh, options, **changes)


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


def _placed(model: nnx.Module) -> bool:
    """Whether any of the model's arrays lies on more than one device."""
    return any(
        len(getattr(x, "sharding", None).device_set) > 1
        for x in jax.tree.leaves(nnx.state(model))
        if hasattr(x, "sharding")
    )


def gradient_shardings(graphdef: nnx.GraphDef, values: nnx.State, layout: Layout) -> Any:
    """Where the step puts the gradients, when the rule set places them apart from the
    parameters (ZeRO-2: split while the parameters are whole); None when they go together."""
    whole = layout.rules.whole
    if ("params" in whole) == ("grads" in whole):
        return None
    params = nnx.state(nnx.merge(graphdef, values).model, nnx.Param)
    return resolve(params, layout.rules, layout.mesh, role="grads").shardings()


ROLE_NAMES = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
"""What each role of `role_bytes` holds, in words."""


def role_bytes(
    create: Callable[[], nnx.Module],
    rule_sets: Sequence[Rules],
    tx: optax.GradientTransformation | None = None,
) -> dict[str, dict[str, int]]:
    """Bytes each device holds of a model's parameters, their gradients and its optimizer's
    state (`tx`, default `adamw()`: two moments and a step count) under each rule set, on
    its own mesh (`strategy_mesh`), by rule set name and role: each role laid out as a step
    holds it, which is what DP, ZeRO-1, ZeRO-2 and FSDP differ in. From abstract arrays, so
    a model of any size costs no memory."""

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
                role: resolve(tree, rules, strategy_mesh(rules), role=role).bytes_per_device()
                for role, tree in trees.items()
            }
            for rules in rule_sets
        }


def two_at_a_time(calls: list[Callable[[], Any]]) -> list[Any]:
    """The results of `calls` (each a trace and a compilation), two at a time: XLA compiles
    in native threads, so one call's compilation overlaps the next one's Python tracing."""
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(lambda call: call(), calls))


def batch_kind(batch: Any) -> tuple[object, ...]:
    """What a compiled step fixes of a batch: each array's path, shape, dtype and sharding."""
    return tuple(
        (path, tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)),
         getattr(x, "sharding", None))
        for path, x in flat(batch)
    )  # fmt: skip


def compile_all(jobs: list[tuple[Trainer, Any]]) -> list[jax.stages.Compiled]:
    """Each trainer's step compiled for its batch, two at a time (`two_at_a_time`)."""
    return two_at_a_time([partial(trainer.compile, batch) for trainer, batch in jobs])


def _under_mesh(
    fn: Callable[..., jax.Array], mesh: Mesh, rules: Rules | None
) -> Callable[..., jax.Array]:
    """`fn`, traced and run under `jax.set_mesh(mesh)` with `rules` placing activations."""

    def run(*args: Any) -> jax.Array:
        with jax.set_mesh(mesh), activation_rules(rules, mesh):
            return traced(fn, mesh)(*args)

    return run


def traced(fn: Callable[..., Any], mesh: Mesh, layout: Layout | None = None) -> Callable[..., Any]:
    """`fn`, whose errors from a model written for the other kind of mesh axes are raised as
    `AxisTypeError`s that name the fix (`nnxscale.mesh.axis_type_error`), and whose errors
    from a split the mesh cannot make name the arrays the rules kept whole for that reason.
    Tracing comes before the train state is handed to the step, so nothing is lost."""

    def call(*args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as error:
            better = axis_type_error(error, mesh)
            short = [p for p in layout.unsplit() if p.fallback] if layout is not None else []
            if better is None and short and "evenly divide" in str(error):
                listed = "; ".join(f"{p.path} {p.shape}: {p.reason}" for p in short[:4])
                better = ValueError(
                    f"the model asks for a split that mesh {dict(mesh.shape)} cannot make "
                    f"(JAX said: {str(error).splitlines()[0]}). The rule set kept these "
                    f"arrays whole for the same reason: {listed}. Use a mesh whose axes "
                    "divide those dimensions, or let the model not ask for that split."
                )
            if better is None:
                raise
            raise better from error

    return call


def config_record(config: object) -> dict[str, Any] | None:
    """The JSON-able record of a model configuration that checkpoints keep: a dict as it is,
    a dataclass as its fields (dtypes by name), or what its `to_config()` method returns; a
    restore hands this record to the function that rebuilds the model (its `from_config`)."""
    if config is None:
        return None
    if hasattr(config, "to_config"):
        record = config.to_config()
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        record = {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    else:
        record = _jsonable(config)
    try:
        json.loads(json.dumps(record))
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"the model configuration {config!r} cannot be written as JSON ({error}), and "
            "checkpoints keep it: pass config= a dict of numbers, strings, lists and dicts, "
            "or a dataclass of them, or give the configuration a to_config() method that "
            "returns such a dict (and rebuild the model from that dict when restoring)."
        ) from None
    if not isinstance(record, dict):
        raise TypeError(f"config={config!r}: expected a dict or a dataclass of settings")
    return record


def _jsonable(value: Any) -> Any:
    """`value` with dtypes and scalar types (np.float32, jnp.bfloat16) as their names, NumPy
    scalars as numbers, tuples as lists and nested dataclasses as dicts: a restore hands the
    factory these JSON values, so it turns names back into types itself."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.dtype | type) or hasattr(value, "dtype"):
        try:
            return np.dtype(value).name
        except TypeError:
            return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


def check_loss(options: TrainOptions, model: nnx.Module) -> None:
    """Raise a clear error when no loss is given for a model the book's loss cannot train:
    `next_token_loss` calls the book's Transformer's `loss` and `layer_keys`."""
    default = options.loss_fn is None and options.grads_fn is None
    lacks = [name for name in ("loss", "layer_keys") if not hasattr(model, name)]
    if default and lacks:
        raise TypeError(
            f"no loss_fn given, and the default (the book's next-token loss) needs the "
            f"book's Transformer, whose {' and '.join(lacks)} {type(model).__name__} lacks: pass "
            "loss_fn=f with f(model, batch, rngs) returning the mean loss (rngs is the "
            "dropout stream, or None)."
        )


def check_axis_type(model: nnx.Module, mesh: Mesh) -> None:
    """Raise a clear error when `model` declares the kind of mesh axes it is written for
    (an `AXIS_TYPE` of "auto" or "explicit", as the book's Transformer does) and `mesh` has
    the other kind; a model that declares nothing is checked when its step is traced."""
    declared, kind = getattr(model, "AXIS_TYPE", None), axis_kind(mesh)
    if declared in AXIS_TYPES and declared != kind:
        raise AxisTypeError(
            f"{type(model).__name__} is written for {declared.title()} mesh axes "
            f"({AXIS_TYPES[declared]}), and mesh {dict(mesh.shape)} has {kind.title()} axes: "
            f"build it with nx.strategy_mesh(rules, explicit={declared == 'explicit'}) or "
            f"nx.make_mesh(shape, names, explicit={declared == 'explicit'})."
        )


def check_batch(batch: Any, sharding: NamedSharding, micro_batches: int = 1) -> None:
    """Raise a clear error unless every array of `batch` can be split as the step splits it."""
    leaves = flat(batch)
    if not leaves:
        raise ValueError("the batch holds no arrays: pass a pytree of arrays, one row per example")
    rows = set()
    for path, x in leaves:
        where = f"batch array {path!r}" if path else "the batch"
        if not hasattr(x, "shape") or is_key(x) or len(x.shape) == 0:
            raise ValueError(
                f"{where} is {type(x).__name__} {getattr(x, 'shape', '')}: every array of a "
                "batch needs a first dimension of examples (rows) to split over the data axes."
            )
        rows.add(x.shape[0])
        if x.shape[0] % micro_batches:
            raise ValueError(
                f"{where} has {x.shape[0]} rows, which cannot be cut into {micro_batches} "
                f"micro-batches: use a batch size that is a multiple of {micro_batches}."
            )
        what = f"each of {micro_batches} micro-batches" + (f" of {where}" if path else "")
        what = where if micro_batches == 1 else what
        check_batch_splits(x.shape[0] // micro_batches, sharding, what)
    if len(rows) > 1:
        raise ValueError(
            f"the batch's arrays have different numbers of rows {sorted(rows)}: every array "
            "needs the same first dimension, one row per example."
        )


def check_same_kind(first: tuple[object, ...], kind: tuple[object, ...]) -> None:
    """Raise a clear error when a batch's arrays, or their dtypes, differ from the first
    batch's (another shape is another program; another structure or dtype is a bug)."""
    was = {path: dtype for path, _, dtype, _ in first}
    now = {path: dtype for path, _, dtype, _ in kind}
    if set(was) != set(now):
        raise ValueError(
            f"this batch holds the arrays {sorted(now)}, the first batch {sorted(was)}: "
            "give every step a batch of the same structure."
        )
    changed = sorted(f"{path or 'the batch'} ({was[path]} -> {now[path]})" for path in was
                     if was[path] != now[path])  # fmt: skip
    if changed:
        raise ValueError(
            f"the batch changed dtype since the first step: {', '.join(changed)}. Convert it "
            "to the first batch's dtypes (integer token ids stay int32)."
        )


@jax.jit
def _bounds(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x.min(), x.max()


def check_tokens(batch: Any, vocab: int) -> None:
    """Raise a clear error unless every array of `batch` holds integer token ids in
    [0, vocab): an id outside would read no embedding row, and poison the step."""
    for path, x in flat(batch):
        where = f"batch array {path!r}" if path else "the batch"
        if x.ndim != 2 or x.shape[1] < 2:
            raise ValueError(
                f"{where} has shape {x.shape}: the model reads rows of token ids, shape (rows, "
                "tokens) with at least 2 tokens a row, as it predicts each token from those "
                "before it."
            )
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(
                f"{where} has dtype {x.dtype}: the model reads integer token ids (int32)."
            )
        low, high = (int(v) for v in jax.device_get(_bounds(x)))
        if low < 0 or high >= vocab:
            raise ValueError(
                f"{where} holds token ids from {low} to {high}, outside the vocabulary of "
                f"{vocab} (ids 0 to {vocab - 1}): encode the data with the model's tokenizer, "
                "or build the model with a larger vocab."
            )
