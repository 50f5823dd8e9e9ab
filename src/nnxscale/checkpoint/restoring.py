"""Restoring onto any mesh and rule set: the abstract target a step is read into, each
device reading its shards, verified by checksums, falling back to the newest step that
verifies. Functions of a directory's read-only view (`Stored`), which `Checkpoints` holds."""

from __future__ import annotations

import itertools
import json
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh

from nnxscale.checkpoint.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    SkippedCheckpointWarning,
)
from nnxscale.checkpoint.integrity import (
    SCHEME,
    checksums,
)
from nnxscale.checkpoint.records import (
    FALL_BACK,
    Record,
    array_index,
    check_data,
    check_matches,
    error_text,
    listing,
    restored_options,
)
from nnxscale.checkpoint.stored import Stored
from nnxscale.core.trees import shapes_of, stand_in
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.rounds import group_layers, held_in, layer_rounds
from nnxscale.placement.rules import Rules
from nnxscale.train.data import Batches
from nnxscale.train.state import (
    DESCRIBED_STEPS,
    TrainOptions,
    TrainState,
    check_optimizer,
    describe_optimizer,
    model_config,
)
from nnxscale.train.trainer import Trainer


def state_to_restore(
    record: Record,
    model: nnx.Module | Callable[[dict[str, Any] | None], nnx.Module],
    tx: optax.GradientTransformation,
) -> TrainState:
    """The train state a checkpoint restores into, from `model` (a module, of which only the
    shapes count, or a function of the recorded configuration) and `tx`."""
    if isinstance(model, nnx.Module):  # abstract arrays become stand-ins while tracing
        graphdef, values = nnx.split(model)
        structure = nnx.merge(graphdef, jax.tree.map(stand_in, values))
    else:
        structure = model(record.config)
    return TrainState(structure, tx, ema_decay=record.ema_decay)


def check_target(model: object, rules: object, mesh: object) -> None:
    """Raise a clear TypeError unless a restore is given a model, a rule set and a mesh."""
    if not isinstance(model, nnx.Module) and not callable(model):
        raise TypeError(
            f"model: expected an NNX module or a function of the recorded configuration, got "
            f"{model!r}; for the book's Transformer pass nx.Transformer.from_config."
        )
    if not isinstance(rules, Rules):
        raise TypeError(f"rules: expected a rule set such as nx.FSDP, got {rules!r}")
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh (nx.strategy_mesh), got {mesh!r}")


def trained_config(record: Record, model: nnx.Module, other: bool) -> dict[str, Any] | None:
    """The configuration the restored run trains with and records: the recorded one, which
    `model` must hold (its `cfg`), unless `other`, when it is the model's own. A function
    that builds its model ignoring the configuration it is given would otherwise train
    (another dropout, another dtype) while the next checkpoint records the old one."""
    built = model_config(model)
    if built is None or record.config is None:
        return record.config
    built = json.loads(json.dumps(built))  # tuples as lists, as the record holds them
    common = sorted(set(built) & set(record.config))  # a field added since, or an opaque record
    changed = [
        f"{name}={built[name]!r} (recorded {record.config[name]!r})"
        for name in common
        if built[name] != record.config[name]
    ]
    if not changed:
        return record.config
    if other:
        return built
    raise CheckpointMismatchError(
        f"the model built to restore step {record.step} holds {', '.join(changed)}: it would "
        "train with its own settings while the run's record kept the old ones. Build it from "
        "the recorded configuration (model=Transformer.from_config, or your own from_config), "
        "or pass other_config=True to train on with this one (the next checkpoints record it)."
    )


def check_same_optimizer(
    record: Record, tx: optax.GradientTransformation, params: Any, other: bool
) -> None:
    """Refuse to continue a run under an optimizer other than the one its record describes
    (`describe_optimizer`), unless `other`: optax keeps a learning rate or a weight decay in
    closures, so Adam's moments restore as well into AdamW, or at another rate, and the run
    would go on changed without a word. Updates compare within 1e-5 of each other: float32
    arithmetic on another backend moves them by ulps (1e-7), another setting by far more."""
    saved = record.optimizer
    if saved is None or other:
        return
    found = describe_optimizer(tx, params)
    shapes = [len(u) for u in found["updates"]] == [len(u) for u in saved["updates"]]
    if (
        found["state"] == saved["state"]
        and shapes
        and all(
            np.allclose(a, b, rtol=1e-5, atol=0, equal_nan=True)
            for a, b in zip(found["updates"], saved["updates"], strict=True)
        )
    ):
        return
    raise CheckpointMismatchError(
        f"step {record.step} was saved by an optimizer whose state holds {saved['state']} "
        f"and whose updates of a weight of 0.5 with gradient 1 at steps {DESCRIBED_STEPS} "
        f"are {saved['updates']}; this one holds {found['state']} and gives "
        f"{found['updates']}: another optimizer, or other settings (learning rate, schedule, "
        "weight decay, moment rates). Restore with the optimizer the run trained with, or "
        "pass other_optimizer=True to go on under this one."
    )


def restore_target(values: nnx.State, shardings: Any) -> nnx.State:
    """Shapes, dtypes and concrete shardings to restore into: an abstract state, no memory."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), values, shardings
    )


def chunks_read(
    chunk: Sequence[int], target: jax.Array | jax.ShapeDtypeStruct, device: int = 0
) -> list[tuple[int, ...]]:
    """The saved chunks a restore reads to fill `device`'s shard of `target`: their positions
    in the grid of `chunk`-shaped chunks (`Checkpoints.chunks`), every one the shard overlaps.

    A chunk is compressed as a whole, so it is read whole: a shard that cuts across the saved
    chunks reads more bytes than it keeps, one that the chunks tile reads exactly its own.
    """
    shape = tuple(target.shape)
    if len(chunk) != len(shape):
        raise ValueError(f"chunk {tuple(chunk)} and array {shape} differ in dimensions")
    blocks = {d.id: index for d, index in target.sharding.devices_indices_map(shape).items()}
    if device not in blocks:
        raise ValueError(f"device {device} holds no shard of the target: {sorted(blocks)} do")
    spans = []
    for part, dim, size in zip(blocks[device], shape, chunk, strict=True):
        start, stop, _ = part.indices(dim)
        spans.append(range(start // size, -(-stop // size)))
    return list(itertools.product(*spans))


def restore_state(
    stored: Stored,
    values: nnx.State,
    layout: Layout,
    step: int | None = None,
    checks: Callable[[], None] | None = None,
) -> nnx.State:
    """The saved state of `step`, for a state shaped like `values`, laid out by `layout`,
    verified against the checksums saved with it: read as the plain stacks the checkpoint
    holds (each device its shards), then held in the rounds `values` holds its layers in.
    Raises CorruptCheckpointError for a step that does not hold what was saved, and
    CheckpointMismatchError, naming the arrays, when `values` is shaped otherwise; then
    runs `checks` (of the optimizer, the configuration), before any array is read."""
    record = stored.record(step)
    step = record.step
    if record.checksum_scheme != SCHEME:
        raise CheckpointMismatchError(
            f"the checksums of step {step} were computed as {record.checksum_scheme!r}, "
            f"and this nnxscale computes them as {SCHEME!r}: restore it with the nnxscale "
            "that wrote it."
        )
    recorded = recorded_arrays(stored, record)
    shapes = shapes_of(values)
    rounds, plain = layer_rounds(shapes), group_layers(shapes, 1)
    check_matches(recorded, array_index(plain), f"checkpoint {step}")
    if checks is not None:
        checks()
    read = layout if rounds == 1 else resolve(plain, layout.rules, layout.mesh)
    target = restore_target(plain, read.shardings())
    try:
        state = stored.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )["state"]
    except Exception as error:
        raise CorruptCheckpointError(
            f"the arrays of step {step} cannot be read ({error_text(error)}): a file of its "
            "state/ is damaged or missing. " + FALL_BACK
        ) from error
    sums = checksums(state)
    wrong = sorted(path for path, saved in record.arrays.items() if sums[path] != saved[2])
    if wrong:
        raise CorruptCheckpointError(
            f"{len(wrong)} arrays of step {step} do not hold what was saved (their "
            f"checksums differ): {listing(wrong)}. A file of the step is damaged: a "
            "flipped bit, a truncated or replaced chunk. " + FALL_BACK
        )
    return state if rounds == 1 else held_in(state, rounds, layout)


def recorded_arrays(stored: Stored, record: Record) -> dict[str, tuple[tuple[int, ...], str]]:
    """Path -> (shape, dtype) of the arrays `record` lists, once the step's own array
    metadata is found to list the same (CorruptCheckpointError if not)."""
    step = record.step
    recorded = {p: (tuple(a[0]), a[1]) for p, a in (record.arrays or {}).items()}
    try:
        saved = stored.saved_arrays(step)
    except Exception as error:
        raise CorruptCheckpointError(
            f"the array metadata of step {step} (state/_METADATA) cannot be read "
            f"({error_text(error)}): the step is damaged or incomplete. " + FALL_BACK
        ) from error
    if saved != recorded:
        raise CorruptCheckpointError(
            f"the array metadata of step {step} (state/_METADATA) disagrees with the arrays "
            f"its record lists ({len(set(saved) ^ set(recorded))} paths differ, "
            f"{sum(saved[p] != recorded[p] for p in set(saved) & set(recorded))} shapes "
            "or dtypes): the step is damaged. " + FALL_BACK
        )
    return recorded


def newest_verified[T](
    stored: Stored, step: int | None, restore: Callable[[int], T], skipped: dict[int, str]
) -> T:
    """`restore(step)`; without a step, `restore` of the newest step that verifies, warning
    of the newer ones it passed over and why, which it also writes in `skipped`."""
    if step is not None:
        return restore(stored.find(step))
    skipped.clear()
    for candidate in reversed(stored.steps() or [stored.find(None)]):
        try:
            restored = restore(candidate)
        except CorruptCheckpointError as error:
            skipped[candidate] = str(error)
            continue
        if skipped:
            reasons = "; ".join(f"step {s}: {why}" for s, why in skipped.items())
            warnings.warn(
                f"restored step {candidate} of {stored.directory}, passing over steps "
                f"{list(skipped)}, which do not verify. {reasons}",
                SkippedCheckpointWarning,
                stacklevel=4,
            )
        return restored
    raise CorruptCheckpointError(
        f"no checkpoint in {stored.directory} verifies: "
        + "; ".join(f"step {s}: {why}" for s, why in skipped.items())
    )


def restore(
    stored: Stored,
    model: nnx.Module | Callable[[dict[str, Any] | None], nnx.Module],
    tx: optax.GradientTransformation,
    rules: Rules,
    mesh: Mesh,
    options: TrainOptions | None = None,
    *,
    step: int | None = None,
    data: Batches | None = None,
    other_optimizer: bool = False,
    other_config: bool = False,
    skipped: dict[int, str] | None = None,
    **changes: Any,
) -> Trainer:
    """A trainer resumed from the checkpoint of `step`, laid out by `rules` on `mesh`.

    Without `step`, the newest checkpoint that verifies: newer ones that are damaged, or
    copied in from another run, are passed over with a SkippedCheckpointWarning naming
    them and why (also in `skipped`). `model` gives the model's structure: a module
    (concrete or abstract, only its shapes are used) or a function that builds one from
    the configuration the checkpoint recorded (`Transformer.from_config` for the book's).
    `tx` must have the structure of the optimizer that saved it; the EMA decay comes from
    the record. The training options are the saved run's (`Record.options`) unless
    `options` are given, with `changes`; a `loss_fn` or `grads_fn` of the run's own must
    be given again (functions are not recorded). With `data`, check that it is the data
    the run was trained on, so training continues with the very next batch. Every device
    reads only its shards, straight from the files; the resumed trainer continues the
    saved run (`Trainer.run`). An optimizer other than the run's, or with other settings,
    is refused (CheckpointMismatchError) unless `other_optimizer=True`; so is a `model`
    whose configuration differs from the recorded one, unless `other_config=True` (the
    trainer then records the model's own). The steps passed over, and why, are written in
    `skipped`.
    """

    check_optimizer(tx)
    check_target(model, rules, mesh)

    def restore_step(at: int) -> Trainer:
        record = stored.record(at)
        if data is not None:
            check_data(record, data)
        trained = restored_options(record, options, changes)
        graphdef, values = nnx.split(abstract(lambda: state_to_restore(record, model, tx)))
        layout = resolve(values, rules, mesh)
        built = nnx.merge(graphdef, values).model  # abstract: no array read yet
        config: dict[str, Any] = {}

        def checks() -> None:  # after the arrays that differ, before any is read
            check_same_optimizer(record, tx, nnx.state(built, nnx.Param), other_optimizer)
            config["trained"] = trained_config(record, built, other_config)

        state = restore_state(stored, values, layout, at, checks)
        return Trainer.from_layout(
            graphdef, state, layout, trained, config=config["trained"], run=record.run
        )

    return newest_verified(stored, step, restore_step, {} if skipped is None else skipped)


def restore_into(
    stored: Stored,
    trainer: Trainer,
    step: int | None = None,
    data: Batches | None = None,
    *,
    other_optimizer: bool = False,
    skipped: dict[int, str] | None = None,
) -> Trainer:
    """Put the checkpoint of `step` (default: the newest that verifies) into `trainer`'s
    state, in its layout; reuses its step, and continues the saved run. A trainer whose
    optimizer differs from the run's is refused unless `other_optimizer=True`. The steps passed
    over, and why, are written in `skipped`."""
    tx = nnx.merge(trainer.graphdef, trainer.state).optimizer.tx

    def restore_step(at: int) -> Trainer:
        record = stored.record(at)
        if data is not None:
            check_data(record, data)
        params = nnx.state(nnx.merge(trainer.graphdef, trainer.state).model, nnx.Param)
        restored = restore_state(
            stored,
            trainer.state,
            trainer.layout,
            at,
            lambda: check_same_optimizer(record, tx, params, other_optimizer),
        )
        trainer.state = restored
        trainer.run = record.run or trainer.run
        return trainer

    return newest_verified(stored, step, restore_step, {} if skipped is None else skipped)
