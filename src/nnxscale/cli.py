"""Programs the chapters and tests run in other processes, each with its own devices.

`python -m nnxscale train DIR ...` trains the book's model and checkpoints it into DIR;
`python -m nnxscale restore DIR ...` restores the latest checkpoint of DIR onto a mesh of
its own and reports checksums. A new process is the only way to get another device count:
JAX fixes it when it starts. `run` launches one and returns its output; `crash_during_save`
launches a training run and kills it while it writes a checkpoint.

What a command reports, it prints as JSON lines, one event each: `{"event": KIND,
"process": I, ...}`, where I is the JAX process index; `events` reads them back. The kinds:

- train: `start` (`processes`, `local_devices`, `devices`, `rows` [start, stop] of each
  batch of `batch_size` this process loads), `resumed` (`step`) when DIR held a checkpoint,
  `step` (`step`, `loss`: the loss of that step, exactly, for every step), `checksums`
  (`step`, `sums`: array path -> checksum, in one-process runs only) as a save of `step`
  begins, `saving` (`step`, `blocked_seconds`) once the save writes in the background, and
  `written` (`waited_seconds`) when every save is on disk.
- restore: `restored` (`step`, `devices`, `platform`, `saved` {`rules`, `mesh`, `devices`},
  `rules`, `mesh`, `seconds`, `bytes_per_device`, `total_bytes`, `embed` {`shape`, `spec`,
  `shard_shape`}, `arrays`: how many were checksummed).
- collective: `hello` (`processes`, `local_devices`, `devices`, `sum`).
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnxscale.checkpoint import Checkpoints, checksums
from nnxscale.data import book_batches
from nnxscale.devices import emulate_devices
from nnxscale.launch import COORDINATOR, initialize
from nnxscale.mesh import make_mesh
from nnxscale.model import TINY, Transformer, create
from nnxscale.rules import RULE_SETS, strategy_mesh
from nnxscale.train import Trainer, adamw

PROGRAM = (sys.executable, "-m", "nnxscale")
"""The command line that starts the library's programs (`nnxscale.__main__`)."""

PREFIX = re.compile(r"^\[process (\d+)\] ")
"""What the launcher puts before each line of a worker's output."""


def emit(event: str, **fields: Any) -> None:
    """Print one event as a JSON line: `{"event": event, "process": index, **fields}`."""
    print(json.dumps({"event": event, "process": jax.process_index(), **fields}), flush=True)


def events(
    lines: str | Iterable[str], kind: str | None = None, process: int | None = None
) -> list[dict[str, Any]]:
    """The events in a command's output (a string or its lines), optionally of one kind or process.

    Lines that are not a JSON object with an `"event"` (warnings, logs) are skipped. A
    launcher's `[process N] ` prefix is removed; an event without a `"process"` gets N.
    """
    found = []
    for line in lines.splitlines() if isinstance(lines, str) else lines:
        line = line.rstrip("\n")
        prefix = PREFIX.match(line)
        text = line[prefix.end() :] if prefix else line
        try:
            event = json.loads(text)
        except ValueError:
            continue
        if not isinstance(event, dict) or "event" not in event:
            continue
        if prefix and "process" not in event:
            event["process"] = int(prefix[1])
        if kind is not None and event["event"] != kind:
            continue
        if process is not None and event.get("process") != process:
            continue
        found.append(event)
    return found


def _train(args: argparse.Namespace) -> None:
    rules = RULE_SETS[args.rules]
    cfg = TINY.replace(**json.loads(args.config))
    mesh = strategy_mesh(rules)
    batches = book_batches(args.batch_size)
    with Checkpoints(args.directory, keep=args.keep) as checkpoints:
        if checkpoints.steps():
            trainer = checkpoints.restore(
                Transformer.from_config, adamw(), rules, mesh, data=batches
            )
            emit("resumed", step=trainer.step_count())
        else:
            trainer = Trainer.create(create(cfg), adamw(), rules, mesh)
        start, stop = batches.local_rows(trainer.batch_sharding)
        emit(
            "start",
            processes=jax.process_count(),
            local_devices=jax.local_device_count(),
            devices=jax.device_count(),
            device_ids=[d.id for d in jax.local_devices()],
            mesh_axes=list(mesh.axis_names),
            mesh_device_ids=mesh.device_ids.tolist(),
            rows=[start, stop],
            batch_size=batches.batch_size,
        )
        while trainer.step_count() < args.steps:
            (loss,) = trainer.train(batches, 1)
            step = trainer.step_count()
            emit("step", step=step - 1, loss=float(loss))  # JSON keeps every bit of a float
            if step % args.save_every == 0 or step == args.steps:
                if jax.process_count() == 1:  # checksums need every shard in this process
                    emit("checksums", step=step, sums=checksums(trainer.state))
                emit("saving", step=step, blocked_seconds=checkpoints.save(trainer, batches))
                if step == args.crash_during_save:  # a crash while the save is being written
                    os.kill(os.getpid(), signal.SIGKILL)
        emit("written", waited_seconds=checkpoints.wait())


def _restore(args: argparse.Namespace) -> None:
    rules = RULE_SETS[args.rules]
    mesh = strategy_mesh(rules)
    with Checkpoints(args.directory, create=False) as checkpoints:
        record = checkpoints.record(args.step)
        start = time.perf_counter()
        trainer = checkpoints.restore(
            Transformer.from_config, adamw(), rules, mesh, step=record.step
        )
        jax.block_until_ready(trainer.state)
        seconds = time.perf_counter() - start
    layout = trainer.layout
    embed = trainer.state["model"]["embed"][...]
    sums = checksums(trainer.state)
    emit(
        "restored",
        step=record.step,
        devices=jax.device_count(),
        platform=jax.devices()[0].platform,
        saved={"rules": record.rules["name"], "mesh": record.mesh, "devices": record.devices},
        rules=rules.name,
        mesh=dict(mesh.shape),
        seconds=seconds,
        bytes_per_device=layout.bytes_per_device(),
        total_bytes=layout.total_bytes(),
        embed={
            "shape": embed.shape,
            "spec": tuple(embed.sharding.spec),
            "shard_shape": embed.addressable_shards[0].data.shape,
        },
        arrays=len(sums),
    )
    if args.report:
        report = {
            "step": record.step,
            "devices": jax.device_count(),
            "seconds": seconds,
            "checksums": sums,
        }
        Path(args.report).write_text(json.dumps(report))


def _collective(args: argparse.Namespace) -> None:
    """In a launched run: sum one number per device over every process, report, then hold."""
    mesh = make_mesh((jax.device_count(),), ("all",))
    ones = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("all")), np.ones(jax.local_device_count(), np.int32)
    )
    total = int(jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))(ones))
    emit(
        "hello",
        processes=jax.process_count(),
        local_devices=jax.local_device_count(),
        devices=jax.device_count(),
        sum=total,
    )
    time.sleep(args.hold)


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, emulate the devices asked for, and run the command."""
    parser = argparse.ArgumentParser(prog="python -m nnxscale", description=__doc__)
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
    train.add_argument(
        "--crash-during-save",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL this process as soon as the save of STEP has started writing",
    )
    restore.add_argument("--step", type=int, default=None, help="default: the latest")
    restore.add_argument("--report", default=None, help="write checksums here as JSON")
    args = parser.parse_args(argv)
    if COORDINATOR in os.environ:  # a launched worker: devices and peers from the launcher
        initialize()
    else:
        emulate_devices(args.devices)
    {"train": _train, "restore": _restore, "collective": _collective}[args.command](args)


def run(*args: str, devices: int, timeout: float = 300) -> str:
    """Run `python -m nnxscale ARGS` with `devices` devices; its output, or an error with it."""
    command = [*PROGRAM, *args, "--devices", str(devices)]
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
    losses: dict[int, float]  # step -> loss, as `events(output, "step")` reports them
    checksums: dict[int, dict[str, str]]  # step -> sums, from `events(output, "checksums")`
    killed_at: int
    returncode: int


def crash_during_save(
    directory: str | Path,
    *,
    steps: int,
    save_every: int,
    devices: int,
    rules: str = "FSDP",
    batch_size: int = 16,
    config: str = "{}",
    timeout: float = 300,
) -> Crash:
    """Train to `steps`, saving every `save_every`; SIGKILL the process as its last save starts.

    The process kills itself right after its last `saving` event, as soon as Orbax has taken
    the state off the devices and the write has begun in a background thread: the kill lands
    while the files are written, without waiting for another process to react.
    """
    command = [
        *PROGRAM,
        "train",
        str(directory),
        "--devices",
        str(devices),
        "--rules",
        rules,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        "--batch-size",
        str(batch_size),
        "--config",
        config,
        "--crash-during-save",
        str(steps),
    ]
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    timer = threading.Timer(timeout, child.kill)
    timer.start()
    try:
        output = [line.rstrip("\n") for line in child.stdout]
    finally:
        timer.cancel()
        if child.poll() is None:
            child.kill()
        child.wait()
    killed = any(saving["step"] == steps for saving in events(output, "saving"))
    sums = {event["step"]: event["sums"] for event in events(output, "checksums")}
    if child.returncode == -signal.SIGKILL and not killed:
        raise TimeoutError(f"{' '.join(command[1:])} ran over {timeout} s and was killed")
    if child.returncode != -signal.SIGKILL:
        raise RuntimeError(
            f"the training run ended with {child.returncode} before its step-{steps} save "
            "could be interrupted:\n" + "\n".join(output)
        )
    losses = {event["step"]: event["loss"] for event in events(output, "step")}
    return Crash(output, losses, sums, steps, child.returncode)
