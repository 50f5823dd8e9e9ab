"""Joining a run whatever started it (`nnxscale.cluster`): each engine read from its own
variables, and a run the engine started with another process count refused by name before
JAX starts. The engines themselves run in tests/test_clusters.py."""

from __future__ import annotations

import pytest

from nnxscale import cli, cluster, events
from nnxscale.runtime.launch import LaunchError

from conftest import run_python

SLURM = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
         "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[01-02],cpu7"}  # fmt: skip
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "4",
            "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911"}  # fmt: skip


@pytest.mark.parametrize(
    ("environ", "engine"),
    [
        ({"NNXSCALE_COORDINATOR": "127.0.0.1:5000", "NNXSCALE_PROCESSES": "2",
          "NNXSCALE_PROCESS_ID": "1"}, cluster.Engine("nnxscale", 1, 2, "127.0.0.1:5000")),
        (SLURM, cluster.Engine("slurm", 1, 2, "gpu")),
        ({**SLURM, "SLURM_STEP_NODELIST": "node001,host2"},
         cluster.Engine("slurm", 1, 2, "node001")),
        (OPEN_MPI, cluster.Engine("openmpi", 1, 4, "10.96.0.1")),
        ({"TPU_WORKER_ID": "3", "TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"},
         cluster.Engine("cloud-tpu", 3, 4, "t0")),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "2"},
         cluster.Engine("kubernetes", 2, None, None)),
        ({"HOME": "/root"}, None),
    ],
    ids=["nnxscale", "slurm", "slurm-list", "openmpi", "cloud-tpu", "kubernetes", "none"],
)  # fmt: skip
def test_each_engine_is_read_from_its_own_variables(environ, engine) -> None:
    assert cluster.detect(environ) == engine


def test_another_process_count_is_refused_with_the_engines_fix() -> None:
    three = {**SLURM, "SLURM_NTASKS": "3"}
    assert cluster.problem(cluster.detect(three), 2, three) == (
        "slurm started 3 processes and the program asks for 2: submit with --ntasks=2 "
        "(#SBATCH --ntasks=2), or ask for 3"
    )
    assert "run mpirun -n 2" in cluster.problem(cluster.detect(OPEN_MPI), 2, OPEN_MPI)
    assert cluster.problem(cluster.detect(SLURM), 2, SLURM) == ""  # as asked
    assert cluster.problem(cluster.detect(SLURM), None, SLURM) == ""  # as many as started
    assert "srun -n 2" in cluster.problem(None, 2, {})  # nothing started the others
    assert cluster.problem(None, 1, {}) == ""


def test_the_batch_script_itself_is_told_to_use_srun() -> None:
    batch = {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_ID", "SLURM_STEP_NODELIST")}
    with pytest.raises(cluster.ClusterError) as error:
        cluster.join(2, environ=batch)
    assert "start the program with srun" in str(error.value)


def test_a_process_no_engine_started_runs_on_its_own() -> None:
    joined = cluster.join(environ={})
    assert joined == events.Joined(0, "none", 1, None, 8)  # the tests' 8 emulated devices


def test_the_command_line_refuses_before_it_trains(tmp_path) -> None:
    train = [
        "train",
        str(tmp_path / "run"),
        "--processes",
        "2",
        "--steps",
        "1",
        "--save-every",
        "1",
    ]
    with pytest.raises(LaunchError) as error:
        cli.run(*train, devices=1, timeout=120)
    assert "no cluster engine started this one" in str(error.value)
    assert not (tmp_path / "run").exists()


def test_the_engines_table_and_the_job_script() -> None:
    assert list(cluster.ENGINES) == ["nnxscale", "slurm", "openmpi", "cloud-tpu", "kubernetes"]
    assert str(cluster.engines()).count("\n") == 1 + len(cluster.ENGINES)
    script = cluster.job_script().read_text()
    assert "#SBATCH --ntasks=2" in script and "--processes 2" in script
    assert "srun --kill-on-bad-exit=1" in script


def test_with_no_engine_jax_itself_finds_no_run_to_join_here() -> None:
    """What `join` asks JAX on the accelerators it found, with no engine's variables (in a
    fresh process: before JAX starts): off a Cloud TPU VM, JAX finds no coordinator, and
    the process runs on its own."""
    code = "from nnxscale import cluster; print(cluster._on_a_tpu_slice({}))"
    assert run_python(code).output[-1] == "False"
