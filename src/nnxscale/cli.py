"""Programs the chapters and tests run in other processes, each with its own devices.

`python -m nnxscale.cli train DIR ...` trains the book's model and checkpoints it into DIR;
`python -m nnxscale.cli restore DIR ...` restores the latest checkpoint of DIR onto a mesh of
its own and reports checksums. A new process is the only way to get another device count:
JAX fixes it when it starts. `run` launches one and returns its output; `crash_during_save`
launches a training run and kills it while it writes a checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnxscale.checkpoint import Checkpoints, checksums
from nnxscale.data import book_batches
from nnxscale.devices import emulate_devices
from nnxscale.launch import COORDINATOR, initialize
from nnxscale.mesh import strategy_mesh
from nnxscale.model import TINY
from nnxscale.rules import RULE_SETS
from nnxscale.train import Trainer, TrainState, adamw

SAVING = re.compile(r"^saving step (\d+)")
LOSS = re.compile(r"^step (\d+) loss (\S+)")


def losses_in(lines: Iterable[str], prefix: str = "") -> dict[int, float]:
    """Step -> loss, from a trainer's output lines (one process's, with its launcher prefix)."""
    found = (LOSS.match(line.removeprefix(prefix)) for line in lines)
    return {int(m[1]): float(m[2]) for m in found if m}


def checksums_in(lines: Iterable[str]) -> dict[int, dict[str, str]]:
    """Step -> the checksums a trainer printed as it started saving that step."""
    return {int(m[1]): json.loads(line.split("checksums ", 1)[1])
            for line in lines if (m := SAVING.match(line))}  # fmt: skip


def _train(args: argparse.Namespace) -> None:
    rules = RULE_SETS[args.rules]
    cfg = TINY.replace(**json.loads(args.config))
    mesh = strategy_mesh(rules)
    batches = book_batches(args.batch_size)
    with Checkpoints(args.directory, keep=args.keep) as checkpoints:
        if checkpoints.steps():
            trainer = checkpoints.restore(adamw(), rules, mesh, data=batches)
            print(f"resumed from step {trainer.step_count()}", flush=True)
        else:
            trainer = Trainer.create(TrainState(cfg, adamw()), rules, mesh)
        start, stop = batches.local_rows(trainer.batch)
        print(f"process {jax.process_index()} of {jax.process_count()}: "
              f"{jax.local_device_count()} of {jax.device_count()} devices, loads rows "
              f"{start}:{stop} of each batch of {batches.batch_size}", flush=True)  # fmt: skip
        while trainer.step_count() < args.steps:
            (loss,) = trainer.train(batches, 1)
            step = trainer.step_count()
            print(f"step {step - 1} loss {loss!r}", flush=True)
            if step % args.save_every == 0 or step == args.steps:
                sums = checksums(trainer.state) if jax.process_count() == 1 else {}
                blocked = checkpoints.save(trainer, batches)
                print(f"saving step {step} (blocked {blocked * 1e3:.0f} ms) "
                      f"checksums {json.dumps(sums)}", flush=True)  # fmt: skip
        print(f"all saves written after {checkpoints.wait() * 1e3:.0f} ms more", flush=True)


def _restore(args: argparse.Namespace) -> None:
    rules = RULE_SETS[args.rules]
    mesh = strategy_mesh(rules)
    with Checkpoints(args.directory, create=False) as checkpoints:
        record = checkpoints.record(args.step)
        start = time.perf_counter()
        trainer = checkpoints.restore(adamw(), rules, mesh, step=record.step)
        jax.block_until_ready(trainer.state)
        seconds = time.perf_counter() - start
    layout = trainer.layout
    print(f"a new process with {jax.device_count()} {jax.devices()[0].platform} devices")
    print(f"checkpoint of step {record.step}, saved under {record.rules['name']} on mesh "
          f"{record.mesh} ({record.devices} devices)")  # fmt: skip
    held = f"{layout.bytes_per_device():,} of {layout.total_bytes():,} bytes per device"
    print(f"restored under {rules.name} on mesh {dict(mesh.shape)} in {seconds:.2f} s: {held}")
    embed = trainer.state["model"]["embed"][...]
    print(f"model/embed {embed.shape}: {embed.sharding.spec}, shards of "
          f"{embed.addressable_shards[0].data.shape} on each device")  # fmt: skip
    sums = checksums(trainer.state)
    print(f"{len(sums)} arrays checksummed")
    if args.report:
        report = {"step": record.step, "devices": jax.device_count(), "seconds": seconds,
                  "checksums": sums}  # fmt: skip
        Path(args.report).write_text(json.dumps(report))


def _collective(args: argparse.Namespace) -> None:
    """In a launched run: sum one number per device over every process, report, then hold."""
    index, count = jax.process_index(), jax.process_count()
    mesh = jax.make_mesh((jax.device_count(),), ("all",))
    ones = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("all")), np.ones(jax.local_device_count(), np.int32)
    )
    total = int(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones))
    print(f"process {index} of {count}: {jax.local_device_count()} local devices, "
          f"{jax.device_count()} in all, sum over every device {total}", flush=True)  # fmt: skip
    time.sleep(args.hold)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, emulate the devices asked for, and run the command."""
    parser = argparse.ArgumentParser(prog="python -m nnxscale.cli", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train and checkpoint (resuming if DIR has one)")
    restore = commands.add_parser("restore", help="restore the latest checkpoint and report")
    collective = commands.add_parser("collective", help="in a launched run: sum over devices")
    collective.add_argument("--hold", type=float, default=0.0, help="seconds to wait after")
    for command in (train, restore):
        command.add_argument("directory")
        command.add_argument("--devices", default=None, help="emulated devices (default: 8)")
        command.add_argument("--rules", default="FSDP", help="DP, FSDP, TP or FSDP+TP")
    train.add_argument("--steps", type=int, required=True, help="train until this step")
    train.add_argument("--save-every", type=int, required=True)
    train.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    train.add_argument("--batch-size", type=int, default=16)
    train.add_argument("--config", default="{}", help="JSON changes to the TINY model config")
    restore.add_argument("--step", type=int, default=None, help="default: the latest")
    restore.add_argument("--report", default=None, help="write checksums here as JSON")
    args = parser.parse_args(argv)
    if COORDINATOR in os.environ:  # a launched worker: devices and peers from the launcher
        initialize()
    else:
        emulate_devices(args.devices)
    {"train": _train, "restore": _restore, "collective": _collective}[args.command](args)


def run(*args: str, devices: int, timeout: float = 300) -> str:
    """Run `python -m nnxscale.cli ARGS` with `devices` devices; its output, or an error with it."""
    command = [sys.executable, "-m", "nnxscale.cli", *args, "--devices", str(devices)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        raise RuntimeError(
            f"{' '.join(command[1:])} exited with {done.returncode}:\n{done.stdout}{done.stderr}"
        )
    return done.stdout


@dataclasses.dataclass
class Crash:
    """What a training run killed during a save printed before it died."""

    output: list[str]
    losses: dict[int, float]
    checksums: dict[int, dict[str, str]]
    killed_at: int
    returncode: int


def crash_during_save(
    directory: str | Path, *, steps: int, save_every: int, devices: int, rules: str = "FSDP",
    batch_size: int = 16, config: str = "{}", timeout: float = 300,
) -> Crash:  # fmt: skip
    """Train to `steps`, saving every `save_every`; SIGKILL the process as its last save starts.

    The process prints `saving step k` as soon as Orbax has taken the state off the devices
    and the write has begun in the background; the kill lands while the files are written.
    """
    command = [
        sys.executable, "-m", "nnxscale.cli", "train", str(directory), "--devices", str(devices),
        "--rules", rules, "--steps", str(steps), "--save-every", str(save_every),
        "--batch-size", str(batch_size), "--config", config,
    ]  # fmt: skip
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    output = []
    timer = threading.Timer(timeout, child.kill)
    timer.start()
    try:
        for line in child.stdout:
            if (saving := SAVING.match(line)) and int(saving[1]) == steps:
                os.kill(child.pid, signal.SIGKILL)
            output.append(line.rstrip("\n"))
    finally:
        timer.cancel()
        if child.poll() is None:
            child.kill()
        child.wait()
    sums = checksums_in(output)
    if child.returncode == -signal.SIGKILL and steps not in sums:
        raise TimeoutError(f"{' '.join(command[1:])} ran over {timeout} s and was killed")
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"the training run ended with {child.returncode} before its step-{steps} save "
            "could be interrupted:\n" + "\n".join(output)
        )
    return Crash(output, losses_in(output), sums, steps, child.returncode)


if __name__ == "__main__":
    main()
