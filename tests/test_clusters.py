"""Runs where clusters run: a real SLURM (munged, slurmctld and slurmd on this machine, one
node, started and stopped here) and a real Open MPI start the book's training program, which
joins the run through `nnxscale.cluster.join`; a preempted SLURM job resumes, and every
engine's run gives the losses of the book's own launcher, bit for bit."""

from __future__ import annotations

import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nnxscale import cli, cluster, events
from nnxscale.runtime.launch import free_port, launch

pytestmark = pytest.mark.slow

INSTALL = (
    "apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge openmpi-bin"
)
REQUIRED = os.environ.get("NNXSCALE_REQUIRE_CLUSTER") == "1"
SEARCH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
STEPS = 12


def unavailable(message: str) -> None:
    """Fail under NNXSCALE_REQUIRE_CLUSTER=1 (as CI sets it), else skip, saying why."""
    if REQUIRED:
        pytest.fail(message + "; NNXSCALE_REQUIRE_CLUSTER=1 makes the cluster tests mandatory")
    pytest.skip(message)


def need(*programs: str) -> None:
    """Stop the test, naming the install command, when a cluster engine's program is missing."""
    missing = [p for p in programs if shutil.which(p, path=SEARCH) is None]
    if missing:
        unavailable(f"{', '.join(missing)} not found: install them ({INSTALL})")


def losses(lines: list[str]) -> dict[int, float]:
    return {e.step: e.loss for e in events.read(lines, events.Step, process=0)}


def train(directory: Path) -> list[str]:
    """The job script's command, for the engines other than SLURM."""
    return [*cli.PROGRAM, "train", str(directory), "--processes", "2", "--devices", "4",
            "--steps", str(STEPS), "--save-every", "4", "--batch-size", "8"]  # fmt: skip


class Slurm:
    """A one-node SLURM cluster on this machine: its own munge key and socket, its own
    configuration, state and ports, its daemons started in the foreground and stopped by
    `stop`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for sub in ("state", "spool", "munge"):
            (root / sub).mkdir(mode=0o700)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket = root / "munge" / "munge.socket"
        host = platform.node().split(".")[0]  # the short host name slurmd registers under
        self.conf = root / "slurm.conf"
        self.conf.write_text(CONF.format(root=root, host=host, socket=socket,
                                          ctld=free_port(), slurmd=free_port()))  # fmt: skip
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons: list[subprocess.Popen] = []
        log = open(root / "daemons.log", "w")  # noqa: SIM115 (closed by stop)
        self.log = log
        for command in (
            ["munged", "-F", "--force", f"--key-file={key}", f"--socket={socket}",
             f"--pid-file={root / 'munge' / 'munged.pid'}",
             f"--seed-file={root / 'munge' / 'seed'}",
             f"--log-file={root / 'munge' / 'munged.log'}"],
            ["slurmctld", "-D", "-f", str(self.conf)],
            ["slurmd", "-D", "-f", str(self.conf)],
        ):  # fmt: skip
            path = shutil.which(command[0], path=SEARCH)
            self.daemons.append(
                subprocess.Popen([path, *command[1:]], env=self.env, stdout=log, stderr=log)
            )
            if command[0] == "munged":
                self._await(socket.exists, "munged's socket")
        self._await(lambda: "idle" in self.command("sinfo", "-h", "-o", "%t"), "an idle node")

    def _await(self, ready, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline or any(d.poll() is not None for d in self.daemons):
                self.stop()
                raise AssertionError(f"no {what}: {(self.root / 'daemons.log').read_text()}")
            time.sleep(0.2)

    def command(self, *args: str, check: bool = False) -> str:
        done = subprocess.run(args, env=self.env, capture_output=True, text=True, check=check)
        return done.stdout + done.stderr

    def submit(self, script: Path, *options: str, **env: str) -> int:
        """Submit `script` with sbatch, its output to `output`; its job id."""
        output = f"--output={self.root}/job-%j.out"
        out = subprocess.run(
            ["sbatch", "--parsable", f"--chdir={self.root}", output, *options, str(script)],
            env={**self.env, **env}, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return int(out.strip().split(";")[0])

    def state(self, job: int) -> str:
        found = re.search(r"JobState=(\S+)", self.command("scontrol", "show", "job", str(job)))
        return found.group(1) if found else "UNKNOWN"

    def wait(self, job: int, timeout: float = 300) -> str:
        """The job's final state, once it has one."""
        deadline = time.monotonic() + timeout
        while (state := self.state(job)) in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING"):
            assert time.monotonic() < deadline, (state, self.output(job)[-20:])
            time.sleep(0.5)
        return state

    def output(self, job: int) -> list[str]:
        path = self.root / f"job-{job}.out"
        return path.read_text().splitlines() if path.exists() else []

    def stop(self) -> None:
        """Cancel every job, stop the daemons and wait for each to exit."""
        self.command("scancel", "--user", os.environ.get("USER", "root"))
        for daemon in reversed(self.daemons):
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self.log.close()


CONF = """\
ClusterName=book
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmdPort={slurmd}
AuthType=auth/munge
AuthInfo=socket={socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
KillWait=5
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=book Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""
"""One node on localhost with four CPUs (two tasks fit, and three, to be refused), no
cgroups (this machine's tasks are plain processes), no accounting database, and 5 seconds
between a step's SIGTERM and its SIGKILL (`KillWait`, 30 by default)."""


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    need("munged", "slurmctld", "slurmd", "sbatch", "scancel")
    if os.geteuid() != 0:
        unavailable("slurmd starts jobs as root here: run the cluster tests as root")
    cluster_root = tmp_path_factory.mktemp("slurm")
    cluster_root.chmod(0o755)
    started = Slurm(cluster_root)
    yield started
    started.stop()
    assert all(d.poll() is not None for d in started.daemons)


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of the book's own launcher, two processes of four devices each."""
    directory = tmp_path_factory.mktemp("unbroken")
    found = losses(launch(train(directory / "run"), 2, 4, timeout=300, echo=None))
    assert sorted(found) == list(range(STEPS))
    return found


def test_a_slurm_job_trains_is_preempted_and_resumes_equal_to_an_unbroken_run(
    slurm: Slurm, unbroken: dict[int, float]
) -> None:
    script = cluster.job_script("train.sbatch")
    env = {"PYTHON": sys.executable, "CHECKPOINTS": str(slurm.root / "run")}
    job = slurm.submit(script, **env)
    deadline = time.monotonic() + 300
    while not [e for e in events.read(slurm.output(job), events.Step) if e.step >= 1]:
        assert time.monotonic() < deadline and slurm.state(job) in ("PENDING", "RUNNING"), (
            slurm.output(job)[-20:]
        )
        time.sleep(0.2)
    slurm.command("scancel", "--signal=TERM", str(job), check=True)  # the scheduler's notice
    assert slurm.wait(job) == "COMPLETED", slurm.output(job)[-20:]
    first = slurm.output(job)
    joined = events.read(first, events.Joined)
    assert sorted((j.process, j.engine, j.processes, j.local_devices) for j in joined) == [
        (0, "slurm", 2, 4), (1, "slurm", 2, 4)
    ]  # fmt: skip
    (step,) = {e.step for e in events.read(first, events.Preempted)}
    assert 0 < step < STEPS and sorted(losses(first)) == list(range(step))
    again = slurm.submit(script, **env)  # resubmitted: resumes from the agreed step
    assert slurm.wait(again) == "COMPLETED", slurm.output(again)[-20:]
    resumed = slurm.output(again)
    assert [e.step for e in events.read(resumed, events.Resumed)] == [step, step]
    assert {**losses(first), **losses(resumed)} == unbroken  # bit for bit


def test_a_slurm_job_with_another_task_count_is_refused_by_name(slurm: Slurm) -> None:
    env = {"PYTHON": sys.executable, "CHECKPOINTS": str(slurm.root / "three")}
    job = slurm.submit(cluster.job_script("train.sbatch"), "--ntasks=3", **env)
    assert slurm.wait(job) == "FAILED"
    text = "\n".join(slurm.output(job))
    assert "slurm started 3 processes and the program asks for 2" in text
    assert "--ntasks=2" in text
    assert not (slurm.root / "three").exists()  # refused before any state was made


def test_mpirun_trains_to_the_losses_of_the_other_engines(
    tmp_path: Path, unbroken: dict[int, float]
) -> None:
    need("mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    done = subprocess.run(
        ["mpirun", *root, "--oversubscribe", "-n", "2", *train(tmp_path / "run")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = done.stdout.splitlines()
    assert done.returncode == 0, (lines + done.stderr.splitlines())[-20:]
    assert {j.engine for j in events.read(lines, events.Joined)} == {"openmpi"}
    assert losses(lines) == unbroken


DYING = """
import os, signal, sys
from jax.experimental import multihost_utils
from nnxscale import cluster
joined = cluster.join(2, devices=1, heartbeat=10)
multihost_utils.sync_global_devices("both joined")
if joined.process == 1:
    os.kill(os.getpid(), signal.SIGKILL)  # as a host's kernel kills a process for memory
try:
    multihost_utils.sync_global_devices("never reached by process 1")
except Exception as error:  # what the survivor's collective raises
    print("survivor:", type(error).__name__, error, flush=True)
    if sys.argv[1:] != ["go-on"]:
        raise
"""
"""Two processes join; process 1 dies; process 0's collective fails. With `go-on` process 0
goes on to JAX's shutdown barrier, which waits for the heartbeat, so the engine sees the
dead one first: without it, process 0 may exit before the engine has noticed process 1."""


def dying_job(slurm: Slurm, srun: str, *args: str) -> Path:
    program = slurm.root / "dying.py"
    program.write_text(DYING)
    script = slurm.root / f"dying{len(srun)}.sbatch"
    command = " ".join([srun, sys.executable, str(program), *args])
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n{command}\n")
    return script


def test_a_dead_task_ends_the_step_at_once_with_kill_on_bad_exit(slurm: Slurm) -> None:
    job = slurm.submit(dying_job(slurm, "srun --kill-on-bad-exit=1", "go-on"))
    assert slurm.wait(job, 120) == "FAILED"
    text = "\n".join(slurm.output(job))
    assert re.search(r"srun: error: \S+: task 1: Killed", text), text[-2000:]
    assert f"Terminating StepId={job}.0" in text


def test_without_it_the_survivors_collective_fails_and_the_heartbeat_ends_the_rest(
    slurm: Slurm,
) -> None:
    job = slurm.submit(dying_job(slurm, "srun", "go-on"))
    assert slurm.wait(job, 120) == "FAILED"
    text = "\n".join(slurm.output(job))
    assert re.search(r"srun: error: \S+: task 1: Killed", text), text[-2000:]
    assert re.search(r"survivor: \w+ .*Gloo", text), text[-2000:]  # CPU collectives: gloo
    assert "Task 1 heartbeat timeout" in text  # at JAX's shutdown barrier
    assert "Terminating process because the JAX distributed service detected fatal errors" in text


def test_mpirun_names_the_dead_rank_and_stops_the_rest(tmp_path: Path) -> None:
    need("mpirun")
    program = tmp_path / "dying.py"
    program.write_text(DYING)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    done = subprocess.run(
        ["mpirun", *root, "--oversubscribe", "-n", "2", sys.executable, str(program), "go-on"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = done.stdout + done.stderr
    assert done.returncode != 0
    assert re.search(r"mpirun noticed that process rank 1 .* exited on signal 9", text), text
