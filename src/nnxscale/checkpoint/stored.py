"""A read-only view of a checkpoint directory (a local path or `gs://`): its steps, their
records, and what each step stored, array by array and file by file."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from nnxscale.checkpoint.buckets import files_under, is_url, kvstore_url, partial_steps, refresh
from nnxscale.checkpoint.errors import CorruptCheckpointError, NoCheckpointError
from nnxscale.checkpoint.integrity import LOCK_FILE, RUN_FILE, directory_run, leaves_of
from nnxscale.checkpoint.records import (
    FALL_BACK,
    PARTIAL,
    Record,
    error_text,
    file_role,
    listing,
    record_from,
    stored_as,
)


def partial_saves(directory: Path) -> list[str]:
    """Names of the unfinished saves in `directory` (`Stored.partial`), read before Orbax's
    manager, which deletes them when opened to write, is made."""
    if is_url(directory):
        return partial_steps(directory)
    return sorted(p.name for p in directory.glob(f"*{PARTIAL}"))


@dataclasses.dataclass(frozen=True)
class Stored:
    """A read-only view of a checkpoint directory: the steps it holds, their records, arrays,
    chunks, stored values and files. It writes nothing and holds no lock; `Checkpoints`, the
    writer, holds one over the directory it opened, and so can anything that only reads."""

    directory: Path
    manager: ocp.CheckpointManager

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (unfinished saves are not steps)."""
        refresh(self.directory)
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def partial(self) -> list[str]:
        """Names of unfinished saves in the directory, such as one cut short by a crash.

        Restores ignore them. Opening the directory to save (`create=True`) lists them in
        `discarded`, and Orbax deletes them before the next save begins. On a file system they
        have Orbax's temporary names; on GCS, their step's name without the commit marker.
        """
        return partial_saves(self.directory)

    def find(self, step: int | None) -> int:
        """`step`, or the newest complete step when None, once found complete here; else
        NoCheckpointError naming what the directory holds."""
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
        found = f"it holds {listing(contents)}" if contents else "it is empty"
        wanted = "complete checkpoint" if step is None else f"checkpoint of step {step}"
        unfinished = " (unfinished saves are ignored)" if self.partial() else ""
        raise NoCheckpointError(
            f"{self.directory} holds no {wanted}: {found}{unfinished}. Complete checkpoints: "
            f"{steps or 'none'}. Check the path, or save a checkpoint first."
        )

    def record(self, step: int | None = None) -> Record:
        """The record of the checkpoint of `step` (default: the latest)."""
        step = self.find(step)
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
                "meta"
            ]
        except Exception as error:
            raise CorruptCheckpointError(
                f"the record of step {step} (meta/metadata) cannot be read ({error_text(error)}): "
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
        tree = self.manager.metadata(self.find(step)).item_metadata["state"].tree
        return {path.removesuffix("/value"): leaf for path, leaf in leaves_of(tree)}

    def saved_arrays(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Path -> (shape, dtype) of every array in the checkpoint of `step`, from its metadata."""
        return {
            path: stored_as(tuple(meta.shape), meta.dtype)
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
        root = self.directory / str(self.find(step)) / "state"
        store = ts.KvStore.open({"driver": "ocdbt", "base": kvstore_url(root)}).result()
        return {key.decode(): len(store.read(key).result().value) for key in store.list().result()}

    def files(self, step: int | None = None) -> list[tuple[str, int, str]]:
        """(path in the step directory, bytes, what it holds) of every file of a checkpoint."""
        found = files_under(self.directory / str(self.find(step)))
        return [(path, size, file_role(path)) for path, size in sorted(found)]
