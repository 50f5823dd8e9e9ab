"""A directory of train-state checkpoints (a local path or `gs://`): saves, their waits
and failures, one writer, and saves finished when the program ends."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from nnxscale.checkpoint import restoring
from nnxscale.checkpoint.buckets import (
    Location,
    MarkerLock,
    ObjectStorageError,
    check_bucket,
    is_url,
    location,
)
from nnxscale.checkpoint.errors import (
    CheckpointError,
    NoCheckpointError,
    SaveError,
)
from nnxscale.checkpoint.integrity import (
    LOCK_FILE,
    DirectoryLockedError,
    WriterLock,
    claim_directory,
    directory_run,
)
from nnxscale.checkpoint.records import (
    Record,
    record_of,
    sealed,
)
from nnxscale.checkpoint.stored import Stored, partial_saves
from nnxscale.placement.layout import Layout
from nnxscale.placement.rounds import held_in, layer_rounds
from nnxscale.placement.rules import Rules
from nnxscale.train.data import Batches
from nnxscale.train.state import TrainOptions
from nnxscale.train.trainer import Trainer


@dataclasses.dataclass
class SaveTimes:
    """When a save started, when it handed control back to training, and when its background
    writes ended (`time.perf_counter()` seconds; `written` is None until then)."""

    started: float
    returned: float
    written: float | None = None


def orbax_manager(
    directory: Location, keep: int, create: bool, written: Callable[[], None] | None
) -> ocp.CheckpointManager:
    """Orbax's manager of a directory of steps, each a `state` and a `meta` (JSON) item, the
    last `keep` kept; saves asynchronous when `written` is given (called as each completes).
    Orbax's current forms: a preservation policy, and a registry of each item's handler for
    its save and restore arguments."""
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.LatestN(keep),
        enable_async_checkpointing=written is not None,
        create=create,
        cleanup_tmp_directories=create,
        async_options=None
        if written is None
        else ocp.AsyncOptions(post_finalization_callback=written),
    )
    handlers = ocp.handlers.DefaultCheckpointHandlerRegistry()
    state, meta = ocp.StandardCheckpointHandler(), ocp.JsonCheckpointHandler()
    for item, handler, arguments in (
        ("state", state, (ocp.args.StandardSave, ocp.args.StandardRestore)),
        ("meta", meta, (ocp.args.JsonSave, ocp.args.JsonRestore)),
    ):
        for argument in arguments:
            handlers.add(item, argument, handler)
    return ocp.CheckpointManager(directory, options=options, handler_registry=handlers)


_OPEN: weakref.WeakSet[Checkpoints] = weakref.WeakSet()
"""Every directory opened in this process, for `finish_at_program_end`."""


MONITORING_TOOL = 4
"""The `sys.monitoring` tool id the library watches the end of the program with (ids 0 to 2
and 5 are the debugger's, coverage's, the profiler's and the optimizer's)."""


def _close_open() -> bool:
    """Close every directory left open: its saves in flight are finished, not lost; whether
    every one of them was (a failed save is printed)."""
    saved = True
    for opened in list(_OPEN):
        if not opened.closed:
            try:
                opened.close()
            except Exception as error:  # every directory is closed, whatever one raises
                print(f"nnxscale: {error}", file=sys.stderr)
                saved = False
    return saved


@functools.cache
def finish_at_program_end() -> bool:
    """Close the open directories when the script's main module ends, normally, by `sys.exit`
    or by an exception; whether the script's main module was found. A script that returns
    normally while a save fails exits with status 1.

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

    def returned(code: types.CodeType, *_: object) -> None:
        if code is main and not _close_open():
            raise SystemExit(1)  # a program whose last save failed does not end well

    def unwound(code: types.CodeType, *_: object) -> None:
        if code is main:
            _close_open()

    monitoring.use_tool_id(MONITORING_TOOL, "nnxscale checkpoints")
    monitoring.register_callback(MONITORING_TOOL, monitoring.events.PY_RETURN, returned)
    monitoring.register_callback(MONITORING_TOOL, monitoring.events.PY_UNWIND, unwound)
    monitoring.set_local_events(MONITORING_TOOL, main, monitoring.events.PY_RETURN)
    monitoring.set_events(MONITORING_TOOL, monitoring.events.PY_UNWIND)
    return True


def together(error: BaseException | None, what: str) -> None:
    """Raise `error` on its own process, and on every other an error of the same kind naming
    the first process that failed to `what`: a process that went on alone into Orbax's
    barriers, or into the next collective, would wait there for the others forever."""
    if jax.process_count() > 1:
        kinds = (DirectoryLockedError, ObjectStorageError, NoCheckpointError, SaveError)
        code = (
            0
            if error is None
            else next((i for i, k in enumerate(kinds, 1) if isinstance(error, k)), len(kinds) + 1)
        )
        codes = multihost_utils.process_allgather(np.int32(code))
        failed = np.flatnonzero(codes)
        if error is None and failed.size:
            first = int(failed[0])
            kind = kinds[codes[first] - 1] if codes[first] <= len(kinds) else RuntimeError
            error = kind(
                f"process {first} could not {what}, so no process goes on: process {first}'s "
                "error says why."
            )
    if error is not None:
        raise error


class Checkpoints:
    """A directory of train-state checkpoints, a local path or a `gs://` URL, managed by Orbax:
    async saves, the last k kept, every step verified when read, one writer at a time.

    The writer's policy (its lock, the steps kept, asynchronous saves, the verified fallback
    of restores) over a read-only view of the directory, `stored` (`Stored`), which its reads
    and restores consult (`nnxscale.checkpoint.restoring`). Its saves still in flight when the
    program's main module ends are finished then (`finish_at_program_end`), unless
    `finish_at_exit=False`: then close it yourself."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int = 3,
        asynchronous: bool = True,
        create: bool = True,
        finish_at_exit: bool = True,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(
                f"keep={keep!r}: a directory keeps its newest `keep` checkpoints and deletes "
                "the others, so it must be a whole number of at least 1."
            )
        self.directory = location(directory)
        self.lock: WriterLock | MarkerLock | None = None
        error = None
        try:
            self._open(create)
        except Exception as failed:  # told to every process, so that none goes on alone
            error = failed
        try:
            together(error, f"open {self.directory}")
            self.discarded = partial_saves(self.directory) if create else []
            written = self._written if asynchronous else None
            self.stored = Stored(
                self.directory, orbax_manager(self.directory, keep, create, written)
            )
        except BaseException:
            if self.lock is not None:  # a directory this writer never opened stays free
                self.lock.release()
            raise
        self.asynchronous = asynchronous
        self.writable = create
        self.times: dict[int, SaveTimes] = {}
        self.skipped: dict[int, str] = {}  # steps the last restore passed over, and why
        self.closed = False
        if finish_at_exit:  # a save still being written when the program ends is finished
            _OPEN.add(self)
            finish_at_program_end()

    def _open(self, create: bool) -> None:
        """Check the directory, within a stated time on object storage, and take the writer's
        lock (process 0) before Orbax may delete an unfinished save."""
        url = is_url(self.directory)
        if url:  # within a stated time, before Orbax could create a bucket named by a typo
            check_bucket(self.directory)
        elif self.directory.exists() and not self.directory.is_dir():
            raise NoCheckpointError(
                f"{self.directory} is a file, not a checkpoint directory: pass a directory's "
                "path (a new one to start saving)."
            )
        if not create and not self.directory.is_dir():
            raise NoCheckpointError(
                f"no checkpoint directory at {self.directory}: check the path, or save "
                "checkpoints there first (Checkpoints(directory).save(trainer))."
            )
        if create:
            self.directory.mkdir(parents=True, exist_ok=True)
            if jax.process_index() == 0:
                self.lock = (MarkerLock if url else WriterLock)(self.directory, LOCK_FILE)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first (`Stored.steps`)."""
        return self.stored.steps()

    def partial(self) -> list[str]:
        """Names of unfinished saves in the directory, which restores ignore (`Stored.partial`)."""
        return self.stored.partial()

    def record(self, step: int | None = None) -> Record:
        """The record of the checkpoint of `step` (default: the latest; `Stored.record`)."""
        return self.stored.record(step)

    def saved_arrays(self, step: int | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
        """Path -> (shape, dtype) of every array of `step` (`Stored.saved_arrays`)."""
        return self.stored.saved_arrays(step)

    def chunks(self, step: int | None = None) -> dict[str, tuple[int, ...]]:
        """Path -> shape of the chunks each array was written in (`Stored.chunks`)."""
        return self.stored.chunks(step)

    def stored_values(self, step: int | None = None) -> dict[str, int]:
        """Key -> bytes of every value in the step's array store (`Stored.stored_values`)."""
        return self.stored.stored_values(step)

    def files(self, step: int | None = None) -> list[tuple[str, int, str]]:
        """(path, bytes, what it holds) of every file of a checkpoint (`Stored.files`)."""
        return self.stored.files(step)

    def restore_state(
        self, values: Any, layout: Layout, step: int | None = None, checks: Any = None
    ) -> Any:
        """The verified saved state of `step`, laid out by `layout` (`restoring.restore_state`)."""
        return restoring.restore_state(self.stored, values, layout, step, checks)

    def restore(
        self,
        model: Any,
        tx: optax.GradientTransformation,
        rules: Rules,
        mesh: Mesh,
        options: TrainOptions | None = None,
        *,
        step: int | None = None,
        data: Batches | None = None,
        other_optimizer: bool = False,
        other_config: bool = False,
        **changes: Any,
    ) -> Trainer:
        """A trainer resumed from the checkpoint of `step` (default: the newest that verifies,
        the steps passed over and why in `skipped`), laid out by `rules` on `mesh`: what
        `nnxscale.checkpoint.restoring.restore` says, for this directory."""
        return restoring.restore(
            self.stored,
            model,
            tx,
            rules,
            mesh,
            options,
            step=step,
            data=data,
            other_optimizer=other_optimizer,
            other_config=other_config,
            skipped=self.skipped,
            **changes,
        )

    def restore_into(
        self,
        trainer: Trainer,
        step: int | None = None,
        data: Batches | None = None,
        *,
        other_optimizer: bool = False,
    ) -> Trainer:
        """Put the checkpoint of `step` (default: the newest that verifies) into `trainer`'s
        state, in its layout (`restoring.restore_into`, for this directory)."""
        return restoring.restore_into(
            self.stored, trainer, step, data, other_optimizer=other_optimizer, skipped=self.skipped
        )

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
        self._check_held()
        start = time.perf_counter()  # waiting for the save before counts as blocked
        self.wait()  # the save before, if it failed, raises SaveError here, naming it
        step = trainer.step_count()
        self._make_room(step, trainer.run, overwrite)
        state = trainer.state  # layers held in rounds (a pipeline) saved as one stack
        state = held_in(state, 1, trainer.layout) if layer_rounds(state) > 1 else state
        record = record_of(trainer, data, state)
        error = None
        try:
            if jax.process_index() == 0 and directory_run(self.directory) != trainer.run:
                claim_directory(self.directory, trainer.run)
        except Exception as failed:  # told to every process before Orbax's barriers
            error = failed
        together(error, f"claim {self.directory} for run {trainer.run[:8]}")
        started = self.stored.manager.save(
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

    def _check_held(self) -> None:
        """Raise, on every process alike, if the lock file or marker no longer names this
        writer (process 0 holds it; the others learn its answer)."""
        error = None
        if self.lock is not None:
            try:
                self.lock.check()
            except Exception as lost:  # any failure, told to every process, not one alone
                error = lost
        together(error, f"find this run holding {self.directory}")

    def _make_room(self, step: int, run: str, overwrite: bool) -> None:
        """Refuse a save Orbax would drop, or one that mixes two runs; with `overwrite`, delete
        the checkpoints in the way instead."""
        steps = sorted(self.stored.manager.all_steps())  # this writer's view: no reload mid-save
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
                self.stored.manager.delete(old)

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
            self.stored.manager.wait_until_finished()
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
                    self.stored.manager.close()
            finally:
                if self.lock is not None:
                    self.lock.release()

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
