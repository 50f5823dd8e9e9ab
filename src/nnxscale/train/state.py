"""The train state (model, optimizer, EMA, dropout RNG) and what builds it: the optimizer and
its checks, the options, the run's identity and the record of its configuration."""

from __future__ import annotations

import dataclasses
import json
import math
import uuid
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from nnxscale.model.losses import GradsFn, LossFn


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


PROBED_STEPS = (0, 1, 10, 100, 1_000, 10_000, 100_000, 1_000_000)
"""The steps at which `check_optimizer` asks for an update: a schedule is a function of the
step count, read by setting the optimizer state's counts, so each costs one update."""


def _updates(
    tx: optax.GradientTransformation, weight: float, steps: tuple[int, ...], params: Any = None
) -> list[tuple[int, list[float]]]:
    """(step, the distinct updates) of weights of `weight` whose gradients are 1, with the
    optimizer state's step counts set to each of `steps` in turn (a schedule reads its step
    from them); only the first step for an optimizer that keeps no count, whose every step
    updates alike. Asked of one weight; an optimizer whose mask or labels are a tree of the
    parameters cannot update one weight, and is asked of one number for each array of
    `params` instead."""
    try:
        return _probed(tx, weight, steps, {"w": 0.0})
    except (ValueError, TypeError):  # a tree of the parameters that one weight is not
        if params is None:
            raise
        return _probed(tx, weight, steps, nnx.as_pure(params))  # as nnx.Optimizer gives it


def _probed(
    tx: optax.GradientTransformation, weight: float, steps: tuple[int, ...], tree: Any
) -> list[tuple[int, list[float]]]:
    """`_updates` of one number for each leaf of `tree`."""
    weights = jax.tree.map(lambda _: jnp.full((), weight, jnp.float32), tree)
    grads = jax.tree.map(lambda _: jnp.ones((), jnp.float32), tree)
    state = tx.init(weights)
    found = []
    for step in steps:
        try:
            at = optax.tree_utils.tree_set(state, count=jnp.asarray(step, jnp.int32))
        except KeyError:
            return [(steps[0], _distinct(tx.update(grads, state, weights)[0]))]
        found.append((step, _distinct(tx.update(grads, at, weights)[0])))
    return found


def _distinct(updates: Any) -> list[float]:
    """The distinct values among `updates`' numbers, in order (NaN last, once)."""
    values = {float(u) for u in jax.device_get(jax.tree.leaves(updates))}
    finite = sorted(v for v in values if not math.isnan(v))
    return finite + ([math.nan] if len(finite) < len(values) else [])


def check_is_optimizer(tx: object) -> None:
    """Raise TypeError unless `tx` is an optax optimizer."""
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"expected an optax optimizer (optax.GradientTransformation), got {tx!r}: pass one "
            "such as nx.adamw() or optax.adamw(3e-3)."
        )


def check_optimizer(tx: optax.GradientTransformation, params: Any = None) -> None:
    """Raise a clear error when `tx`'s update of a weight with gradient 1 is not finite, or
    not a descent (a NaN, infinite or negative learning rate), at any of `PROBED_STEPS`: a
    schedule that turns negative later (one that decays past 0) would train uphill from
    there. Checked on one number for each array of `params` (the tree `tx` will be given;
    default: one weight), with the state's step counts set to each step in turn, before a
    step could write such an update into every weight. A schedule negative only between two
    probed steps goes unseen."""
    check_is_optimizer(tx)
    for step, updates in _updates(tx, 0.0, PROBED_STEPS, params):
        wrong = [u for u in updates if not math.isfinite(u) or u > 0]
        if wrong:
            raise ValueError(
                f"the optimizer's update at step {step:,} of a weight whose gradient is 1 is "
                f"{wrong[0]}: with a finite learning rate of 0 or more it would be a finite "
                "step down. Check the learning rate and its schedule (one that decays past 0 "
                "turns negative), which the optimizer was built with."
            )


DESCRIBED_STEPS = (0, 10, 1_000)
"""The steps at which `describe_optimizer` reads an optimizer's updates."""


def describe_optimizer(tx: optax.GradientTransformation, params: Any = None) -> dict[str, list]:
    """What tells two optimizers apart without their code (optax keeps its settings in
    closures): the kinds of state it keeps, in order (Adam's moments, a schedule's count), and
    the distinct updates of weights of 0.5 whose gradients are 1, one for each array of
    `params` (`_updates`), at `DESCRIBED_STEPS`, in which the learning rate and its schedule,
    the weight decay and where it applies, and the moment rates all show."""
    kinds: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, tuple) and hasattr(node, "_fields"):
            kinds.append(type(node).__name__)
        if isinstance(node, tuple | list):
            for child in node:
                walk(child)

    updates = [u for _, u in _updates(tx, 0.5, DESCRIBED_STEPS, params)]
    try:
        walk(tx.init({"w": jnp.zeros((), jnp.float32)}))
    except (ValueError, TypeError):  # a mask or labels as a tree of the parameters
        walk(tx.init(jax.tree.map(lambda _: jnp.zeros((), jnp.float32), nnx.as_pure(params))))
    return {"state": kinds, "updates": updates}


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


class MasterState(NamedTuple):
    """The optimizer state `master_weights` keeps: the float32 master copy of the
    parameters, and the wrapped optimizer's own state (of the master copy)."""

    master: Any
    inner: Any


def master_weights(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """`tx` run on a float32 master copy of parameters stored in a lower precision (a
    `Config(param_dtype="bfloat16")` model): the optimizer state holds the copy, `tx`
    updates it in float32 from float32 gradients, and the parameters become the copy rounded
    to their dtype. Without it, `tx` updates bfloat16 parameters in place, and an update
    smaller than half a bfloat16 step is lost (2^-8 of the weight)."""

    def init(params: Any) -> MasterState:
        master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
        return MasterState(master, tx.init(master))

    def update(grads: Any, state: MasterState, params: Any = None) -> tuple[Any, MasterState]:
        if params is None:
            raise ValueError("master_weights needs the parameters: update(grads, state, params)")
        grads = jax.tree.map(lambda g: jnp.asarray(g, jnp.float32), grads)
        updates, inner = tx.update(grads, state.inner, state.master)
        master = optax.apply_updates(state.master, updates)
        # the step that takes each parameter to its master value rounded to its dtype:
        # exact in float32, so that parameter + step rounds to that value
        steps = jax.tree.map(
            lambda m, p: (
                m.astype(jnp.asarray(p).dtype).astype(jnp.float32) - jnp.asarray(p, jnp.float32)
            ),
            master,
            params,
        )
        return steps, MasterState(master, inner)

    return optax.GradientTransformation(init, update)


def model_config(model: nnx.Module) -> dict[str, Any] | None:
    """A JSON-able record of how `model` was configured: its `cfg` dataclass, if it has one."""
    cfg = getattr(model, "cfg", None)
    return config_record(cfg) if dataclasses.is_dataclass(cfg) else None


def config_words(model: nnx.Module) -> str | None:
    """The model's configuration in words, as a checkpoint's record shows it: for a `cfg`
    dataclass that builds with no arguments, its name and the fields that differ from its
    defaults (`Config() with {'layers': 4}`); None otherwise (the record shows its JSON)."""
    cfg = getattr(model, "cfg", None)
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return None
    try:
        default = config_record(type(cfg)())
    except (TypeError, ValueError):  # no defaults to tell the changes from
        return None
    changed = {k: v for k, v in config_record(cfg).items() if default.get(k) != v}
    name = type(cfg).__name__
    return f"{name}() with {changed}" if changed else f"{name}() (the defaults)"


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

    @classmethod
    def after(cls, failure: str) -> StateLostError:
        """The error for `failure`, naming what is lost and how to go on."""
        return cls(
            f"{failure}, after the train state had been handed to it (donated, so that the "
            "step updates it in place): the state's arrays are gone. Restore the newest "
            "checkpoint into this trainer (Checkpoints(directory).restore_into(trainer)) "
            "and train on; the batches are validated before a step starts, so what fails "
            "here is the program itself (a callback, memory)."
        )


class NonFiniteError(FloatingPointError):
    """A step's loss or gradients were not finite, under `nonfinite="raise"`."""

    @classmethod
    def at(cls, step: int) -> NonFiniteError:
        """The error for step `step`, saying what the step left unchanged and where to look."""
        return cls(
            f"step {step}: the loss, a gradient or the optimizer's update was not finite (NaN "
            "or infinite), so the step did not change the weights, optimizer moments or "
            "EMA; only its counter moved past the batch. Look for NaN, infinite or huge "
            "values in that batch, or an optimizer setting that divides by zero or a "
            "schedule that is not finite at this step; "
            'TrainOptions(nonfinite="skip") skips such steps and goes on.'
        )


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
