"""The launcher runs real multi-process JAX jobs and never leaves a process behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from nnxscale import events
from nnxscale.cli import PROGRAM
from nnxscale.runtime.events import Hello
from nnxscale.runtime.launch import PROCESS_ID, LaunchError, how_it_ended, launch, run, start

WORKER = [*PROGRAM, "collective"]
SLEEPER = [sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(60)"]
DEAF = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('deaf', flush=True); time.sleep(60)"]  # fmt: skip


def gone(pid: int) -> bool:
    """Whether no process (not even a zombie) has this pid any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def running(pid: int) -> bool:
    """Whether a process with this pid runs (a zombie, dead but not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "devices"), [(2, 4), (4, 2)])
def test_processes_form_one_run(processes, devices) -> None:
    output = launch(WORKER, processes, devices, timeout=120, echo=None)
    total = processes * devices
    for index in range(processes):
        mine = [line for line in output if line.startswith(f"[process {index}] ")]
        assert events.read(mine, Hello) == [Hello(index, processes, devices, total, total)]


def test_a_killed_worker_is_named_and_nothing_is_left() -> None:
    run = start([*WORKER, "--hold", "60"], 2, 2, echo=None)
    deadline = time.monotonic() + 120
    while len(events.read(list(run.output), Hello)) < 2:
        assert time.monotonic() < deadline, run.output
        time.sleep(0.1)
    victim = run.workers[1].pid
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(LaunchError, match=rf"process 1 \(pid {victim}\) killed by SIGKILL"):
        run.wait(timeout=60)
    assert all(gone(worker.pid) for worker in run.workers)


@pytest.mark.slow
def test_a_run_over_its_timeout_is_stopped() -> None:
    run = start([*WORKER, "--hold", "60"], 2, 2, echo=None)
    with pytest.raises(LaunchError, match="exceeded its timeout of 10 s"):
        run.wait(timeout=10)
    assert all(gone(worker.pid) for worker in run.workers)


def test_a_process_that_skips_a_collective_is_named_with_what_the_other_waits_in() -> None:
    # Process 1 leaves without the sum that process 0 entered: 0 would wait forever.
    with pytest.raises(LaunchError) as raised:
        launch([*WORKER, "--skip", "1"], 2, 1, timeout=120, echo=None)
    message = str(raised.value)
    assert "process 1 (pid" in message and "left the run" in message
    assert "before process(es) [0] did" in message
    assert "process 0 waits in all-reduce over 'all'" in message


@pytest.mark.parametrize("reports_after", [False, True])
def test_a_worker_waits_in_the_collective_it_entered_until_it_reports_anything_else(
    reports_after: bool,
) -> None:
    # Plain Python workers: process 1 leaves at once, process 0 enters and stays.
    entering = events.Entering(process=0, collective="all-gather over 'data'").line()
    after = events.Step(process=0, step=3, loss=1.0).line()
    script = (
        "import os, sys, time\n"
        f"if os.environ['{PROCESS_ID}'] == '1': sys.exit(0)\n"
        f"print({entering!r}, flush=True)\n"
        + (f"print({after!r}, flush=True)\n" if reports_after else "")
        + "time.sleep(60)\n"
    )
    with pytest.raises(LaunchError, match=r"process 1 \(pid \d+\) exited") as raised:
        launch([sys.executable, "-c", script], 2, 1, timeout=60, echo=None)
    named = "process 0 waits in all-gather over 'data'" in str(raised.value)
    assert named is not reports_after


@pytest.mark.slow
def test_a_run_over_its_timeout_names_what_each_waiting_worker_waits_in() -> None:
    # Process 1 stays, outside the sum: only the timeout ends the run.
    run = start([*WORKER, "--skip", "1", "--hold", "60"], 2, 1, echo=None)
    with pytest.raises(LaunchError, match="exceeded its timeout of 15 s") as raised:
        run.wait(timeout=15)
    assert "; process 0 waits in all-reduce over 'all'" in str(raised.value)
    assert "process 1 waits" not in str(raised.value)
    assert all(gone(worker.pid) for worker in run.workers)


def test_a_stop_request_stops_every_worker() -> None:
    # What the command line's SIGTERM handler does: set a flag, never raise in `wait`.
    stop = threading.Event()
    run = start(SLEEPER, 2, 1, echo=None, stop=stop)
    threading.Timer(1.0, stop.set).start()
    with pytest.raises(LaunchError, match="asked to stop"):
        run.wait(timeout=60)
    assert all(gone(worker.pid) for worker in run.workers)


def test_workers_deaf_to_a_stop_request_are_killed_after_its_grace() -> None:
    # A stop request sends SIGTERM, so that workers may save first (`nnxscale.preemption`);
    # those that do not end within the grace are killed all the same.
    stop = threading.Event()
    run = start(DEAF, 2, 1, echo=None, stop=stop)
    deadline = time.monotonic() + 60
    while len(run.output) < 2:  # both ignore SIGTERM from here on
        assert time.monotonic() < deadline, run.output
        time.sleep(0.05)
    stop.set()
    with pytest.raises(LaunchError, match=r"asked to stop: its workers did not end within 1 s"):
        run.wait(timeout=60, stop_grace=1)
    assert all(gone(worker.pid) for worker in run.workers)


@pytest.mark.slow
def test_the_command_line_exits_non_zero_and_says_why() -> None:
    second_fails = "import os, sys; sys.exit(3 if os.environ['NNXSCALE_PROCESS_ID'] == '1' else 0)"
    done = run([*PROGRAM, "launch", "-n", "2", "--devices", "1", "--",
                sys.executable, "-c", second_fails], timeout=120, check=False)  # fmt: skip
    assert done.returncodes == [1]
    assert "launch failed: process 1 (pid" in done.text and "exit status 3" in done.text


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="workers follow the launcher through Linux")
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_workers_die_with_the_launcher(stop: signal.Signals) -> None:
    outer = start([*PROGRAM, "launch", "-n", "2", "--devices", "1", "--", *SLEEPER], echo=None)
    deadline = time.monotonic() + 60
    while len(outer.output) < 2:  # each worker prints its pid first
        assert time.monotonic() < deadline, outer.output
        time.sleep(0.05)
    pids = [int(line.split()[-1]) for line in list(outer.output)[:2]]
    assert all(running(pid) for pid in pids)
    (launcher,) = outer.workers
    launcher.send_signal(stop)
    assert launcher.wait(timeout=30) == (-stop if stop == signal.SIGKILL else 128 + stop)
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"workers {pids} outlived their launcher"
        time.sleep(0.05)


def test_launching_from_a_process_running_jax_warns_of_nothing() -> None:
    # A fork in a process running JAX makes JAX warn of deadlocks (a chapter launches from its
    # kernel); the launcher must only spawn. Every warning shown: none may appear.
    launches = (
        "import sys, jax; jax.numpy.ones(2).block_until_ready()\n"
        "from nnxscale.runtime.launch import launch\n"
        "print(sorted(launch([sys.executable, '-c', 'print(7)'], 2, 1, echo=None)))"
    )  # sorted: output comes in the order it arrives, and either worker may print first
    done = run([sys.executable, "-W", "always", "-c", launches], timeout=120)
    assert done.output == ["['[process 0] 7', '[process 1] 7']"]  # and no warning


def test_a_command_that_cannot_run_is_named() -> None:
    named = r"(?s)process 0 .* exit status 1.*cannot run no-such-prog"
    with pytest.raises(LaunchError, match=named):
        launch(["no-such-prog"], 1, 1, timeout=60, echo=None)


def test_how_it_ended() -> None:
    assert how_it_ended(-9) == "killed by SIGKILL" and how_it_ended(2) == "exit status 2"


@pytest.mark.parametrize("timeout", [-5, 0, float("nan"), "60"])
def test_a_timeout_that_is_not_seconds_starts_no_worker(timeout, tmp_path: Path) -> None:
    """`launch(..., timeout=-5)` raised only once its workers ran, and left them running."""
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    with pytest.raises(ValueError, match="a number of seconds above 0"):
        launch(command, 2, 1, timeout=timeout, echo=None)
    with pytest.raises(ValueError, match="a number of seconds above 0"):
        run(command, 1, timeout=timeout)
    time.sleep(0.5)
    assert not marker.exists()


def test_a_wait_that_cannot_wait_stops_its_workers() -> None:
    started = start(SLEEPER, 2, 1, echo=None)
    with pytest.raises(ValueError, match="a number of seconds above 0"):
        started.wait(0)
    assert all(gone(worker.pid) for worker in started.workers)
