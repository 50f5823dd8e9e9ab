"""Joining a run of many processes, whatever started it: the book's launcher
(`nnxscale.launch`), SLURM's `srun`, Open MPI's `mpirun`, a Cloud TPU slice's workers, or a
Kubernetes Job.

Each engine starts one process per task and tells it, in its environment, which process it
is, how many there are and where the coordinator runs; each names these its own way
(`ENGINES`). `join` reads which engine started this process (`detect`), refuses before JAX
starts a run whose engine started another number of processes than the program asks for,
emulates the devices asked for, and calls `jax.distributed.initialize`: with the launcher's
address, count and id, or with no arguments under any other engine, whose variables JAX's
own cluster detection reads. It returns what it joined (`events.Joined`).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from types import TracebackType

from nnxscale.core.show import Markdown, table
from nnxscale.runtime import events
from nnxscale.runtime.devices import emulate_devices
from nnxscale.runtime.launch import COORDINATOR, PROCESS_ID, PROCESSES

ENGINES = {
    "nnxscale": (
        "python -m nnxscale launch -n N, on one machine",
        "NNXSCALE_PROCESS_ID",
        "NNXSCALE_PROCESSES",
        "NNXSCALE_COORDINATOR: a free port of this machine",
        "NNXSCALE_DEVICES emulated CPU devices",
    ),
    "slurm": (
        "srun, inside an sbatch job",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "the step's first node (SLURM_STEP_NODELIST), a port from SLURM_JOB_ID",
        "the GPUs the task gets (--gpus-per-task)",
    ),
    "openmpi": (
        "mpirun -n N (Open MPI 4)",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "mpirun's host (OMPI_MCA_orte_hnp_uri), a port from its job id",
        "the GPUs CUDA_VISIBLE_DEVICES leaves it",
    ),
    "cloud-tpu": (
        "gcloud compute tpus tpu-vm ssh --worker=all, or xpk",
        "TPU_WORKER_ID, or the VM's metadata server",
        "the slice's hosts (TPU_WORKER_HOSTNAMES)",
        "worker 0 (MEGASCALE_COORDINATOR_ADDRESS)",
        "the host's TPU chips",
    ),
    "kubernetes": (
        "a JobSet or indexed Job, one pod per host",
        "the pod's index (JOB_COMPLETION_INDEX)",
        "the job's pods, from the API server (pip install 'jax[k8s]')",
        "pod 0, found through the API server",
        "the pod's accelerators (google.com/tpu, nvidia.com/gpu)",
    ),
}
"""What each engine JAX joins provides, and where: what starts the processes, the process
id, the process count, the coordinator, and the devices of each process."""


def engines() -> Markdown:
    """`ENGINES` as a table."""
    heads = ["engine", "started by", "process id", "process count", "coordinator", "devices"]
    return table(heads, [[name, *row] for name, row in ENGINES.items()])


def job_script(name: str = "train.sbatch") -> Path:
    """A job script of the book (`nnxscale/runtime/jobs`): the very file the tests submit
    and chapter 8 shows."""
    return Path(str(resources.files("nnxscale.runtime") / "jobs" / name))


class ClusterError(RuntimeError):
    """A run that cannot join as started; the message names the engine and the fix."""


@dataclasses.dataclass(frozen=True)
class Engine:
    """What the environment says started this process: the engine (a key of `ENGINES`), and
    the process id, process count and coordinator it gives, where it gives them."""

    name: str
    process_id: int | None
    processes: int | None
    coordinator: str | None


def detect(environ: Mapping[str, str] = os.environ) -> Engine | None:
    """The engine that started this process, read from `environ`; None for a process that
    no engine started (a notebook, a plain `python`)."""
    get = environ.get
    if COORDINATOR in environ:
        return Engine("nnxscale", int(environ[PROCESS_ID]), int(environ[PROCESSES]),
                      environ[COORDINATOR])  # fmt: skip
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        nodes = get("SLURM_STEP_NODELIST")
        first = re.split(r"[,\[]", nodes)[0] if nodes else None
        return Engine("slurm", int(environ["SLURM_PROCID"]), int(get("SLURM_NTASKS", "1")), first)
    if "OMPI_COMM_WORLD_SIZE" in environ:
        found = re.search(r"tcp6?://\[?([^,:\]]+)", get("OMPI_MCA_orte_hnp_uri", ""))
        rank, size = int(get("OMPI_COMM_WORLD_RANK", "0")), int(environ["OMPI_COMM_WORLD_SIZE"])
        return Engine("openmpi", rank, size, found.group(1) if found else None)
    hosts = get("TPU_WORKER_HOSTNAMES")
    if hosts or "TPU_WORKER_ID" in environ or "MEGASCALE_COORDINATOR_ADDRESS" in environ:
        worker = get("TPU_WORKER_ID")
        listed = hosts.split(",") if hosts else []
        coordinator = get("MEGASCALE_COORDINATOR_ADDRESS") or (listed[0] if listed else None)
        return Engine("cloud-tpu", int(worker) if worker else None, len(listed) or None,
                      coordinator)  # fmt: skip
    if "KUBERNETES_SERVICE_HOST" in environ and "JOB_COMPLETION_INDEX" in environ:
        return Engine("kubernetes", int(environ["JOB_COMPLETION_INDEX"]), None, None)
    return None


def problem(
    engine: Engine | None, processes: int | None, environ: Mapping[str, str] = os.environ
) -> str:
    """Why this process cannot join a run of `processes` processes (None: as many as the
    engine started) as `engine` started it, naming the fix; "" when it can."""
    if engine is None:
        if processes in (None, 1):
            return ""
        return (
            f"{processes} processes were asked for and no cluster engine started this one (no "
            "SLURM, Open MPI, Cloud TPU, Kubernetes or nnxscale.launch variables): start them "
            f"with srun -n {processes}, mpirun -n {processes} or nnxscale.launch, or ask for 1"
        )
    if engine.name == "slurm" and "SLURM_STEP_ID" not in environ:
        return (
            "this process is SLURM's batch script itself, not one of a step's tasks: start "
            "the program with srun inside the script (srun python -m nnxscale train ...), "
            "which starts one process per task"
        )
    if processes is None or engine.processes in (None, processes):
        return ""
    fixes = {
        "slurm": f"submit with --ntasks={processes} (#SBATCH --ntasks={processes})",
        "openmpi": f"run mpirun -n {processes}",
        "nnxscale": f"launch {processes} processes (python -m nnxscale launch -n {processes})",
        "cloud-tpu": f"use a slice of {processes} hosts",
    }
    return (
        f"{engine.name} started {engine.processes} processes and the program asks for "
        f"{processes}: {fixes[engine.name]}, or ask for {engine.processes}"
    )


def join(
    processes: int | None = None,
    devices: int | str | None = None,
    *,
    timeout: int = 300,
    heartbeat: int = 100,
    environ: Mapping[str, str] = os.environ,
) -> events.Joined:
    """Join the run that started this process, before anything else touches JAX: refuse a
    process count other than `processes` (when given), emulate `devices` devices (default
    $NNXSCALE_DEVICES or 8; "native" for the accelerators found), then
    `jax.distributed.initialize`, which waits `timeout` seconds for the coordinator and
    declares a process dead after `heartbeat` seconds of silence. A process no engine's
    variables name runs on its own, unless it runs on the accelerators JAX found and JAX's
    own detection finds a run (a Cloud TPU VM's metadata server names its slice). An
    uncaught exception in a joined process then exits it at once, rather than wait at JAX's
    exit barrier for processes that will never reach it."""
    engine = detect(environ)
    why = problem(engine, processes, environ)
    if why:
        raise ClusterError(why)
    emulated = emulate_devices(devices)
    import jax

    waits = {"initialization_timeout": timeout, "heartbeat_timeout_seconds": heartbeat}
    if engine is None:
        if emulated is None and _on_a_tpu_slice(waits):
            return _joined(Engine("cloud-tpu", None, None, None))
        return events.Joined(0, "none", 1, None, jax.local_device_count())
    if engine.name == "nnxscale":
        jax.distributed.initialize(engine.coordinator, engine.processes, engine.process_id, **waits)
    else:
        jax.distributed.initialize(**waits)  # JAX's cluster detection reads the variables
    if engine.processes is not None and jax.process_count() != engine.processes:
        raise ClusterError(
            f"{engine.name} started {engine.processes} processes and JAX joined "
            f"{jax.process_count()}: set JAX's cluster detection to the engine that started "
            "them (jax.distributed.initialize(cluster_detection_method=...))"
        )
    return _joined(engine)


def _on_a_tpu_slice(waits: Mapping[str, int]) -> bool:
    """On the accelerators JAX found, with no engine's variables: whether JAX's own detection
    finds a run to join, which only a Cloud TPU VM's metadata server can name (JAX asks it);
    elsewhere JAX says it found no coordinator, and the process runs on its own."""
    import jax

    try:
        jax.distributed.initialize(**waits)
    except ValueError as error:
        if "coordinator_address" not in str(error):
            raise
        return False
    return True


def _joined(engine: Engine) -> events.Joined:
    """The run JAX joined, as `engine` started it; an uncaught exception then exits at once."""
    import jax

    index = jax.process_index()
    sys.excepthook = _exit_at_once
    # Runs before JAX's own exit handler, which waits for every other process at a barrier.
    atexit.register(lambda: events.emit(events.Leaving(process=index)))
    count, local = jax.process_count(), jax.local_device_count()
    return events.Joined(index, engine.name, count, engine.coordinator, local)


def _exit_at_once(kind: type[BaseException], error: BaseException, trace: TracebackType) -> None:
    """A joined process's uncaught exception: print it and exit with status 1 at once,
    rather than wait at JAX's exit barrier for processes that will never get there."""
    sys.__excepthook__(kind, error, trace)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)
