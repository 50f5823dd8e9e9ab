"""Training: a train state sharded by a rule set, and one jitted step for every strategy.

The state holds the model, its optimizer, an exponential moving average (EMA) of the
parameters and the dropout RNG stream; every array in it is laid out by the same rule set.
The step is one compiled program with the layout's shardings on both sides and the state's
buffers donated, so a step updates the state in place. The strategy (DP, FSDP, TP, ...) is
only the layout: the step's code is the same for all of them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from nnxscale.data import check_batch_splits
from nnxscale.layout import Layout, resolve
from nnxscale.model import Config, Transformer, create
from nnxscale.rules import Rules


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
        self, cfg: Config, tx: optax.GradientTransformation, *, seed: int = 0,
        ema_decay: float = 0.9,
    ) -> None:  # fmt: skip
        with nnx.use_eager_sharding(False):  # rule sets, not Flax, decide where arrays go
            self.model = create(cfg, seed)
            self.optimizer = nnx.Optimizer(self.model, tx, wrt=nnx.Param)
            self.ema = nnx.Dict(
                {
                    path: EMA(jnp.array(p[...], copy=True), out_sharding=p.out_sharding)
                    for path, p in params_by_path(self.model).items()
                }
            )
            self.ema_decay = ema_decay
            self.rngs = nnx.Rngs(dropout=seed + 1)

    def ema_model(self) -> Transformer:
        """A copy of the model holding the EMA weights."""
        model = nnx.clone(self.model)
        for path, param in params_by_path(model).items():
            param[...] = self.ema[path][...]
        return model


LEARNING_RATE = 3e-3
"""The chapters' learning rate: one AdamW step moves a weight by about this much."""


def adamw(
    learning_rate: float = LEARNING_RATE, weight_decay: float = 1e-4
) -> optax.GradientTransformation:
    """The optimizer the chapters train with: AdamW with a small weight decay."""
    return optax.adamw(learning_rate, weight_decay=weight_decay)


def next_token_loss(
    model: Transformer, tokens: jax.Array, dropout_key: jax.Array | None
) -> jax.Array:
    """Mean cross-entropy of predicting tokens[:, 1:] from tokens[:, :-1]."""
    return cross_entropy(model(tokens[:, :-1], dropout_key=dropout_key), tokens[:, 1:])


def largest_difference(a: object, b: object) -> float:
    """The largest absolute difference between two trees of arrays, wherever they live."""

    def host(x: jax.Array) -> np.ndarray:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x, dtype=np.float64)

    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(host(x) - host(y)))) for x, y in pairs)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy of integer `targets` under `logits`."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def loss_and_grads(
    model: Transformer, batch: jax.Array, key: jax.Array | None, micro_batches: int = 1
) -> tuple[jax.Array, nnx.State]:
    """Loss and parameter gradients, accumulated over `micro_batches` slices of the batch.

    Micro-batch j takes rows j, j + k, j + 2k, ... so every device keeps contributing its own
    rows; the mean of the k micro-batch means is the mean over the batch.
    """
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss_of(params: nnx.State, tokens: jax.Array, key: jax.Array | None) -> jax.Array:
        return next_token_loss(nnx.merge(graphdef, params, rest), tokens, key)

    if micro_batches == 1:
        return jax.value_and_grad(loss_of)(params, batch, key)
    rows = batch.shape[0]
    if rows % micro_batches:
        raise ValueError(f"a batch of {rows} rows cannot be cut into {micro_batches} micro-batches")
    micro = jnp.moveaxis(batch.reshape(rows // micro_batches, micro_batches, -1), 1, 0)

    def accumulate(total, inputs):
        tokens, index = inputs
        micro_key = None if key is None else jax.random.fold_in(key, index)
        loss, grads = jax.value_and_grad(loss_of)(params, tokens, micro_key)
        return jax.tree.map(jnp.add, total, (loss, grads)), None

    zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    (loss, grads), _ = jax.lax.scan(accumulate, zero, (micro, jnp.arange(micro_batches)))
    return loss / micro_batches, jax.tree.map(lambda g: g / micro_batches, grads)


GradsFn = Callable[[Transformer, jax.Array, "jax.Array | None", int], tuple[jax.Array, nnx.State]]
"""How a step gets the loss and gradients: (model, batch, dropout key, micro-batches)."""


def train_step(
    graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array, *, micro_batches: int = 1,
    dropout: bool = True, grads_fn: GradsFn = loss_and_grads,
) -> tuple[nnx.State, jax.Array]:  # fmt: skip
    """One optimizer step and EMA update on `batch`; returns the new state and the loss."""
    ts = nnx.merge(graphdef, state)
    key = ts.rngs.dropout() if dropout else None
    loss, grads = grads_fn(ts.model, batch, key, micro_batches)
    ts.optimizer.update(ts.model, grads)
    decay = ts.ema_decay
    for path, param in params_by_path(ts.model).items():
        ts.ema[path][...] = decay * ts.ema[path][...] + (1 - decay) * param[...]
    return nnx.state(ts), loss


def eval_loss(
    graphdef: nnx.GraphDef, state: nnx.State, batch: jax.Array, *, ema: bool
) -> jax.Array:
    """Loss on `batch` without dropout, with the model's weights or their EMA."""
    ts = nnx.merge(graphdef, state)
    return next_token_loss(ts.ema_model() if ema else ts.model, batch, None)


def place(values: nnx.State, shardings: nnx.State) -> nnx.State:
    """Copy host or local arrays onto their shardings; with several processes, each builds
    only the shards its own devices hold (the values must be the same in every process)."""
    if jax.process_count() == 1:
        return jax.device_put(values, shardings)

    def one(x: jax.Array, sharding: NamedSharding) -> jax.Array:
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = np.asarray(jax.random.key_data(x))
            placed = jax.make_array_from_callback(data.shape, sharding, lambda i: data[i])
            return jax.random.wrap_key_data(placed, impl=jax.random.key_impl(x))
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    return jax.tree.map(one, values, shardings)


def batch_sharding(rules: Rules, mesh: Mesh) -> NamedSharding:
    """Where a (batch, length) token array goes: rows on the rule set's `batch` axes."""
    axes = rules.candidates("batch", "batch")
    return NamedSharding(mesh, P(axes[0] if axes else None, None))


@dataclasses.dataclass
class Trainer:
    """A train state laid out by a rule set on a mesh, with its compiled steps."""

    graphdef: nnx.GraphDef
    state: nnx.State
    layout: Layout
    batch: NamedSharding
    step: Callable[[nnx.State, jax.Array], tuple[nnx.State, jax.Array]]
    evaluate: Callable[[nnx.State, jax.Array], jax.Array]
    evaluate_ema: Callable[[nnx.State, jax.Array], jax.Array]
    micro_batches: int = 1
    compiled: jax.stages.Compiled | None = None

    @classmethod
    def create(
        cls, state: TrainState, rules: Rules, mesh: Mesh, *, micro_batches: int = 1,
        dropout: bool = True, grads_fn: GradsFn = loss_and_grads,
    ) -> Trainer:  # fmt: skip
        """Lay `state` out by `rules` on `mesh` (copying it there) and jit its steps.

        `grads_fn` computes the loss and gradients: by default the compiler partitions
        `loss_and_grads`; `nnxscale.fsdp` offers a hand-written one.
        """
        graphdef, values = nnx.split(state)
        return cls.from_split(
            graphdef, values, rules, mesh, micro_batches=micro_batches, dropout=dropout,
            grads_fn=grads_fn,
        )  # fmt: skip

    @classmethod
    def from_split(
        cls, graphdef: nnx.GraphDef, values: nnx.State, rules: Rules, mesh: Mesh, *,
        micro_batches: int = 1, dropout: bool = True, grads_fn: GradsFn = loss_and_grads,
    ) -> Trainer:  # fmt: skip
        """A trainer for a split train state: placed by `rules` on `mesh` (no copy if it is)."""
        layout = resolve(values, rules, mesh)
        shardings = layout.shardings()
        batch = batch_sharding(rules, mesh)
        scalar = NamedSharding(mesh, P())
        options = {"micro_batches": micro_batches, "dropout": dropout, "grads_fn": grads_fn}
        step = jax.jit(
            partial(train_step, graphdef, **options),
            in_shardings=(shardings, batch), out_shardings=(shardings, scalar), donate_argnums=0,
        )  # fmt: skip
        evaluate = {
            ema: jax.jit(
                partial(eval_loss, graphdef, ema=ema),
                in_shardings=(shardings, batch),
                out_shardings=scalar,
            )
            for ema in (False, True)
        }
        placed = place(values, shardings)
        return cls(
            graphdef, placed, layout, batch, step, evaluate[False], evaluate[True], micro_batches
        )

    def train(self, batches: Callable[[int, NamedSharding], jax.Array], steps: int) -> list[float]:
        """Run `steps` steps on batches[step0 ...]; returns the losses."""
        first = int(self.step_count())
        losses = []
        for step in range(first, first + steps):
            tokens = batches(step, self.batch)
            self.state, loss = self.compile(tokens)(self.state, tokens)
            losses.append(float(loss))
        return losses

    def time_steps(
        self, batches: Callable[[int, NamedSharding], jax.Array], steps: int, first: int
    ) -> list[float]:
        """Wall seconds of each of `steps` steps on batches first, first + 1, ... (data ready)."""
        times = []
        for step in range(first, first + steps):
            tokens = jax.block_until_ready(batches(step, self.batch))
            compiled = self.compile(tokens)
            start = time.perf_counter()
            self.state, loss = compiled(self.state, tokens)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - start)
        return times

    def compile(self, tokens: jax.Array) -> jax.stages.Compiled:
        """The step compiled for batches shaped like `tokens`: once, for running and analysis."""
        if self.compiled is None:
            rows = tokens.shape[0] // self.micro_batches
            check_batch_splits(rows, self.batch, f"each of {self.micro_batches} micro-batches")
            self.compiled = self.step.lower(self.state, tokens).compile()
        return self.compiled

    def step_count(self) -> int:
        """Optimizer steps taken so far."""
        return int(self.state["optimizer"]["step"][...])

    def model(self) -> Transformer:
        """The model, with its current (sharded) weights."""
        return nnx.merge(self.graphdef, self.state).model
