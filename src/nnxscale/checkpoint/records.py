"""What a checkpoint says about itself: its record (configuration, rule set, mesh, data,
checksums) and files, the errors that name what is wrong with a step, and the checks a
restore makes of it; `Stored` reads a directory's steps."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from nnxscale.checkpoint.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
)
from nnxscale.checkpoint.integrity import (
    SCHEME,
    checksums,
    leaves_of,
    seal,
)
from nnxscale.core.show import table
from nnxscale.core.trees import is_key
from nnxscale.runtime.environment import versions
from nnxscale.train.data import Batches
from nnxscale.train.state import TrainOptions, config_words, describe_optimizer, model_config
from nnxscale.train.trainer import Trainer

FALL_BACK = "restore() without a step falls back to the newest step that verifies."


PARTIAL = ".orbax-checkpoint-tmp"
"""Suffix of the directory Orbax writes a step into before renaming it: an unfinished save."""


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
    optimizer: dict[str, list] | None = None
    """What tells the optimizer that trained apart from others (`describe_optimizer`)."""
    described: str | None = None
    """The model's configuration in words (`config_words`), as the record shows it."""

    @property
    def devices(self) -> int:
        """Devices of the mesh the checkpoint was saved from."""
        return int(np.prod(list(self.mesh.values())))

    def _repr_markdown_(self) -> str:
        recorded = self.described or json.dumps(self.config)
        model = "not recorded" if self.config is None else recorded
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


def error_text(error: BaseException) -> str:
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
        optimizer=describe_optimizer(state.optimizer.tx, nnx.state(state.model, nnx.Param)),
        described=config_words(state.model)
        if trainer.config == model_config(state.model)
        else None,
        arrays={
            path: [list(shape), dtype, sums[path]]
            for path, (shape, dtype) in array_index(saved).items()
        },
    )


def stored_as(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], str]:
    """Shape and dtype as Orbax stores an array: random keys as their uint32 key data."""
    if is_key(jax.ShapeDtypeStruct(shape, dtype)):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
        return tuple(data.shape), str(data.dtype)
    return tuple(shape), str(np.dtype(dtype))


def array_index(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """Path -> (shape, dtype) as Orbax stores them, for a state or an abstract state."""
    return {path: stored_as(tuple(leaf.shape), leaf.dtype) for path, leaf in leaves_of(tree)}


def listing(items: list[str], limit: int = 6) -> str:
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
            f"{len(missing)} arrays the target has and {where} lacks: {listing(missing)}"
        )
    if extra:
        problems.append(f"{len(extra)} arrays {where} has and the target lacks: {listing(extra)}")
    if different:
        problems.append(
            f"{len(different)} arrays of another shape or dtype: {listing(different, 3)}"
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
