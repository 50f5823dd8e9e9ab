"""Preemption: a scheduler's SIGTERM turned into a save at a step every process agrees on.

A scheduler that takes machines back (a preemptible VM, a job of higher priority) sends each
process SIGTERM and, some seconds later, SIGKILL. The processes of one run must save the same
step, since a save is collective, and a notice reaches them at different steps (or reaches
one host only). In a run of several processes, JAX's preemption service, which
`jax.distributed.initialize` starts, catches the SIGTERM, tells every process, and picks the
step at which all of them save: one past the largest step any of them had reached
(`jax.experimental.multihost_utils.reached_preemption_sync_point`, which Orbax's
`CheckpointManager.reached_preemption` wraps). Every process must ask at every step, from the
same first step. In a single process, a SIGTERM handler sets a flag that the next step reads.
"""

from __future__ import annotations

import signal
import threading
from types import TracebackType

import jax
from jax.experimental import multihost_utils


class PreemptionError(RuntimeError):
    """A run of several processes whose preemption notices cannot be agreed on."""


class Preemption:
    """Whether to save and stop at a step, the same answer on every process (`reached`).
    A context manager; in a single process it handles SIGTERM while open (from the main
    thread only, as Python's signals require) and gives the handler back when closed."""

    def __init__(self) -> None:
        self.distributed = jax.process_count() > 1
        self.noticed = threading.Event()
        self._previous: object = None

    def __enter__(self) -> Preemption:
        if not self.distributed:
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self.noticed.set())
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
            self._previous = None

    def reached(self, step: int) -> bool:
        """Whether every process saves at `step` and stops: asked once a step, by every
        process, with the step's number (the steps done)."""
        if not self.distributed:
            return self.noticed.is_set()
        try:
            return multihost_utils.reached_preemption_sync_point(step)
        except RuntimeError as error:
            raise PreemptionError(
                f"JAX's preemption service is not running ({error}): start the run with "
                "jax.distributed.initialize (nnxscale.launch does) and leave "
                "jax_enable_preemption_service on, so that every process saves the same step."
            ) from error
