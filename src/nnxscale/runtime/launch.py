"""Start local processes, and always tear them all down: the one way the library, its
chapters, tests and benchmarks start another Python (or JAX) process.

`run` starts one process with its own emulated devices (`NNXSCALE_DEVICES`: JAX fixes the
device count when it starts, so another count needs another process). `launch` starts N that
form one distributed JAX run: the launcher picks a free port for the coordinator and passes
each worker its part through the environment (`NNXSCALE_COORDINATOR`, `NNXSCALE_PROCESSES`,
`NNXSCALE_PROCESS_ID`, `NNXSCALE_DEVICES`); the worker calls `nnxscale.cluster.join()`
before anything else touches JAX, as it would under SLURM or Open MPI. Output (stdout and
stderr) is streamed line by line, with a `[process i]` prefix when there are several. When a
worker fails (non-zero exit, killed by a signal) or the run takes longer than its timeout,
the launcher kills every worker still running, waits for all of them, and raises
`LaunchError` naming which worker ended how. Should the launcher itself die, even by
SIGKILL, Linux kills its workers too: each worker starts as a small stdlib-only Python that
asks for that (`PR_SET_PDEATHSIG`) and then execs the command, so the launcher never forks
(a fork in a process running JAX would make JAX warn of deadlocks).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import NoReturn

COORDINATOR, PROCESSES, PROCESS_ID = (
    "NNXSCALE_COORDINATOR",
    "NNXSCALE_PROCESSES",
    "NNXSCALE_PROCESS_ID",
)


GRACE = 2.0
"""Seconds a distributed run may go on after one worker ended or left it, before the
launcher names that worker: the others would wait for it in their next collective forever
(the workers of a run that ends well leave within a fraction of a second of each other)."""

PORT_TAKEN = ("Failed to add port", "Failed to start RPC server", "Address already in use")
"""What the coordinator prints when its port was taken between choosing it and binding it."""

PR_SET_PDEATHSIG = 1
"""prctl(2) option: the signal the kernel sends a process when the thread that started it exits."""


class LaunchError(RuntimeError):
    """A distributed run that did not finish cleanly; the message names the worker and how."""


def free_port() -> int:
    """A TCP port on localhost that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def exec_dying_with(launcher: int, command: Sequence[str]) -> NoReturn:
    """In a new worker: have Linux SIGKILL it when the launcher dies, then become `command`."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
        sys.exit(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != launcher:  # the launcher died before the request took effect
        sys.exit(f"the launcher (pid {launcher}) is gone; not starting {command[0]}")
    try:
        os.execvp(command[0], list(command))  # the same process: pid and death signal stay
    except OSError as error:
        sys.exit(f"cannot run {command[0]}: {error}")


def guarded(command: Sequence[str]) -> list[str]:
    """`command`, on Linux wrapped to die with this process (see `exec_dying_with`)."""
    if sys.platform != "linux":
        return list(command)
    # -I: the wrapper needs only the standard library, whatever the environment holds.
    return [sys.executable, "-I", __file__, "--die-with", str(os.getpid()), "--", *command]


def how_it_ended(returncode: int) -> str:
    """'exit status 3' or 'killed by SIGKILL'."""
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exit status {returncode}"


@dataclasses.dataclass
class Run:
    """A running group of workers: their processes and, when done, their output."""

    workers: list[subprocess.Popen[str]]
    output: list[str] = dataclasses.field(default_factory=list)
    """Every line the workers printed, in the order it arrived."""
    stop_requested: threading.Event = dataclasses.field(default_factory=threading.Event)
    """Set (from a signal handler, say) to stop the run: `wait` stops every worker and raises.
    A flag and not an exception, which could land inside `subprocess`'s own locking."""
    left: dict[int, float] = dataclasses.field(default_factory=dict)
    """Worker -> when (`time.monotonic()`) it reported leaving the run (`events.Leaving`)."""
    entering: dict[int, str] = dataclasses.field(default_factory=dict)
    """Worker -> the collective it reported entering (`events.Entering`) and has not reported
    anything since: what it waits in, should the run hang."""
    _readers: list[threading.Thread] = dataclasses.field(default_factory=list)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    @property
    def returncodes(self) -> list[int | None]:
        """Each worker's exit status (negative: killed by that signal), None while it runs."""
        return [w.poll() for w in self.workers]

    def port_taken(self) -> bool:
        """Whether the run failed because its coordinator's port was taken."""
        return any(marker in line for line in self.output for marker in PORT_TAKEN)

    @property
    def text(self) -> str:
        """The output as one string."""
        return "\n".join(self.output)

    def wait(
        self, timeout: float, *, check: bool = True, grace: float = GRACE, stop_grace: float = 60
    ) -> list[str]:
        """Wait for every worker and return the output. With `check`, the first worker that
        fails (non-zero exit, killed), or that ends or leaves the run while others go on
        running for `grace` seconds (they would wait for it forever), stops the run; so does
        the timeout. Then every worker is killed and LaunchError names it, with the last lines.
        A stop request (`stop_requested`: the command line's SIGTERM) sends each worker SIGTERM,
        as a scheduler does: workers that save and exit well within `stop_grace` seconds
        (`nnxscale.preemption`) end the run well; any other end stops it, as above.
        """
        try:
            _check_timeout(timeout)
        except ValueError:
            self.stop()  # a wait that cannot wait leaves no worker behind
            raise
        deadline = time.monotonic() + timeout
        ended: dict[int, float] = {}
        failure, asked = None, None
        try:
            while failure is None:
                codes = self.returncodes  # poll every worker, every time
                now = time.monotonic()
                for i, code in enumerate(codes):
                    if code is not None:
                        ended.setdefault(i, now)
                if all(code is not None for code in codes) and not (check and any(codes)):
                    break
                failure = self._failure(codes, ended, now, grace) if check else None
                if failure is None and now > deadline:
                    running = [i for i, code in enumerate(codes) if code is None]
                    failure = f"the run exceeded its timeout of {timeout:g} s{self._waits(running)}"
                if asked is None and self.stop_requested.is_set():
                    asked = now
                    self._signal(signal.SIGTERM)
                if failure is None and asked is not None and now - asked > stop_grace:
                    failure = f"its workers did not end within {stop_grace:g} s of SIGTERM"
                if asked is not None and failure is not None:
                    failure = f"the run was asked to stop: {failure}"
                time.sleep(0.05)
        finally:
            self.stop()
        if failure and self.port_taken():
            failure = (
                f"the coordinator could not listen on its port ({failure}): another program "
                "took it as the run started. Pass another port, or none to let the launcher "
                "choose a free one and retry"
            )
        if failure:
            raise LaunchError(
                f"{failure}; every other worker was stopped. Last output:\n"
                + "\n".join(self.output[-20:])
            )
        return self.output

    def _failure(
        self, codes: list[int | None], ended: dict[int, float], now: float, grace: float
    ) -> str | None:
        """What went wrong, if anything: a worker that failed, or one that ended or left the
        run more than `grace` seconds before some other worker did."""
        for i, code in enumerate(codes):
            if code not in (None, 0):
                return f"process {i} (pid {self.workers[i].pid}) {how_it_ended(code)}"
        running = [i for i, code in enumerate(codes) if code is None]
        for i, since in sorted({**self.left, **ended}.items(), key=lambda item: item[1]):
            stuck = [j for j in running if j != i and j not in self.left]
            if stuck and now - since > grace:
                how = "exited with status 0" if i in ended else "left the run (its program ended)"
                return (
                    f"process {i} (pid {self.workers[i].pid}) {how} {now - since:.1f} s before "
                    f"process(es) {stuck} did, which would wait for it in the run forever"
                    + self._waits(stuck)
                )
        return None

    def _waits(self, workers: list[int]) -> str:
        """'; process 0 waits in <collective>' for each of `workers` that reported entering one."""
        return "".join(
            f"; process {i} waits in {self.entering[i]}" for i in workers if i in self.entering
        )

    def _signal(self, number: signal.Signals) -> None:
        """Send `number` to every worker and every process it started (its process group)."""
        for worker in self.workers:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(worker.pid, number)  # the group outlives its first process

    def stop(self) -> None:
        """Kill every worker and every process it started (its process group), reap them all
        and finish reading their output."""
        self._signal(signal.SIGKILL)
        for worker in self.workers:
            worker.wait()
        for reader in self._readers:
            reader.join(timeout=5)


def _environment(
    env: dict[str, str] | None, processes: int, index: int, devices: int | None, coordinator: str
) -> dict[str, str]:
    """Worker `index`'s environment: this one's with `env`, its devices and, in a run of
    several processes, its part of the distributed run."""
    worker_env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    if devices is not None:
        worker_env["NNXSCALE_DEVICES"] = str(devices)
    if processes > 1:
        worker_env.update(
            {COORDINATOR: coordinator, PROCESSES: str(processes), PROCESS_ID: str(index)}
        )
    return worker_env


def _check_timeout(timeout: object) -> None:
    """Refuse a timeout that is not a number of seconds above 0 (NaN included)."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(f"timeout={timeout!r}: give the run a number of seconds above 0")


def _check_start(
    command: Sequence[str], processes: int, devices: int | None, port: int | None
) -> None:
    """Refuse what `start` cannot start, before anything runs."""
    if isinstance(command, str):
        raise TypeError(
            f"command={command!r}: pass the program and its arguments as a list, such as "
            "[sys.executable, 'worker.py']"
        )
    counts = (processes, 1 if devices is None else devices)
    if any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
        raise ValueError(f"processes and devices are whole numbers, got {processes}, {devices}")
    if processes < 1 or (devices is not None and devices < 1):
        raise ValueError(f"need at least 1 process and 1 device each, got {processes}, {devices}")
    if port is not None and processes > 1:
        check_port(port)


def start(
    command: Sequence[str],
    processes: int = 1,
    devices: int | None = None,
    *,
    echo: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    cwd: str | Path | None = None,
    port: int | None = None,
) -> Run:
    """Start `processes` copies of `command` in `cwd`, each with `devices` emulated devices
    (None: as the environment says); several form one distributed run, its coordinator on
    `port` (default: a free one).

    Call `wait` on the result from the same thread: on Linux a worker is killed when the
    thread that started it ends. Setting `stop` makes `wait` stop the run.
    """
    _check_start(command, processes, devices, port)
    coordinator = f"localhost:{port or free_port()}" if processes > 1 else ""
    run = Run([]) if stop is None else Run([], stop_requested=stop)
    for index in range(processes):
        worker_env = _environment(env, processes, index, devices, coordinator)
        worker = subprocess.Popen(
            guarded(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=worker_env,
            cwd=cwd,
            start_new_session=True,  # its own process group: teardown kills what it starts
        )
        run.workers.append(worker)

        prefix = f"[process {index}] " if processes > 1 else ""

        def read(stream=worker.stdout, prefix=prefix, index=index) -> None:
            # imported here: the worker's wrapper imports only the stdlib
            from nnxscale.runtime import events

            with stream:
                for line in stream:
                    event = events.parse(line)
                    if isinstance(event, events.Leaving):
                        run.left.setdefault(index, time.monotonic())
                    if isinstance(event, events.Entering):
                        run.entering[index] = event.collective
                    elif event is not None:
                        run.entering.pop(index, None)
                    line = prefix + line.rstrip("\n")
                    with run._lock:  # one echo at a time: print writes a line, then its end
                        run.output.append(line)
                        if echo is not None:
                            echo(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        run._readers.append(reader)
    return run


def launch(
    command: Sequence[str],
    processes: int,
    devices: int,
    *,
    timeout: float = 300,
    echo: Callable[[str], None] | None = print,
    env: dict[str, str] | None = None,
    stop: threading.Event | None = None,
    port: int | None = None,
) -> list[str]:
    """Run `command` as `processes` workers of one distributed run; their prefixed output.
    Without a `port`, a coordinator that finds its port taken (another program bound it
    after the launcher chose it) is started again on another, up to three times."""
    _check_timeout(timeout)  # before any worker starts
    for attempt in range(3):
        run = start(command, processes, devices, echo=echo, env=env, stop=stop, port=port)
        try:
            return run.wait(timeout)
        except LaunchError:
            if port is not None or attempt == 2 or not run.port_taken():
                raise
    raise AssertionError("unreachable")


def check_port(port: int) -> None:
    """Raise LaunchError unless the coordinator can listen on `port` here."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("localhost", port))
        except OSError as error:
            raise LaunchError(
                f"the coordinator cannot listen on port {port} ({error.strerror}): another "
                "program uses it. Pass another port, or none to let the launcher choose a "
                "free one."
            ) from None


def run(
    command: Sequence[str],
    devices: int | None = None,
    *,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    check: bool = True,
    cwd: str | Path | None = None,
) -> Run:
    """Run `command` (a Python program, or any other) as one process in `cwd`, with `devices`
    emulated devices (None: as the environment says), and wait for it; the finished run
    (`output`, `returncodes`, `text`). With `check`, a non-zero exit raises LaunchError with
    its last lines; running past `timeout` raises it either way."""
    _check_timeout(timeout)
    finished = start(command, 1, devices, echo=None, env=env, cwd=cwd)
    finished.wait(timeout, check=check)
    return finished


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m nnxscale launch -n 2 --devices 4 -- python worker.py`: exit 1 on failure."""
    parser = argparse.ArgumentParser(prog="python -m nnxscale launch", description=__doc__)
    parser.add_argument("-n", "--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="emulated devices per process")
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--die-with", type=int, metavar="PID", help=argparse.SUPPRESS)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run; put it after --")
    if args.die_with is not None:  # a worker's wrapper, started by `guarded`
        exec_dying_with(args.die_with, command)
    # Stopped with SIGTERM (as by a scheduler): `wait` passes it on to the workers, which may
    # save and exit (`nnxscale.preemption`); then exit 128 + 15 either way.
    terminated = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: terminated.set())
    try:
        launch(
            command,
            args.processes,
            args.devices,
            timeout=args.timeout,
            echo=partial(print, flush=True),
            stop=terminated,
        )
    except LaunchError as error:
        print(f"launch failed: {error}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM if terminated.is_set() else 1)
    if terminated.is_set():  # the workers saved and stopped: the run did not finish
        sys.exit(128 + signal.SIGTERM)


if __name__ == "__main__":
    main()
