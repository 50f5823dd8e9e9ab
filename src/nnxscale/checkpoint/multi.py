"""A run of several processes, worked out before it starts and read off what it wrote.

`planned` says, without starting anything, what each worker of `python -m nnxscale train`
would report when it starts (`events.Start`): the devices it owns, where they sit in the one
global mesh, and which rows of every batch it loads. `bytes_written` reads a finished multi-process
checkpoint and says how many bytes of array data each process wrote into its own store.
"""

from __future__ import annotations

import math
from pathlib import Path

import jax
import numpy as np
import tensorstore as ts

from nnxscale.checkpoint.store import Checkpoints
from nnxscale.placement.catalogue import FSDP
from nnxscale.placement.rules import Rules
from nnxscale.runtime.events import Start


def planned(
    processes: int,
    devices: int | None = None,
    batch_size: int | None = None,
    rules: Rules = FSDP,
) -> list[Start]:
    """The `Start` event each of `processes` training workers would report, without starting
    any: `devices` in all (default: this process's count, at least one per process), an equal
    consecutive run of them per process, `rules`' mesh over all of them, and batches of
    `batch_size` rows (default: two per device) split over the mesh axes of the batch rule.

    Devices are numbered by their position 0 .. devices-1 in the run; a backend may give them
    other ids (JAX's CPU runtime starts each process's ids at its own offset).
    """
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r}: a run needs a whole number, 1 or more")
    if devices is None:
        devices = processes * max(1, jax.device_count() // processes)
    if devices % processes:
        raise ValueError(
            f"{devices} devices cannot be shared equally by {processes} processes: use a "
            f"multiple of {processes}, such as {processes * max(1, devices // processes)}"
        )
    batch_size = 2 * devices if batch_size is None else batch_size
    shape = rules.mesh_shape(devices)
    grid = np.arange(devices).reshape(shape)
    rows, first_row = _first_rows(rules, grid, batch_size)
    each = devices // processes
    starts = []
    for process in range(processes):
        owned = list(range(process * each, (process + 1) * each))
        held = [first_row[d] for d in owned]
        starts.append(
            Start(
                process=process,
                processes=processes,
                local_devices=each,
                devices=devices,
                device_ids=owned,
                mesh_axes=list(rules.axes),
                mesh_device_ids=grid.tolist(),
                rows=[min(held), max(held) + rows],
                batch_size=batch_size,
            )
        )
    return starts


def _first_rows(rules: Rules, grid: np.ndarray, batch_size: int) -> tuple[int, dict[int, int]]:
    """Rows per device of a batch of `batch_size` split over the mesh axes of the batch rule,
    and the first row each device of `grid` (the mesh's device positions) holds."""
    batch_axes = next(
        (axes for axes in rules.candidates("batch", "the batch") if set(axes) <= set(rules.axes)),
        (),
    )
    shape = grid.shape
    where = [rules.axes.index(axis) for axis in batch_axes]
    split = math.prod(shape[i] for i in where)
    if batch_size % split:
        raise ValueError(
            f"a batch of {batch_size} rows cannot be split over the {split} devices of mesh "
            f"axes {batch_axes}: use a multiple of {split}"
        )
    rows = batch_size // split
    first_row = {}
    for index, device in np.ndenumerate(grid):
        block = np.ravel_multi_index([index[i] for i in where], [shape[i] for i in where])
        first_row[int(device)] = int(block) * rows
    return rows, first_row


def _store_of(directory: Path) -> int:
    """The process whose store `directory` (`ocdbt.process_<i>`) is."""
    return int(directory.name.rsplit("_", 1)[1])


def bytes_written(checkpoints: Checkpoints, step: int | None = None) -> dict[int, int]:
    """Process -> bytes of array data (before compression) in the chunks that process wrote
    into its own OCDBT store for the checkpoint of `step` (default: the latest), 0 for a
    process that wrote none; a one-process checkpoint's chunks are all process 0's."""
    step = checkpoints.steps()[-1] if step is None else step
    arrays, chunks = checkpoints.saved_arrays(step), checkpoints.chunks(step)
    root = checkpoints.directory / str(step) / "state"
    stores = sorted(root.glob("ocdbt.process_*"), key=_store_of) or [root]
    written = dict.fromkeys(range(checkpoints.record(step).processes), 0)
    for store in stores:
        process = _store_of(store) if store != root else 0
        kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{store}/"}).result()
        total = 0
        for key in kv.list().result():
            name, _, index = key.decode().rpartition("/")
            if index == ".zarray":
                continue
            path = name.replace(".", "/").removesuffix("/value")
            shape, dtype = arrays[path]
            chunk = chunks[path]
            position = [int(i) for i in index.split(".")] if shape else []
            spans = zip(position, chunk, shape, strict=True)
            extent = [min(size, dim - i * size) for i, size, dim in spans]
            total += math.prod(extent) * np.dtype(dtype).itemsize
        written[process] = total
    return written
