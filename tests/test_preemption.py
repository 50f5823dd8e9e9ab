"""A run sent SIGTERM, as a scheduler preempts one, saves at a step every process agrees on
and stops; started again, it resumes equal to a run never stopped, loss for loss."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from nnxscale import Checkpoints, cli, events
from nnxscale.runtime.launch import Run, launch, start
from nnxscale.runtime.preemption import Preemption

STEPS = 30
"""Steps of each run: enough that a notice sent as the first step compiles is agreed on
before the last (the agreement takes a fraction of a second)."""


def train(directory: Path) -> list[str]:
    return [*cli.PROGRAM, "train", str(directory), "--steps", str(STEPS), "--save-every", "100",
            "--batch-size", "4"]  # fmt: skip


def losses(output: list[str], process: int = 0) -> dict[int, float]:
    return {e.step: e.loss for e in events.read(output, events.Step, process=process)}


def once_started(run: Run, processes: int, timeout: float = 240) -> None:
    """Return once every worker of `run` has reported its `Start` event."""
    deadline = time.monotonic() + timeout
    while len(events.read(list(run.output), events.Start)) < processes:
        assert time.monotonic() < deadline, run.output[-20:]
        time.sleep(0.05)


def test_a_sigterm_in_one_process_is_noticed_at_the_next_step() -> None:
    before = signal.getsignal(signal.SIGTERM)
    with Preemption() as preemption:
        assert not preemption.reached(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.reached(2)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is given back


@pytest.mark.slow
def test_a_preempted_run_saves_the_agreed_step_and_resumes_equal_to_an_unbroken_one(
    tmp_path,
) -> None:
    unbroken = losses(launch(train(tmp_path / "unbroken"), 2, 1, timeout=240, echo=None))
    assert sorted(unbroken) == list(range(STEPS))
    directory = tmp_path / "preempted"
    launcher = start([*cli.PROGRAM, "launch", "-n", "2", "--devices", "1", "--",
                      *train(directory)], echo=None)  # fmt: skip
    once_started(launcher, 2)
    launcher.workers[0].send_signal(signal.SIGTERM)  # the scheduler's notice, to the launcher
    launcher.wait(240, check=False)
    assert launcher.returncodes == [128 + signal.SIGTERM], launcher.output[-20:]
    output = list(launcher.output)
    (step,) = {e.step for e in events.read(output, events.Preempted)}  # one step, agreed
    assert len(events.read(output, events.Preempted)) == 2 and 0 < step < STEPS
    first = losses(output)
    assert sorted(first) == list(range(step))  # no step after the one saved
    with Checkpoints(directory, create=False) as checkpoints:
        assert checkpoints.steps() == [step]
    resumed = launch(train(directory), 2, 1, timeout=240, echo=None)
    assert [e.step for e in events.read(resumed, events.Resumed)] == [step, step]
    assert {**first, **losses(resumed)} == unbroken  # bit for bit: JSON keeps every float


@pytest.mark.slow
def test_a_single_process_preempted_saves_and_exits_well(tmp_path) -> None:
    run = start(train(tmp_path), 1, 2, echo=None)
    once_started(run, 1)
    run.workers[0].send_signal(signal.SIGTERM)
    run.wait(240)  # exit status 0: it saved, and stopped on purpose
    (preempted,) = events.read(run.output, events.Preempted)
    assert sorted(losses(run.output)) == list(range(preempted.step))
    with Checkpoints(tmp_path, create=False) as checkpoints:
        assert checkpoints.steps() == [preempted.step]
