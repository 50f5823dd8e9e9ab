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
import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from nnxscale.core.trees import place
from nnxscale.model.config import TINY, Config
from nnxscale.model.transformer import create
from nnxscale.placement.compiling import compile_under, two_at_a_time
from nnxscale.placement.init import compile_init
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.rules import Rules, strategy_mesh
from nnxscale.train.checks import (
    batch_kind,
    check_axis_type,
    check_batch,
    check_loss,
    check_same_kind,
    check_tokens,
)
from nnxscale.train.state import (
    NonFiniteError,
    StateLostError,
    TrainOptions,
    TrainState,
    adamw,
    check_is_optimizer,
    check_model,
    check_optimizer,
    config_record,
    model_config,
    new_run,
)
from nnxscale.train.step import jitted, placed_on_many


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
        check_is_optimizer(tx)
        if not callable(model):
            check_model(model)
        if isinstance(model, nnx.Module):
            # variables that Flax placed as it created them need their mesh; entering it
            # otherwise would recompile every eager operation of the state's creation
            context = jax.set_mesh(mesh) if placed_on_many(model) else contextlib.nullcontext()
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
        built = nnx.merge(graphdef, values).model
        check_optimizer(tx, nnx.state(built, nnx.Param))  # before a step could use it
        config = config if config is not None else model_config(built)
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
        step, *evaluate = jitted(graphdef, values, layout, options)
        placed = place(values, layout.shardings())
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
            raise StateLostError.after(failure)

    def nonfinite(self, step: int) -> None:
        """After step `step` skipped its update (its loss, a gradient or an update was not
        finite): note it in `skipped`, or raise NonFiniteError, as the options' `nonfinite`
        says."""
        self.skipped.append(step)
        if self.options.nonfinite == "raise":
            raise NonFiniteError.at(step)

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
            self.programs[kind] = compile_under(
                self.step,
                self.layout,
                self.state,
                batch,
                activations=self.options.activations,
                compiler_options=self.options.compiler_options,
            )
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


def compile_all(jobs: list[tuple[Trainer, Any]]) -> list[jax.stages.Compiled]:
    """Each trainer's step compiled for its batch, two at a time (`two_at_a_time`)."""
    return two_at_a_time([partial(trainer.compile, batch) for trainer, batch in jobs])
