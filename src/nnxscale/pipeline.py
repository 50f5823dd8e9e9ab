"""A pipeline executor: a schedule from `nnxscale.schedules` run with `jax.shard_map` and ppermute.

The mesh has a `stage` axis (and optionally an `fsdp` axis inside each stage). Device `d` of
`stage` holds layers `d L/p .. (d+1) L/p - 1` of the stacked blocks; the embeddings and head
are replicated over `stage` (split over `fsdp` if there is one), and only the first and last
stage use them. The schedule is simulated with unit task costs into a table of clock ticks;
every tick, each device runs its task (a forward pass of a micro-batch through its layers, or
a backward pass that recomputes that forward from the saved stage input), then every device
sends its output forward and its input gradient backward with `ppermute`. All devices run the
same program; a `lax.switch` on the task (an XLA conditional) has each compute only its own
pass. The buffers for saved inputs and messages hold as many micro-batches as the schedule keeps in
flight: m for GPipe, p for 1F1B. With `fsdp`, each device gathers its stage's weights once
per step, before the ticks, and the gradients summed over the ticks are reduce-scattered
once, after them (autodiff's transpose of that gather).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from nnxscale.comm import gather_tree
from nnxscale.layout import resolve
from nnxscale.losses import GradsFn, cross_entropy
from nnxscale.mesh import make_mesh
from nnxscale.model import Transformer
from nnxscale.rules import FSDP_AXIS, PP, PP_FSDP, STAGE, Rules
from nnxscale.schedules import FORWARD, Schedule, ScheduleError, simulate, split_layers
from nnxscale.trees import place

IDLE, RUN_FORWARD, RUN_BACKWARD = 0, 1, 2


def pipeline_mesh(stages: int, fsdp_size: int = 0) -> Mesh:
    """A mesh of `stages` devices on `stage` (times `fsdp_size` on `fsdp` if given), Auto axes."""
    shape, names = ((stages, fsdp_size), (STAGE, FSDP_AXIS)) if fsdp_size else ((stages,), (STAGE,))
    count = math.prod(shape)
    if count > jax.device_count():
        raise ScheduleError(
            f"a {dict(zip(names, shape, strict=True))} pipeline needs {count} devices and "
            f"there are {jax.device_count()}: use fewer stages or a smaller fsdp axis."
        )
    return make_mesh(shape, names, devices=jax.devices()[:count])


def rules_for(mesh: Mesh) -> Rules:
    """The layout the executor expects on `mesh`: `PP_FSDP` if it has an `fsdp` axis, else `PP`."""
    return PP_FSDP if FSDP_AXIS in mesh.axis_names else PP


def placed(model: Transformer, mesh: Mesh) -> Transformer:
    """`model` with its arrays moved into the layout the executor expects on `mesh`."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, place(state, resolve(state, rules_for(mesh), mesh).shardings()))


def tick_table(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """(what, micro-batch) for every clock tick and device, with one tick per task."""
    if schedule.virtual != 1:
        raise ScheduleError("the executor runs one stage per device: use GPipe or 1F1B (v=1)")
    timeline = simulate(schedule, cost=lambda task: 1.0)
    ticks = int(timeline.makespan)
    what = np.full((ticks, schedule.devices), IDLE, np.int32)
    micro = np.zeros((ticks, schedule.devices), np.int32)
    for d, runs in enumerate(timeline.runs):
        for task, start, _ in runs:
            what[int(start), d] = RUN_FORWARD if task.kind == FORWARD else RUN_BACKWARD
            micro[int(start), d] = task.micro
    return what, micro


def _run_layers(blocks: nnx.Module, x: jax.Array) -> jax.Array:
    """The stage's stacked layers in a `lax.scan` (whole weights here; nothing to gather)."""
    graphdef, weights = nnx.split(blocks)
    return jax.lax.scan(lambda h, w: (nnx.merge(graphdef, w)(h, None), None), x, weights)[0]


def _stage_loss(
    params: nnx.State,
    x_in: jax.Array,
    tokens: jax.Array,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """This device's stage on one micro-batch: (its output, its share of the loss if last)."""
    stage, stages = jax.lax.axis_index(STAGE), jax.lax.axis_size(STAGE)
    model: Transformer = nnx.merge(graphdef, params, rest)
    x = jnp.where(stage == 0, model.embed_tokens(tokens[:, :-1]), x_in)
    y = _run_layers(model.blocks, x)
    loss = cross_entropy(model.unembed(y), tokens[:, 1:]) * scale
    return y, jnp.where(stage == stages - 1, loss, 0.0)


StageFn = Callable[[nnx.State, jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
"""One device's stage: (its weights, its input, the micro-batch's tokens) -> (output, loss)."""


def _check(model: Transformer, batch: jax.Array, schedule: Schedule, mesh: Mesh) -> None:
    """Refuse, with the reason, a pipeline the executor cannot run, before anything is traced."""
    if not model.cfg.scan_layers:
        raise ValueError("the executor splits stacked layers: use Config(scan_layers=True)")
    if model.cfg.experts:
        raise ValueError(
            "the pipeline executor would drop the experts' load-balancing loss: train a "
            "mixture of experts with the rule sets (nx.EP, nx.FSDP_EP)"
        )
    p, m = mesh.shape[STAGE], schedule.micro_batches
    if schedule.devices != p:
        raise ScheduleError(f"the schedule has {schedule.devices} stages, the mesh {p}")
    split_layers(model.cfg.layers, p)  # raises if the layers do not divide into stages
    if batch.shape[0] % m:
        raise ScheduleError(f"a batch of {batch.shape[0]} rows cannot make {m} micro-batches")


def stage_weights(shards: nnx.State, specs: nnx.State, inner: str | None) -> nnx.State:
    """This stage's weights: marked as varying over `stage`, then gathered over `fsdp`."""
    on_every_stage = jax.tree.map(lambda s: STAGE not in tuple(s), specs)
    shards = jax.tree.map(
        lambda x, r: jax.lax.pcast(x, STAGE, to="varying") if r else x, shards, on_every_stage
    )
    return gather_tree(shards, specs, inner) if inner else shards


def receive(buffer: jax.Array, value: jax.Array, index: jax.Array, valid: jax.Array) -> jax.Array:
    """`buffer` with `value` in micro-batch `index`'s slot if a task sent it (`valid`)."""
    slot = index % buffer.shape[0]
    return buffer.at[slot].set(jnp.where(valid, value, buffer[slot]))


Carry = tuple[jax.Array, jax.Array, jax.Array, nnx.State, jax.Array]
"""From tick to tick: received inputs, received input gradients, saved inputs, gradients, loss."""


def tick(
    carry: Carry,
    row: tuple[jax.Array, jax.Array],
    *,
    d: jax.Array,
    stage: StageFn,
    params: nnx.State,
    tokens: jax.Array,
    zeros: jax.Array,
) -> tuple[Carry, None]:
    """One clock tick on device `d`: run its task with `lax.switch`, then the two hand-overs."""
    inputs, grads_in, saved, grads, loss = carry
    task, i = row[0][d], row[1][d]  # this device's task at this tick
    forward, backward, slot = task == RUN_FORWARD, task == RUN_BACKWARD, i % saved.shape[0]

    def idle():
        return zeros, loss, grads, zeros

    def run_forward():  # micro-batch i through the stage; its input is kept below
        y, part = stage(params, inputs[slot], tokens[i])
        return y, loss + part, grads, zeros

    def run_backward():  # recompute the stage from its saved input, then pull back
        _, pullback = jax.vjp(lambda p_, x_: stage(p_, x_, tokens[i]), params, saved[slot])
        g_params, g_x = pullback((grads_in[slot], jnp.ones_like(loss)))
        return zeros, loss, jax.tree.map(jnp.add, grads, g_params), g_x

    # Each device runs only the branch its task names: a conditional, not a select.
    y, loss, grads, g_x = jax.lax.switch(task, (idle, run_forward, run_backward))
    saved = saved.at[slot].set(jnp.where(forward, inputs[slot], saved[slot]))
    # Hand-overs: outputs to the next stage, input gradients to the previous one.
    p = jax.lax.axis_size(STAGE)
    ahead, back = [(s, s + 1) for s in range(p - 1)], [(s + 1, s) for s in range(p - 1)]
    sent = [jax.lax.ppermute(v, STAGE, ahead) for v in (y, i, forward)]
    inputs = receive(inputs, *sent)
    sent = [jax.lax.ppermute(v, STAGE, back) for v in (g_x, i, backward)]
    grads_in = receive(grads_in, *sent)
    return (inputs, grads_in, saved, grads, loss), None


def per_device(
    shards: nnx.State,
    tokens: jax.Array,
    *,
    stage: StageFn,
    specs: nnx.State,
    inner: str | None,
    table: tuple[np.ndarray, np.ndarray],
    slots: int,
) -> tuple[jax.Array, nnx.State]:
    """One device's step: gather its stage's weights once, scan the ticks, sum loss and grads."""
    d = jax.lax.axis_index(STAGE)
    # Once per step, before the ticks; the transposes of `stage_weights` run once after them, on
    # the summed gradients: reduce-scatter over `fsdp`, then the shards of the arrays every
    # stage holds (embeddings, head) summed over `stage`.
    params, to_shards = jax.vjp(lambda s: stage_weights(s, specs, inner), shards)
    shape = jax.eval_shape(stage, params, jnp.zeros((), jnp.float32), tokens[0])[0]
    varying = tuple(a for a in (STAGE, inner) if a)
    zeros = jax.lax.pcast(jnp.zeros(shape.shape, shape.dtype), varying, to="varying")
    buffers = jnp.stack([zeros] * slots)  # stage inputs, input gradients, saved inputs
    loss = jax.lax.pcast(jnp.zeros((), jnp.float32), varying, to="varying")
    start = (buffers, buffers, buffers, jax.tree.map(jnp.zeros_like, params), loss)
    step = functools.partial(tick, d=d, stage=stage, params=params, tokens=tokens, zeros=zeros)
    (_, _, _, grads, loss), _ = jax.lax.scan(step, start, tuple(map(jnp.asarray, table)))
    axes = (STAGE, inner) if inner else STAGE
    return jax.lax.psum(loss, axes), to_shards(grads)[0]


def loss_and_grads(
    model: Transformer, batch: jax.Array, schedule: Schedule, mesh: Mesh
) -> tuple[jax.Array, nnx.State]:
    """Mean loss and gradients of `model` on `batch`, pipelined by `schedule` over `stage`.

    The parameters must be laid out by `rules_for(mesh)` (`placed` does that): `PP`, or
    `PP_FSDP` on a mesh with `stage` and `fsdp`; the gradients come back in the same layout.
    """
    _check(model, batch, schedule, mesh)
    m = schedule.micro_batches
    inner = FSDP_AXIS if FSDP_AXIS in mesh.axis_names else None
    rows = mesh.shape[FSDP_AXIS] if inner else 1
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = resolve(params, rules_for(mesh), mesh).specs
    table, slots = tick_table(schedule), max(simulate(schedule).peak_in_flight())
    stage = functools.partial(_stage_loss, graphdef=graphdef, rest=rest, scale=1.0 / (m * rows))
    program = functools.partial(
        per_device, stage=stage, specs=specs, inner=inner, table=table, slots=slots
    )
    micro_batches = batch.reshape(m, batch.shape[0] // m, batch.shape[1])
    token_spec = PartitionSpec(None, inner, None)
    return jax.shard_map(
        program, mesh=mesh, in_specs=(specs, token_spec), out_specs=(PartitionSpec(), specs)
    )(params, micro_batches)


def grads_fn(schedule: Schedule, mesh: Mesh) -> GradsFn:
    """The pipelined `loss_and_grads` as a train step's gradient function (no dropout)."""

    def grads(
        model: Transformer, batch: jax.Array, key: jax.Array | None, micro_batches: int = 1
    ) -> tuple[jax.Array, nnx.State]:
        if key is not None or micro_batches != 1:
            raise ValueError(
                "the pipeline executor cuts its own micro-batches and draws no dropout masks: "
                "use Trainer.create(..., dropout=False, micro_batches=1)"
            )
        return loss_and_grads(model, batch, schedule, mesh)

    return grads
