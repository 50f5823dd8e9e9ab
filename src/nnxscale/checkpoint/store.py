"""Checkpoints of the whole train state with Orbax, restorable onto any mesh, rule set or count.

A checkpoint is one step directory written by Orbax's `CheckpointManager`: `state/` holds
every array of the train state (weights, AdamW moments, EMA, RNG key and counters), each
device writing the shards it holds, and `meta/` a JSON record of what produced it (model
configuration, rule set, mesh, data position, versions). Saves are asynchronous: `save`
returns once the arrays are copied off the devices, and Orbax writes them in a background
thread into a temporary directory that it renames only when complete, so a crash mid-write
leaves the previous checkpoints intact and the partial one ignored.

Restoring builds its target from the abstract train state laid out by any rule set on any
mesh: concrete `NamedSharding`s, no memory. Orbax then reads each device's shard of each
array straight from the files, so a checkpoint saved under FSDP on 8 devices restores under
TP on a 4x2 mesh, or on 4 devices in another process, and no device holds a whole array.
Stacked layers that a pipeline holds in rounds (`nnxscale.model.group_layers`) are saved as
one plain stack, in the model's order, and restored by reading the plain stack's shards and
moving the layers between devices once, so any schedule, or none, restores any checkpoint.

Nothing is lost and nothing restores wrong (`nnxscale.integrity`): each step's record holds a
checksum of every array, computed where its shards live, names the run, and is sealed; a
restore verifies them all and refuses a damaged or foreign step with the reason, and without a
step falls back to the newest one that verifies. A save either starts or raises (a step Orbax
would drop, another run's directory), a failed background save raises from `wait` and
`close`, and one writer holds a directory at a time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import json
import re
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx
from jax.sharding import Mesh

from nnxscale.checkpoint.integrity import (
    LOCK_FILE,
    RUN_FILE,
    SCHEME,
    WriterLock,
    checksums,
    claim_directory,
    directory_run,
    leaves_of,
    seal,
)
from nnxscale.core.show import table
from nnxscale.core.trees import is_key, shapes_of, stand_in
from nnxscale.model.transformer import Config
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import Layout, resolve
from nnxscale.placement.mesh import constrain_to
from nnxscale.placement.rounds import group_layers, layer_rounds
from nnxscale.placement.rules import Rules
from nnxscale.runtime.environment import versions
from nnxscale.train.data import Batches
from nnxscale.train.trainer import Trainer, TrainOptions, TrainState, check_optimizer

T = TypeVar("T")

FALL_BACK = "restore() without a step falls back to the newest step that verifies."

PARTIAL = ".orbax-checkpoint-tmp"
"""Suffix of the directory Orbax writes a step into before renaming it: an unfinished save."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be restored as asked; the message names the problem and the fix."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """No complete checkpoint where one was expected."""


class CheckpointMismatchError(CheckpointError):
    """A checkpoint whose arrays, or data, differ from what the restore asks for."""


class CorruptCheckpointError(CheckpointError):
    """A step whose files do not hold what its record says was saved: damaged, truncated,
    copied in from another run, or written without checksums. `restore()` falls back past it."""


class SaveError(CheckpointError):
    """A save that did not happen; the message says why, and what was kept."""


class SkippedCheckpointWarning(UserWarning):
    """`restore()` passed over newer steps that did not verify, to restore an older one."""


@dataclasses.dataclass(frozen=True)
class Record:
    """What a checkpoint says about the run that saved it (its `meta/` item)."""

    step: int
    config: dict[str, Any] | None
    ema_decay: float
    rules: dict[str, Any]
    mesh: dict[str, int]
    processes: int
    data: dict[str, Any] | None
    saved_at: float
    versions: dict[str, str]
    options: dict[str, Any] | None = None
    """The run's training options (`TrainOptions.recorded`): restores train as it did."""
    run: str | None = None
    """The identity of the run that saved it (`Trainer.run`): one directory, one run."""
    arrays: dict[str, list[Any]] | None = None
    """Path -> [shape, dtype, checksum] of every array saved (`integrity.checksums`)."""
    checksum_scheme: str | None = None
    """How the checksums were computed (`integrity.SCHEME`)."""

    @property
    def devices(self) -> int:
        """Devices of the mesh the checkpoint was saved from."""
        return int(np.prod(list(self.mesh.values())))

    def _repr_markdown_(self) -> str:
        default = dataclasses.asdict(Config())
        if self.config is None:
            model = "not recorded"
        elif set(self.config) == set(default):  # the book's Transformer
            changed = {k: v for k, v in self.config.items() if default[k] != v}
            model = f"Config() with {changed}" if changed else "Config() (the defaults)"
        else:
            model = json.dumps(self.config)
        logical = ", ".join(
            f"{name}: {'+'.join(map(str, axes)) or 'replicated'}"
            for name, axes in self.rules["logical"].items()
        )
        data = self.data or {}
        rows = [
            ["step", self.step],
            ["model", model],
            ["EMA decay", self.ema_decay],
            ["rule set", f"{self.rules['name']} ({logical})"],
            ["mesh", f"{self.mesh}: {self.devices} devices in {self.processes} process(es)"],
            ["data", ", ".join(f"{k} {str(v)[:12]}" for k, v in data.items()) or "not recorded"],
            ["training", _said(self.options) if self.options else "not recorded"],
            ["run", self.run or "not recorded"],
            ["checksums", f"{len(self.arrays)} arrays" if self.arrays else "not recorded"],
            ["saved at", time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.saved_at))],
            ["written by", ", ".join(f"{k} {v}" for k, v in self.versions.items())],
        ]
        return str(table(["field", "value"], rows))


def _error(error: BaseException) -> str:
    """An exception as `Type: first line of its message`."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:300]


def _said(options: dict[str, Any]) -> str:
    """Recorded training options as `name value` pairs, leaving out those not set."""
    return ", ".join(f"{k} {v}" for k, v in options.items() if v is not None)


def record_from(fields: dict[str, Any], step: int) -> Record:
    """The record a checkpoint's `meta/` item holds, its seal verified. Checkpoints written
    before pipelines held their layers in rounds recorded `layer_order`: one stored permuted is
    refused with the reason, rather than restored into a model that would run its layers out
    of order."""
    fields = dict(fields)
    if fields.pop("layer_order", None) is not None:
        raise CheckpointMismatchError(
            f"the checkpoint of step {step} stores a pipeline's layers in a permuted order "
            "(written by an earlier nnxscale, before pipelines held layers in rounds): restore "
            "it with that version, or train from a checkpoint of this one."
        )
    sealed = fields.pop("seal", None)
    if sealed is None:
        raise CorruptCheckpointError(
            f"the record of step {step} has no seal: it was written by an nnxscale that did not "
            "verify its checkpoints, or not by nnxscale, so what it holds cannot be checked. "
            "Restore it with the version that wrote it, or train from a checkpoint of this one."
        )
    if sealed != seal(fields):
        raise CorruptCheckpointError(
            f"the record of step {step} (meta/metadata) was altered after it was written: its "
            "seal does not match its fields. Restore an older step (restore() without a step "
            "falls back to the newest that verifies)."
        )
    known = {f.name for f in dataclasses.fields(Record)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise CheckpointMismatchError(
            f"the record of step {step} has fields this nnxscale does not know, {unknown}: it "
            "was written by another version; restore it with that version."
        )
    return Record(**fields)


def sealed(record: Record) -> dict[str, Any]:
    """The fields a checkpoint's `meta/` item holds: the record's, and their seal."""
    fields = json.loads(json.dumps(dataclasses.asdict(record)))  # as the JSON will hold them
    return {**fields, "seal": seal(fields)}


def record_of(trainer: Trainer, data: Batches | None, saved: Any) -> Record:
    """The record of `trainer`'s current state, saved as `saved` (its layers in one plain
    stack), and of where in `data` it stands; every array's checksum included."""
    state = nnx.merge(trainer.graphdef, trainer.state)  # no copy: the same arrays
    step = trainer.step_count()
    rules = dataclasses.asdict(trainer.layout.rules)
    position = None if data is None else {**data.describe(), "next_batch": step}
    installed = versions(("jax", "flax", "orbax-checkpoint"))
    sums = checksums(saved)
    return Record(
        step=step,
        config=trainer.config,
        ema_decay=float(state.ema_decay),
        rules=json.loads(json.dumps(rules)),  # tuples to lists, as the JSON will hold them
        mesh={str(k): int(v) for k, v in trainer.layout.mesh.shape.items()},
        processes=jax.process_count(),
        data=position,
        saved_at=time.time(),
        versions=installed,
        options=trainer.options.recorded(),
        run=trainer.run,
        checksum_scheme=SCHEME,
        arrays={
            path: [list(shape), dtype, sums[path]]
            for path, (shape, dtype) in array_index(saved).items()
        },
    )


def _stored(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], str]:
    """Shape and dtype as Orbax stores an array: random keys as their uint32 key data."""
    if is_key(jax.ShapeDtypeStruct(shape, dtype)):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        return tuple(data.shape), str(data.dtype)
    return tuple(shape), str(np.dtype(dtype))


def array_index(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Path -> (shape, dtype) as Orbax stores them, for a state or an abstract state."""
    return {path: _stored(tuple(leaf.shape), leaf.dtype) for path, leaf in leaves_of(tree)}


def _listing(items: list[str], limit: int = 6) -> str:
    """The first `limit` items, how many more, and the path prefix they all share."""
    shown = ", ".join(items[:limit])
    if len(items) <= limit:
        return shown
    parts = [item.split("/") for item in items]
    common = [names[0] for names in zip(*parts, strict=False) if len(set(names)) == 1]
    under = f", all under {'/'.join(common)}" if common else ""
    return f"{shown} and {len(items) - limit} more{under}"


def check_matches(saved: dict[str, Any], wanted: dict[str, Any], where: str) -> None:
    """Raise CheckpointMismatchError naming every path that is missing, extra or different."""
    missing = sorted(set(wanted) - set(saved))
    extra = sorted(set(saved) - set(wanted))
    different = sorted(
        f"{p} (saved {saved[p][0]} {saved[p][1]}, wanted {wanted[p][0]} {wanted[p][1]})"
        for p in set(saved) & set(wanted)
        if saved[p] != wanted[p]
    )
    if not (missing or extra or different):
        return
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} arrays the target has and {where} lacks: {_listing(missing)}"
        )
    if extra:
        problems.append(f"{len(extra)} arrays {where} has and the target lacks: {_listing(extra)}")
    if different:
        problems.append(
            f"{len(different)} arrays of another shape or dtype: {_listing(different, 3)}"
        )
    raise CheckpointMismatchError(
        f"{where} does not match the state to restore into. " + "; ".join(problems) + ". "
        "Restore into a state built with the model configuration, optimizer and code that "
        "saved it (its record holds the configuration), or convert the checkpoint."
    )


def check_data(record: Record, data: Batches) -> None:
    """Raise CheckpointMismatchError if `data` is not the data the checkpoint was trained on."""
    if record.data is None:
        return
    saved = {k: v for k, v in record.data.items() if k != "next_batch"}
    now = data.describe()
    changed = sorted(k for k in saved if saved[k] != now.get(k))
    if changed:
        detail = ", ".join(f"{k} saved {saved[k]!r}, now {now.get(k)!r}" for k in changed)
        raise CheckpointMismatchError(
            f"the checkpoint of step {record.step} was trained on other data ({detail}): a "
            "resumed run would see different batches from the uninterrupted one. Resume with "
            "the same corpus, seed, batch size and length, or start a new run."
        )


def restored_options(
    record: Record, options: TrainOptions | None, changes: dict[str, Any]
) -> TrainOptions:
    """The options a restore trains with: `options` or the record's, with `changes`; refused
    when the saved run had a loss or gradient function of its own that is not given again."""
    if options is None:
        recorded = record.options or {}
        options = TrainOptions.from_record(recorded) if recorded else TrainOptions()
        options = options.replace(ema_decay=record.ema_decay)
        for name in ("loss_fn", "grads_fn"):
            if recorded.get(name) and not ({"loss_fn", "grads_fn"} & set(changes)):
                raise CheckpointMismatchError(
                    f"the run that saved step {record.step} trained with its own {name} "
                    f"({recorded[name]}), which a checkpoint cannot hold: pass it to restore "
                    f"({name}=...) so the resumed run computes the same loss."
                )
    return options.replace(**changes)


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


def restore_target(values: nnx.State, shardings: Any) -> nnx.State:
    """Shapes, dtypes and concrete shardings to restore into: an abstract state, no memory."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), values, shardings
    )


def held_in(state: Any, rounds: int, layout: Layout) -> Any:
    """`state` with its stacked layers held in `rounds` rounds (`group_layers`), laid out by
    `layout`'s rules on its mesh: one program, compiled once per layout, in which the layers
    move between devices once. (Its input is not donated: the arrays change shape, so XLA
    could not reuse their buffers, and would warn.)"""
    return _regrouping(rounds, layout)(state)


@functools.lru_cache(maxsize=8)
def _regrouping(rounds: int, layout: Layout) -> Callable[[Any], Any]:
    """The jitted program of `held_in`."""

    def regroup(state: Any) -> Any:
        held = group_layers(state, rounds)
        placed = resolve(held, layout.rules, layout.mesh).shardings()
        return jax.tree.map(constrain_to, held, placed)

    return jax.jit(regroup)


FILE_ROLES = (
    (r"^state/ocdbt\.process_\d+/d/", "array data: zstd-compressed chunks this process wrote"),
    (r"^state/ocdbt\.process_\d+/manifest", "this process's key-value store: its manifest"),
    (r"^state/d/", "global index merged from the processes' stores"),
    (r"^state/manifest\.ocdbt$", "global index: its manifest"),
    (r"^state/_METADATA$", "tree structure, shapes and dtypes"),
    (r"^state/_sharding$", "the shardings at save time"),
    (r"^state/array_metadatas/", "chunk shapes, per process"),
    (r"^meta/metadata$", "the run's record (JSON)"),
    (r"commit_success\.txt$", "written last: the item is complete"),
    (r"^_CHECKPOINT_METADATA$", "step metadata: item names, time"),
)
"""What each file of an Orbax step directory holds: (regular expression, description)."""


def file_role(path: str) -> str:
    """What a file of an Orbax step directory holds, from its path."""
    for pattern, role in FILE_ROLES:
        if re.search(pattern, path):
            return role
    return "other"


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


@dataclasses.dataclass
class SaveTimes:
    """When a save started, when it handed control back to training, and when its background
    writes ended (`time.perf_counter()` seconds; `written` is None until then)."""

    started: float
    returned: float
    written: float | None = None


def orbax_manager(
    directory: Path, keep: int, create: bool, written: Callable[[], None] | None
) -> ocp.CheckpointManager:
    """Orbax's manager of a directory of steps, each a `state` and a `meta` (JSON) item, the
    last `keep` kept; saves asynchronous when `written` is given (called as each completes)."""
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        enable_async_checkpointing=written is not None,
        create=create,
        cleanup_tmp_directories=create,
        async_options=None
        if written is None
        else ocp.AsyncOptions(post_finalization_callback=written),
    )
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)


_OPEN: weakref.WeakSet[Checkpoints] = weakref.WeakSet()
"""Every directory opened in this process, for `finish_at_program_end`."""

MONITORING_TOOL = 4
"""The `sys.monitoring` tool id the library watches the end of the program with (ids 0 to 2
and 5 are the debugger's, coverage's, the profiler's and the optimizer's)."""


def _close_open() -> None:
    """Close every directory left open: its saves in flight are finished, not lost."""
    for opened in list(_OPEN):
        if not opened.closed:
            try:
                opened.close()
            except SaveError as error:
                print(f"nnxscale: {error}", file=sys.stderr)


@functools.cache
def finish_at_program_end() -> bool:
    """Close the open directories when the script's main module ends, normally, by `sys.exit`
    or by an exception; whether the script's main module was found.

    Since Python 3.12 no thread can start once the interpreter begins to shut down, before
    `atexit` and `threading`'s own exit hooks run, and Orbax starts threads to finish a save:
    a save closed there is lost. So the close runs while the interpreter is whole, as the
    main module's code returns or unwinds (`sys.monitoring`, watching that code object alone
    for its return; an exception's unwinding is a global event, filtered to it). The
    outermost main module is watched: in a notebook, the kernel's, whose cells' code runs as
    main modules of their own."""
    main, frame = None, sys._current_frames().get(threading.main_thread().ident)
    while frame is not None:  # the outermost: a notebook's cells run inside the kernel's
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            main = frame.f_code
        frame = frame.f_back
    monitoring = sys.monitoring
    if main is None or monitoring.get_tool(MONITORING_TOOL) is not None:
        return False

    def ended(code: types.CodeType, *_: object) -> None:
        if code is main:
            _close_open()

    monitoring.use_tool_id(MONITORING_TOOL, "nnxscale checkpoints")
    monitoring.register_callback(MONITORING_TOOL, monitoring.events.PY_RETURN, ended)
    monitoring.register_callback(MONITORING_TOOL, monitoring.events.PY_UNWIND, ended)
    monitoring.set_local_events(MONITORING_TOOL, main, monitoring.events.PY_RETURN)
    monitoring.set_events(MONITORING_TOOL, monitoring.events.PY_UNWIND)
    return True


class Checkpoints:
    """A directory of train-state checkpoints, managed by Orbax: async saves, the last k kept,
    every step verified when read, one writer at a time."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        asynchronous: bool = True,
        create: bool = True,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"keep={keep!r}: a directory keeps its newest `keep` checkpoints and deletes "
                "the others, so it must be a whole number of at least 1."
            )
        self.directory = Path(directory).absolute()
        if self.directory.exists() and not self.directory.is_dir():
            raise NoCheckpointError(
                f"{self.directory} is a file, not a checkpoint directory: pass a directory's "
                "path (a new one to start saving)."
            )
        if not create and not self.directory.is_dir():
            raise NoCheckpointError(
                f"no checkpoint directory at {self.directory}: check the path, or save "
                "checkpoints there first (Checkpoints(directory).save(trainer))."
            )
        self.lock = None
        if create:  # one writer: taken before Orbax may delete an unfinished save
            self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                self.lock = WriterLock(self.directory)
        self.discarded = self.partial() if create else []
        self.asynchronous = asynchronous
        self.writable = create
        written = self._written if asynchronous else None
        self.manager = orbax_manager(self.directory, keep, create, written)
        self.times: dict[int, SaveTimes] = {}
        self.skipped: dict[int, str] = {}  # steps the last restore passed over, and why
        self.closed = False
        # A save still being written when the program ends is finished, not lost.
        _OPEN.add(self)
        finish_at_program_end()

    def save(
        self, trainer: Trainer, data: Batches | None = None, *, overwrite: bool = False
    ) -> float:
        """Start saving `trainer`'s state at its step, with every array's checksum; returns the
        seconds training waited. Raises SaveError, before anything is written, when the step
        is at or below the newest here, or the directory holds another run's checkpoints
        (`overwrite=True` deletes those first). Stacked layers that a pipeline holds in rounds
        are saved as one plain stack, in the model's order, so any schedule restores them."""
        if not self.writable or self.closed:
            how = "closed" if self.closed else "opened to read (create=False)"
            raise SaveError(
                f"{self.directory} was {how}: open it with Checkpoints(directory) to save."
            )
        trainer.check_state()
        start = time.perf_counter()
        step = trainer.step_count()
        self._make_room(step, trainer.run, overwrite)
        state = trainer.state  # layers held in rounds (a pipeline) saved as one stack
        state = held_in(state, 1, trainer.layout) if layer_rounds(state) > 1 else state
        record = record_of(trainer, data, state)
        if jax.process_index() == 0 and directory_run(self.directory) != trainer.run:
            claim_directory(self.directory, trainer.run)
        started = self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(sealed(record))
            ),
        )
        if not started:
            raise SaveError(
                f"Orbax declined to save step {step} in {self.directory} (its steps: "
                f"{self.steps()}); nothing was written. Save to a new directory."
            )
        returned = time.perf_counter()
        self.times[step] = SaveTimes(start, returned, None if self.asynchronous else returned)
        return returned - start

    def _make_room(self, step: int, run: str, overwrite: bool) -> None:
        """Refuse a save Orbax would drop, or one that mixes two runs; with `overwrite`, delete
        the checkpoints in the way instead."""
        steps = sorted(self.manager.all_steps())  # this writer's view: no reload mid-save
        owner = directory_run(self.directory) or self._recorded_run(steps)
        foreign = bool(steps) and owner is not None and owner != run
        later = [s for s in steps if s >= step]
        if not overwrite and foreign:
            raise SaveError(
                f"{self.directory} holds the checkpoints {steps} of another run ({owner[:8]}), "
                f"and this trainer is run {run[:8]}, created rather than restored from them: "
                "saving here would mix two runs' histories. Save to a new directory, or pass "
                "overwrite=True to delete that run's checkpoints first."
            )
        if not overwrite and later:
            raise SaveError(
                f"step {step} is at or below the newest checkpoint in {self.directory} (step "
                f"{steps[-1]}): Orbax keeps steps increasing and would drop this save. Train "
                f"past step {steps[-1]} before saving, or pass overwrite=True to replace steps "
                f"{later}."
            )
        doomed = steps if foreign else later
        if doomed:
            self.wait()
            for old in doomed:
                self.manager.delete(old)

    def _recorded_run(self, steps: list[int]) -> str | None:
        """The run of the newest readable step, for a directory that lost its run file."""
        for step in reversed(steps):
            with contextlib.suppress(CheckpointError):
                return self.record(step).run
        return None

    @property
    def blocked(self) -> dict[int, float]:
        """Seconds training waited for each save, by step."""
        return {step: t.returned - t.started for step, t in self.times.items()}

    def _written(self) -> None:
        """Orbax's call once a save's files are committed: the one save in flight, the last."""
        self.times[max(self.times)].written = time.perf_counter()

    def wait(self) -> float:
        """Block until every started save is on disk; returns the seconds waited. A save that
        failed in the background raises SaveError here, naming what was kept."""
        start = time.perf_counter()
        try:
            self.manager.wait_until_finished()
        except Exception as error:
            pending = sorted(step for step, t in self.times.items() if t.written is None)
            raise SaveError(
                f"the save of step {pending[-1] if pending else '?'} failed while writing "
                f"({type(error).__name__}: {error}). It is not a checkpoint: its unfinished "
                f"directory is ignored, and deleted by the next save. The complete "
                f"checkpoints are intact: {self.steps()}. Fix the cause (a full disk, "
                "permissions) and save again."
            ) from error
        return time.perf_counter() - start

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (unfinished saves are not steps)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def partial(self) -> list[str]:
        """Names of unfinished saves in the directory, such as one cut short by a crash.

        Restores ignore them. Opening the directory to save (`create=True`) lists them in
        `discarded`, and Orbax deletes them before the next save begins.
        """
        return sorted(p.name for p in self.directory.glob(f"*{PARTIAL}"))

    def _step(self, step: int | None) -> int:
        if step is not None and (isinstance(step, bool) or not isinstance(step, int | np.integer)):
            raise TypeError(f"step={step!r}: a checkpoint's step is a whole number, or None")
        steps = self.steps()
        if step is None and steps:
            return steps[-1]
        if step in steps:
            return step
        contents = sorted(
            p.name for p in self.directory.iterdir() if p.name not in (LOCK_FILE, RUN_FILE)
        )
        found = f"it holds {_listing(contents)}" if contents else "it is empty"
        wanted = "complete checkpoint" if step is None else f"checkpoint of step {step}"
        unfinished = " (unfinished saves are ignored)" if self.partial() else ""
        raise NoCheckpointError(
            f"{self.directory} holds no {wanted}: {found}{unfinished}. Complete checkpoints: "
            f"{steps or 'none'}. Check the path, or save a checkpoint first."
        )

    def record(self, step: int | None = None) -> Record:
        """The record of the checkpoint of `step` (default: the latest)."""
        step = self._step(step)
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        except Exception as error:
            raise CorruptCheckpointError(
                f"the record of step {step} (meta/metadata) cannot be read ({_error(error)}): "
                "the step is damaged, or was not written by nnxscale's Checkpoints. " + FALL_BACK
            ) from error
        if not isinstance(meta, dict):
            raise CorruptCheckpointError(
                f"the record of step {step} holds a {type(meta).__name__}, not a record: the "
                "step is damaged, or was not written by nnxscale's Checkpoints. " + FALL_BACK
            )
        record = record_from(meta, step)
        try:
            owner = directory_run(self.directory)
        except ValueError as error:
            raise CorruptCheckpointError(str(error)) from None
        if record.step != step:
            raise CorruptCheckpointError(
                f"the directory {self.directory / str(step)} holds the checkpoint of step "
                f"{record.step}: it was renamed, or copied over another step. Give it back "
                f"its name ({record.step}). " + FALL_BACK
            )
        if owner is not None and record.run != owner:
            raise CorruptCheckpointError(
                f"step {step} was saved by run {str(record.run)[:8]}, and {self.directory} "
                f"holds the checkpoints of run {owner[:8]}: it was copied in from another run, "
                "whose weights it holds. Restore it from that run's directory. " + FALL_BACK
            )
        return record

    def _stored_tree(self, step: int | None) -> dict[str, Any]:
        """Path -> Orbax's metadata of each saved array (each NNX variable is {"value": ...})."""
        tree = self.manager.item_metadata(self._step(step))["state"].tree
        return {path.removesuffix("/value"): leaf for path, leaf in leaves_of(tree)}

    def saved_arrays(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Path -> (shape, dtype) of every array in the checkpoint of `step`, from its metadata."""
        return {
            path: _stored(tuple(meta.shape), meta.dtype)
            for path, meta in self._stored_tree(step).items()
        }

    def chunks(self, step: int | None = None) -> dict[str, tuple[int, ...]]:
        """Path -> shape of the chunks each array was written in (one per shard held)."""
        return {
            path: tuple(meta.storage.chunk_shape) for path, meta in self._stored_tree(step).items()
        }

    def stored_values(self, step: int | None = None) -> dict[str, int]:
        """Key -> bytes of every value in the checkpoint's array store (OCDBT, via TensorStore).

        Keys are `<array>/<chunk index>` for the compressed chunks and `<array>/.zarray` for
        each array's Zarr metadata; the rest of the `state/` files is the store's index.
        """
        root = self.directory / str(self._step(step)) / "state"
        store = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{root}/"}).result()
        return {key.decode(): len(store.read(key).result().value) for key in store.list().result()}

    def restore_state(
        self, values: nnx.State, layout: Layout, step: int | None = None
    ) -> nnx.State:
        """The saved state of `step`, for a state shaped like `values`, laid out by `layout`,
        verified against the checksums saved with it: read as the plain stacks the checkpoint
        holds (each device its shards), then held in the rounds `values` holds its layers in.
        Raises CorruptCheckpointError for a step that does not hold what was saved, and
        CheckpointMismatchError, naming the arrays, when `values` is shaped otherwise."""
        record = self.record(step)
        step = record.step
        if record.checksum_scheme != SCHEME:
            raise CheckpointMismatchError(
                f"the checksums of step {step} were computed as {record.checksum_scheme!r}, "
                f"and this nnxscale computes them as {SCHEME!r}: restore it with the nnxscale "
                "that wrote it."
            )
        recorded = {p: (tuple(a[0]), a[1]) for p, a in (record.arrays or {}).items()}
        try:
            stored = self.saved_arrays(step)
        except Exception as error:
            raise CorruptCheckpointError(
                f"the array metadata of step {step} (state/_METADATA) cannot be read "
                f"({_error(error)}): the step is damaged or incomplete. " + FALL_BACK
            ) from error
        if stored != recorded:
            raise CorruptCheckpointError(
                f"the array metadata of step {step} (state/_METADATA) disagrees with the arrays "
                f"its record lists ({len(set(stored) ^ set(recorded))} paths differ, "
                f"{sum(stored[p] != recorded[p] for p in set(stored) & set(recorded))} shapes "
                "or dtypes): the step is damaged. " + FALL_BACK
            )
        shapes = shapes_of(values)
        rounds, plain = layer_rounds(shapes), group_layers(shapes, 1)
        check_matches(recorded, array_index(plain), f"checkpoint {step}")
        read = layout if rounds == 1 else resolve(plain, layout.rules, layout.mesh)
        target = restore_target(plain, read.shardings())
        try:
            state = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )["state"]
        except Exception as error:
            raise CorruptCheckpointError(
                f"the arrays of step {step} cannot be read ({_error(error)}): a file of its "
                "state/ is damaged or missing. " + FALL_BACK
            ) from error
        sums = checksums(state)
        wrong = sorted(path for path, saved in record.arrays.items() if sums[path] != saved[2])
        if wrong:
            raise CorruptCheckpointError(
                f"{len(wrong)} arrays of step {step} do not hold what was saved (their "
                f"checksums differ): {_listing(wrong)}. A file of the step is damaged: a "
                "flipped bit, a truncated or replaced chunk. " + FALL_BACK
            )
        return state if rounds == 1 else held_in(state, rounds, layout)

    def _newest_verified(self, step: int | None, restore: Callable[[int], T]) -> T:
        """`restore(step)`; without a step, `restore` of the newest step that verifies, warning
        of the newer ones it passed over and why (`skipped`)."""
        if step is not None:
            return restore(self._step(step))
        self.skipped = {}
        for candidate in reversed(self.steps() or [self._step(None)]):
            try:
                restored = restore(candidate)
            except CorruptCheckpointError as error:
                self.skipped[candidate] = str(error)
                continue
            if self.skipped:
                reasons = "; ".join(f"step {s}: {why}" for s, why in self.skipped.items())
                warnings.warn(
                    f"restored step {candidate} of {self.directory}, passing over steps "
                    f"{list(self.skipped)}, which do not verify. {reasons}",
                    SkippedCheckpointWarning,
                    stacklevel=3,
                )
            return restored
        raise CorruptCheckpointError(
            f"no checkpoint in {self.directory} verifies: "
            + "; ".join(f"step {s}: {why}" for s, why in self.skipped.items())
        )

    def restore(
        self,
        model: nnx.Module | Callable[[dict[str, Any] | None], nnx.Module],
        tx: optax.GradientTransformation,
        rules: Rules,
        mesh: Mesh,
        options: TrainOptions | None = None,
        *,
        step: int | None = None,
        data: Batches | None = None,
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
        saved run (`Trainer.run`).
        """

        check_optimizer(tx)
        check_target(model, rules, mesh)

        def restore_step(at: int) -> Trainer:
            record = self.record(at)
            if data is not None:
                check_data(record, data)
            trained = restored_options(record, options, changes)
            graphdef, values = nnx.split(abstract(lambda: state_to_restore(record, model, tx)))
            layout = resolve(values, rules, mesh)
            state = self.restore_state(values, layout, at)
            return Trainer.from_layout(
                graphdef, state, layout, trained, config=record.config, run=record.run
            )

        return self._newest_verified(step, restore_step)

    def restore_into(
        self, trainer: Trainer, step: int | None = None, data: Batches | None = None
    ) -> Trainer:
        """Put the checkpoint of `step` (default: the newest that verifies) into `trainer`'s
        state, in its layout; reuses its step, and continues the saved run."""

        def restore_step(at: int) -> Trainer:
            record = self.record(at)
            if data is not None:
                check_data(record, data)
            trainer.state = self.restore_state(trainer.state, trainer.layout, at)
            trainer.run = record.run or trainer.run
            return trainer

        return self._newest_verified(step, restore_step)

    def files(self, step: int | None = None) -> list[tuple[str, int, str]]:
        """(path in the step directory, bytes, what it holds) of every file of a checkpoint."""
        root = self.directory / str(self._step(step))
        found = [
            (str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*") if p.is_file()
        ]
        return [(path, size, file_role(path)) for path, size in sorted(found)]

    def close(self) -> None:
        """Finish pending saves (a failed one raises SaveError), release Orbax's threads and
        the directory, whatever happens."""
        if self.closed:
            return
        self.closed = True
        try:
            self.wait()
        finally:
            try:
                with contextlib.suppress(Exception):  # the error, if any, is wait's
                    self.manager.close()
            finally:
                if self.lock is not None:
                    self.lock.release()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
