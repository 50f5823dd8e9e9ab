"""A pipeline executor: a schedule from `nnxscale.schedules` run with `jax.shard_map` and ppermute.

The mesh has a `stage` axis (and optionally an `fsdp` axis inside each stage). Device `d` of
`stage` holds model stages `d, d + p, ...` (one per virtual stage) of the stacked blocks; the
embeddings and head are replicated over `stage` (split over `fsdp` if there is one), and only
the first and last model stage use them. The schedule is simulated with unit task costs into a
table of clock ticks that names, for every tick and device, the branch to run (the task's kind
and its stage's role: first, middle, last), the micro-batch, the virtual stage, the buffer
slots to read, and the slots where that tick's arriving messages go. Every tick, each device
runs its branch with `lax.switch` (an XLA conditional: each device computes only its own pass,
the embedding only on the first stage, the head and loss only on the last), then every device
sends its output forward and its input gradient backward with `ppermute`. A backward pass
recomputes its stage from the saved stage input; a zero-bubble schedule's B computes only the
input gradient, its W only the weight gradient, each recomputing the stage. The buffers hold
as many stage inputs and output gradients as the tick table keeps alive at once. With `fsdp`,
each device gathers its stage's weights once per step, before the ticks, and the gradients
summed over the ticks are reduce-scattered once, after them (autodiff's transpose of that
gather).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from nnxscale.analysis.comm import gather_tree
from nnxscale.analysis.hlo import branch_work
from nnxscale.core.trees import place
from nnxscale.model.losses import GradsFn
from nnxscale.model.transformer import Transformer
from nnxscale.parallelism.schedules import (
    BACKWARD,
    FORWARD,
    WEIGHTS,
    Schedule,
    ScheduleError,
    Task,
    simulate,
    split_layers,
)
from nnxscale.placement.catalogue import FSDP_AXIS, PP, PP_FSDP, STAGE
from nnxscale.placement.layout import resolve
from nnxscale.placement.mesh import make_mesh
from nnxscale.placement.rounds import group_layers, layer_rounds
from nnxscale.placement.rules import Rules

IDLE = 0
"""Branch 0 of every tick table: nothing to compute this tick."""

SOURCES = (-1, 1, 0)
"""Where a value a device receives comes from, as the sender's device minus its own: the
previous device (-1: the forwards of a looped schedule, around the ring), the next one (1:
its gradients, and the forwards of a V's second chunk), or itself (0: where a V turns)."""


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


def on_layers(fn: Callable[..., jax.Array], state: nnx.State, *more: nnx.State) -> nnx.State:
    """`fn` applied to the stacked layers' arrays (under `blocks`); the other arrays kept."""

    def each(path: tuple, x: jax.Array, *ys: jax.Array) -> jax.Array:
        return fn(x, *ys) if path[0].key == "blocks" else x

    return jax.tree_util.tree_map_with_path(each, state, *more)


def placed(model: Transformer, mesh: Mesh, virtual: int = 1) -> Transformer:
    """`model` with its arrays moved into the layout the executor expects on `mesh`, once, not
    every step: by `rules_for(mesh)`, with `virtual` stages per device the stacked layers held
    in `virtual` rounds (`group_layers`), whose layer dimension `stage` splits, so that each
    device holds one run of layers per round: its stages d, d + p, ... The layers stay in the
    model's order, and the model runs them as it would (`Transformer.run_blocks`)."""
    split_layers(model.cfg.layers, mesh.shape[STAGE] * virtual)  # raises if they do not divide
    graphdef, state = nnx.split(model)
    state = group_layers(state, virtual)
    return nnx.merge(graphdef, place(state, resolve(state, rules_for(mesh), mesh).shardings()))


@dataclasses.dataclass(frozen=True)
class Branch:
    """What a tick computes: a task kind on a stage with a role (first and/or last stage)."""

    kind: str  # FORWARD, BACKWARD or WEIGHTS
    first: bool
    last: bool
    split: bool  # BACKWARD is the input gradient alone (a zero-bubble schedule)

    @classmethod
    def of(cls, task: Task, schedule: Schedule) -> Branch:
        """The branch that runs `task` of `schedule`."""
        last = schedule.stages - 1
        return cls(task.kind, task.stage == 0, task.stage == last, schedule.split)

    def __str__(self) -> str:
        role = {(True, True): "only", (True, False): "first", (False, True): "last"}
        return f"{self.kind}{'(input)' if self.split and self.kind == BACKWARD else ''}" + (
            f" {role.get((self.first, self.last), 'middle')}"
        )


@dataclasses.dataclass(frozen=True)
class Ticks:
    """The executor's program as data: per clock tick (rows) and device (columns), the branch
    to run, its micro-batch and virtual stage, the slots it reads, and where arrivals go."""

    branches: tuple[Branch, ...]  # branch i + 1 of the switch; 0 is IDLE
    branch: np.ndarray
    micro: np.ndarray
    chunk: np.ndarray  # the virtual stage on this device, 0 .. v - 1
    x_slot: np.ndarray  # the stage input read
    g_slot: np.ndarray  # the output gradient read
    x_to: np.ndarray  # per source (SOURCES), slot of the input arriving at the end of the
    g_to: np.ndarray  # tick, -1 if none; the same for output gradients
    x_slots: int  # stage inputs held at most at once, on any device
    g_slots: int  # output gradients held at most at once, on any device
    placement: str  # the schedule's: "looped" or "v"

    @property
    def count(self) -> int:
        """Clock ticks in one step."""
        return self.branch.shape[0]

    def rows(self) -> tuple[np.ndarray, ...]:
        """The per-tick arrays the executor scans over, in `tick`'s order."""
        return (self.branch, self.micro, self.chunk, self.x_slot, self.g_slot, self.x_to, self.g_to)

    def idle_share(self) -> float:
        """Share of device ticks with nothing to compute: the bubble with unit task costs."""
        return float(np.mean(self.branch == IDLE))


def _slots(lives: Sequence[tuple[int, int, int]], devices: int) -> tuple[dict, int]:
    """Slot per (device, write tick, last read tick): greedy interval colouring per device.

    A value is written at the end of its write tick and read up to its last read tick; a slot
    freed by a read can be written at the end of that same tick.
    """
    slot, count = {}, 0
    for d in range(devices):
        free_at: list[int] = []  # per slot, the tick after which it can be written again
        for life in sorted((li for li in lives if li[0] == d), key=lambda li: li[1]):
            _, write, last = life
            reuse = next((k for k, t in enumerate(free_at) if t <= write), None)
            if reuse is None:
                reuse = len(free_at)
                free_at.append(0)
            free_at[reuse] = last
            slot[life] = reuse
        count = max(count, len(free_at))
    return slot, count


def tick_table(schedule: Schedule) -> Ticks:
    """The schedule simulated with one tick per task, with its buffer slots assigned."""
    timeline = simulate(schedule, cost=lambda task: 1.0)
    ticks, p, stages = int(timeline.makespan), schedule.devices, schedule.stages
    at: dict[Task, int] = {t: int(start) for runs in timeline.runs for t, start, _ in runs}
    release = WEIGHTS if schedule.split else BACKWARD
    device = schedule.device_of
    x_lives = {  # stage input of (micro, stage): sent by the previous stage's forward
        (i, s): (device(s), at[Task(FORWARD, i, s - 1)], at[Task(release, i, s)])
        for i in range(schedule.micro_batches)
        for s in range(1, stages)
    }
    g_lives = {  # output gradient of (micro, stage): sent by the next stage's backward
        (i, s): (device(s), at[Task(BACKWARD, i, s + 1)], at[Task(release, i, s)])
        for i in range(schedule.micro_batches)
        for s in range(stages - 1)
    }
    x_slot_of, x_slots = _slots(list(x_lives.values()), p)
    g_slot_of, g_slots = _slots(list(g_lives.values()), p)
    roles = {task: Branch.of(task, schedule) for task in at}
    kinds = (FORWARD, BACKWARD, WEIGHTS)
    branches = sorted(set(roles.values()), key=lambda b: (kinds.index(b.kind), b.last, not b.first))
    columns = {
        name: np.zeros((ticks, p), np.int32)
        for name in ("branch", "micro", "chunk", "x_slot", "g_slot")
    }
    sources = len(SOURCES)
    x_to, g_to = (np.full((ticks, p, sources), -1, np.int32) for _ in range(2))
    for task, t in at.items():
        d = device(task.stage)
        columns["branch"][t, d] = branches.index(roles[task]) + 1
        columns["micro"][t, d], columns["chunk"][t, d] = task.micro, task.stage // p
        key = (task.micro, task.stage)
        if key in x_lives:
            columns["x_slot"][t, d] = x_slot_of[x_lives[key]]
        if key in g_lives:
            columns["g_slot"][t, d] = g_slot_of[g_lives[key]]

    def source(sender: int, receiver: int, looped: int) -> int:
        """A V's hand-overs go to a neighbour or stay; a looped schedule's inputs come from
        the previous device and its gradients from the next, around a ring (`looped`)."""
        return SOURCES.index(sender - receiver if schedule.placement == "v" else looped)

    for (_, s), life in x_lives.items():
        x_to[life[1], life[0], source(device(s - 1), life[0], -1)] = x_slot_of[life]
    for (_, s), life in g_lives.items():
        g_to[life[1], life[0], source(device(s + 1), life[0], 1)] = g_slot_of[life]
    return Ticks(
        tuple(branches),
        **columns,
        x_to=x_to,
        g_to=g_to,
        x_slots=max(1, x_slots),
        g_slots=max(1, g_slots),
        placement=schedule.placement,
    )


def branch_costs(schedule: Schedule, program: object) -> Callable[[Task], int]:
    """Each task's cost in matmul FLOPs, read off the compiled program that runs `schedule`:
    the work of the branch its tick runs, so a simulation can weigh tasks as compiled."""
    work = branch_work(program)[1:]  # branch 0 is the idle tick
    flops = {b: w.flops for b, w in zip(tick_table(schedule).branches, work, strict=True)}
    return lambda task: flops[Branch.of(task, schedule)]


def _run_layers(blocks: nnx.Module, x: jax.Array) -> jax.Array:
    """The stage's stacked layers, whole weights (nothing to gather), in a `lax.scan` unrolled:
    a stage holds a few layers, and XLA compiles them faster unrolled than as a loop."""
    graphdef, weights = nnx.split(blocks)
    return jax.lax.scan(
        lambda h, w: (nnx.merge(graphdef, w)(h, None), None), x, weights, unroll=True
    )[0]


def _stage(
    params: nnx.State,
    x: jax.Array,
    tokens: jax.Array,
    *,
    branch: Branch,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    scale: float,
) -> tuple[jax.Array, jax.Array]:
    """One model stage on one micro-batch: (its output, its share of the loss).

    Only the first stage embeds the tokens (its `x` is unused) and only the last runs the head
    and the loss; the others return a zero loss without computing one.
    """
    model: Transformer = nnx.merge(graphdef, params, rest)
    y = _run_layers(model.blocks, model.embed_tokens(tokens[:, :-1]) if branch.first else x)
    if not branch.last:
        return y, jnp.zeros((), jnp.float32)
    return y, model.head_loss(y, tokens[:, 1:], None) * scale


def _one_run(params: nnx.State, virtual: int) -> nnx.State:
    """This device's stacked layers, held as (rounds, layers, ...), as one run of layers: its
    stages side by side (a reshape of its own shards, nothing moves)."""
    if virtual == 1:
        return params
    return on_layers(lambda w: w.reshape(-1, *w.shape[2:]), params)


def _chunk(params: nnx.State, chunk: jax.Array, virtual: int) -> nnx.State:
    """The weights of this device's virtual stage `chunk` (all of its layers when v = 1), from
    its layers as one run (`_one_run`)."""
    if virtual == 1:
        return params
    size = len(jax.tree.leaves(params["blocks"])[0]) // virtual
    return on_layers(lambda w: jax.lax.dynamic_slice_in_dim(w, chunk * size, size), params)


def _add_chunk(grads: nnx.State, g: nnx.State, chunk: jax.Array, virtual: int) -> nnx.State:
    """`grads` plus `g`, the gradients of virtual stage `chunk`'s weights."""
    if virtual == 1:
        return jax.tree.map(jnp.add, grads, g)
    size = len(jax.tree.leaves(g["blocks"])[0])

    def add(whole: jax.Array, part: jax.Array) -> jax.Array:
        now = jax.lax.dynamic_slice_in_dim(whole, chunk * size, size)
        return jax.lax.dynamic_update_slice_in_dim(whole, now + part, chunk * size, 0)

    def each(path: tuple, whole: jax.Array, part: jax.Array) -> jax.Array:
        return add(whole, part) if path[0].key == "blocks" else whole + part

    return jax.tree_util.tree_map_with_path(each, grads, g)


Carry = tuple[jax.Array, jax.Array, nnx.State, jax.Array]
"""From tick to tick: saved stage inputs, received output gradients, gradients, loss."""


def run_branch(
    branch: Branch,
    x: jax.Array,
    g: jax.Array,
    tokens: jax.Array,
    chunk: jax.Array,
    grads: nnx.State,
    loss: jax.Array,
    *,
    stage: Callable[..., tuple[jax.Array, jax.Array]],
    params: nnx.State,
    virtual: int,
) -> tuple[jax.Array, jax.Array, nnx.State, jax.Array]:
    """One branch of the switch: (output to send on, input gradient to send back, grads, loss).

    A backward pass recomputes the stage from its saved input `x` and pulls back the output
    gradient `g` (the loss's on the last stage); B alone pulls back to the input, W alone to
    the weights. What a branch does not need it does not compute.
    """
    fn = functools.partial(stage, branch=branch)
    weights = _chunk(params, chunk, virtual)
    nothing = jnp.zeros_like(x)
    if branch.kind == FORWARD:
        y, part = fn(weights, x, tokens)
        return y, nothing, grads, loss + part

    def pulled(w: nnx.State, x_: jax.Array) -> jax.Array:  # what the gradient flows back from
        return fn(w, x_, tokens)[1] if branch.last else fn(w, x_, tokens)[0]

    seed = jnp.ones_like(loss) if branch.last else g
    to_input = branch.kind == BACKWARD and not branch.first
    to_weights = branch.kind == WEIGHTS or not branch.split
    if to_input and to_weights:
        g_w, g_x = jax.vjp(pulled, weights, x)[1](seed)
    elif to_input:
        (g_x,), g_w = jax.vjp(lambda x_: pulled(weights, x_), x)[1](seed), None
    elif to_weights:
        (g_w,), g_x = jax.vjp(lambda w: pulled(w, x), weights)[1](seed), nothing
    else:  # B on the first stage: there is no input gradient to compute
        g_w, g_x = None, nothing
    return nothing, g_x, grads if g_w is None else _add_chunk(grads, g_w, chunk, virtual), loss


def receive(buffer: jax.Array, value: jax.Array, slot: jax.Array) -> jax.Array:
    """`buffer` with `value` in `slot`, or unchanged if the tick table says nothing arrives (-1)."""
    index = jnp.maximum(slot, 0)
    return buffer.at[index].set(jnp.where(slot >= 0, value, buffer[index]))


def tick(
    carry: Carry,
    row: tuple[jax.Array, ...],
    *,
    d: jax.Array,
    branches: Sequence[Callable[..., tuple]],
    tokens: jax.Array,
    placement: str,
    ring: bool,
) -> tuple[Carry, None]:
    """One clock tick on device `d`: run its branch with `lax.switch`, then the two hand-overs."""
    xs, gs, grads, loss = carry
    branch, micro, chunk, x_slot, g_slot, x_to, g_to = (r[d] for r in row)  # this device's row
    # Each device runs only the branch the table names: a conditional, not a select.
    y, g_x, grads, loss = jax.lax.switch(
        branch, branches, xs[x_slot], gs[g_slot], tokens[micro], chunk, grads, loss
    )
    # Hand-overs: outputs to the next stage, input gradients to the previous one (around a
    # ring when a device holds several stages); the table says which arrivals to keep.
    p = jax.lax.axis_size(STAGE)
    ahead = [(s, (s + 1) % p) for s in range(p if ring else p - 1)]
    back = [(b, a) for a, b in ahead]
    if placement == "v":  # from either neighbour, and its own where the V turns
        for source, value in enumerate(_sent(y, ahead, back)):
            xs = receive(xs, value, x_to[source])
        for source, value in enumerate(_sent(g_x, ahead, back)):
            gs = receive(gs, value, g_to[source])
    else:
        xs = receive(xs, jax.lax.ppermute(y, STAGE, ahead), x_to[SOURCES.index(-1)])
        gs = receive(gs, jax.lax.ppermute(g_x, STAGE, back), g_to[SOURCES.index(1)])
    return (xs, gs, grads, loss), None


def _sent(value: jax.Array, ahead: list, back: list) -> tuple[jax.Array, ...]:
    """What arrives from each of `SOURCES`: `value` sent one device on and one back (both are
    sent, as one program runs on every device), and this device's own `value`."""
    return jax.lax.ppermute(value, STAGE, ahead), jax.lax.ppermute(value, STAGE, back), value


def mirrored(params: nnx.State) -> nnx.State:
    """This device's layers with their second round swapped with the mirror device's (d and
    p - 1 - d): the looped layout's stage p + d becomes the V's stage 2p - 1 - d. The weights
    stay placed as for any looped schedule; a V pays a permute of half its layers a step."""
    p = jax.lax.axis_size(STAGE)
    mirror = [(d, p - 1 - d) for d in range(p)]
    return on_layers(lambda w: w.at[1].set(jax.lax.ppermute(w[1], STAGE, mirror)), params)


def stage_weights(shards: nnx.State, specs: nnx.State, inner: str | None) -> nnx.State:
    """This stage's weights: marked as varying over `stage`, then gathered over `fsdp`."""
    on_every_stage = jax.tree.map(lambda s: STAGE not in tuple(s), specs)
    shards = jax.tree.map(
        lambda x, r: jax.lax.pcast(x, STAGE, to="varying") if r else x, shards, on_every_stage
    )
    return gather_tree(shards, specs, inner) if inner else shards


def per_device(
    shards: nnx.State,
    tokens: jax.Array,
    *,
    stage: Callable[..., tuple[jax.Array, jax.Array]],
    specs: nnx.State,
    inner: str | None,
    ticks: Ticks,
    virtual: int,
) -> tuple[jax.Array, nnx.State]:
    """One device's step: gather its stage's weights once, scan the ticks, sum loss and grads."""
    d = jax.lax.axis_index(STAGE)
    # Once per step, before the ticks; the transposes of `stage_weights` run once after them, on
    # the summed gradients: reduce-scatter over `fsdp`, then the shards of the arrays every
    # stage holds (embeddings, head) summed over `stage`.
    v_shaped = ticks.placement == "v"

    def local(s: nnx.State) -> nnx.State:
        weights = stage_weights(s, specs, inner)
        return _one_run(mirrored(weights) if v_shaped else weights, virtual)

    params, to_shards = jax.vjp(local, shards)
    first = Branch(FORWARD, True, False, False)
    shape = jax.eval_shape(lambda: stage(params, None, tokens[0], branch=first)[0])
    varying = tuple(a for a in (STAGE, inner) if a)
    zeros = jax.lax.pcast(jnp.zeros(shape.shape, shape.dtype), varying, to="varying")
    loss = jax.lax.pcast(jnp.zeros((), jnp.float32), varying, to="varying")
    run = functools.partial(run_branch, stage=stage, params=params, virtual=virtual)

    def idle(*args: jax.Array) -> tuple[jax.Array, jax.Array, nnx.State, jax.Array]:
        return zeros, zeros, args[-2], args[-1]

    branches = [idle] + [functools.partial(run, b) for b in ticks.branches]
    start = (
        jnp.stack([zeros] * ticks.x_slots),
        jnp.stack([zeros] * ticks.g_slots),
        jax.tree.map(jnp.zeros_like, params),
        loss,
    )
    step = functools.partial(
        tick,
        d=d,
        branches=branches,
        tokens=tokens,
        placement=ticks.placement,
        ring=virtual > 1 and ticks.placement != "v",  # a V never wraps around
    )
    (_, _, grads, loss), _ = jax.lax.scan(step, start, tuple(map(jnp.asarray, ticks.rows())))
    axes = (STAGE, inner) if inner else STAGE
    return jax.lax.psum(loss, axes), to_shards(grads)[0]


def _check(model: Transformer, batch: jax.Array, schedule: Schedule, mesh: Mesh) -> None:
    """Refuse, with the reason, a pipeline the executor cannot run, before anything is traced."""
    if not model.cfg.scan_layers:
        raise ValueError("the executor splits stacked layers: use Config(scan_layers=True)")
    p, m = mesh.shape[STAGE], schedule.micro_batches
    if schedule.devices != p:
        raise ScheduleError(f"the schedule has {schedule.devices} stages, the mesh {p}")
    split_layers(model.cfg.layers, schedule.stages)  # raises if the layers do not divide
    rounds = layer_rounds(nnx.state(model))
    if rounds != schedule.virtual:
        raise ScheduleError(
            f"the schedule runs {schedule.virtual} virtual stage(s) per device, and the model "
            f"holds its layers in {rounds} round(s): place the model with "
            f"nnxscale.pipeline.placed(model, mesh, virtual={schedule.virtual})"
        )
    if batch.shape[0] % m:
        raise ScheduleError(f"a batch of {batch.shape[0]} rows cannot make {m} micro-batches")


def loss_and_grads(
    model: Transformer, batch: jax.Array, schedule: Schedule, mesh: Mesh
) -> tuple[jax.Array, nnx.State]:
    """Mean loss and gradients of `model` on `batch`, pipelined by `schedule` over `stage`.

    The parameters must be laid out as `placed(model, mesh, schedule.virtual)` leaves them:
    by `rules_for(mesh)` (`PP`, or `PP_FSDP` on a mesh with `stage` and `fsdp`), the layers
    held in `schedule.virtual` rounds; the gradients come back in the same layout
    (`group_layers(grads, 1)` gives the plain stacks).
    """
    _check(model, batch, schedule, mesh)
    m = schedule.micro_batches
    inner = FSDP_AXIS if FSDP_AXIS in mesh.axis_names else None
    rows = mesh.shape[FSDP_AXIS] if inner else 1
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = resolve(params, rules_for(mesh), mesh).specs
    stage = functools.partial(_stage, graphdef=graphdef, rest=rest, scale=1.0 / (m * rows))
    program = functools.partial(
        per_device,
        stage=stage,
        specs=specs,
        inner=inner,
        ticks=tick_table(schedule),
        virtual=schedule.virtual,
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
