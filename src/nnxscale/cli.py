"""Programs the chapters and tests run in other processes, each with its own devices.

`python -m nnxscale train DIR ...` trains the book's model and checkpoints it into DIR;
`python -m nnxscale restore DIR ...` restores the latest checkpoint of DIR onto a mesh of
its own and reports checksums. A new process is the only way to get another device count:
JAX fixes it when it starts. `run` starts one through the launcher (`nnxscale.launch`) and
returns its output; `crash_during_save` runs a training run that kills itself while it
writes a checkpoint (`start_crash_during_save` returns while it trains); `crossing` launches
the program of that name as processes and returns what crosses them.

What a command reports, it prints as typed events (`nnxscale.events`), one JSON line each;
`nnxscale.events.read` turns the output back into them:

- train: `Start`, `Resumed` when DIR held a checkpoint, `Step` for every step, `Checksums`
  (from every process, computed where the shards live) as a save begins, `Saving` once it
  writes in the background, `Preempted` when SIGTERM stopped it (it saves the step every
  process agreed on first: `nnxscale.preemption`), and `Written` when every save is on disk.
- restore: `Restored`.
- collective: `Entering` before its sum, then `Hello`.
- crossing: `Crossing`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from nnxscale.analysis.hlo import collectives
from nnxscale.checkpoint.buckets import Location, location
from nnxscale.checkpoint.integrity import checksums
from nnxscale.checkpoint.records import PARTIAL
from nnxscale.checkpoint.store import Checkpoints
from nnxscale.model.config import TINY
from nnxscale.model.transformer import Transformer, create
from nnxscale.placement.catalogue import RULE_SETS, STRATEGIES
from nnxscale.placement.mesh import hybrid_mesh, make_mesh
from nnxscale.placement.rules import strategy_mesh
from nnxscale.runtime import events, launch
from nnxscale.runtime.cluster import detect, join
from nnxscale.runtime.preemption import Preemption
from nnxscale.train.data import book_batches
from nnxscale.train.state import TrainOptions, adamw
from nnxscale.train.trainer import Trainer

PROGRAM = (sys.executable, "-m", "nnxscale")
"""The command line that starts the library's programs (`nnxscale.__main__`)."""


def tell(kind: type[events.Event], **fields: Any) -> None:
    """Print an event of `kind` from this process (its JAX process index filled in)."""
    events.emit(kind(process=jax.process_index(), **fields))


def _train(args: argparse.Namespace) -> None:
    rules = RULE_SETS[args.rules]
    cfg = TINY.replace(**args.config)
    mesh = strategy_mesh(rules)
    batches = book_batches(args.batch_size)
    with Checkpoints(args.directory, keep=args.keep) as checkpoints, Preemption() as preemption:
        if checkpoints.steps():
            trainer = checkpoints.restore(
                Transformer.from_config, adamw(), rules, mesh, data=batches
            )
            tell(events.Resumed, step=trainer.step_count())
        else:
            options = TrainOptions(compiler_options=args.compiler_options or None)
            trainer = Trainer.create(create(cfg), adamw(), rules, mesh, options)
        start, stop = batches.local_rows(trainer.batch_sharding)
        tell(
            events.Start,
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
            tell(events.Step, step=step - 1, loss=float(loss))  # JSON keeps every bit of a float
            stop = preemption.reached(step)  # every process, every step: the same answer
            if stop or step % args.save_every == 0 or step == args.steps:
                tell(events.Checksums, step=step, sums=checksums(trainer.state))
                tell(events.Saving, step=step, blocked_seconds=checkpoints.save(trainer, batches))
                if step == args.crash_during_save:  # a crash while the save is being written
                    _await_writing(location(args.directory), step)
                    os.kill(os.getpid(), signal.SIGKILL)
            if stop:
                tell(events.Preempted, step=step)
                break
        tell(events.Written, waited_seconds=checkpoints.wait())


def _await_writing(directory: Location, step: int, timeout: float = 60.0) -> None:
    """Return once the save of `step` has its unfinished directory on disk: Orbax makes it in
    its background thread, which a busy machine can leave unscheduled for a while after
    `save` returns; also once the save is complete, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (directory / f"{step}{PARTIAL}").exists() or (directory / str(step)).exists():
            return
        time.sleep(0.001)


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
    tell(
        events.Restored,
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
    """In a launched run: sum one number per device over every process, report, then hold.
    Process `--skip` leaves without summing, as a program whose processes take different
    branches does: the others wait for it in the sum, and the launcher names them and it."""
    mesh = make_mesh((jax.device_count(),), ("all",))
    ones = jax.make_array_from_process_local_data(
        NamedSharding(mesh, PartitionSpec("all")), np.ones(jax.local_device_count(), np.int32)
    )
    summed = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, PartitionSpec()))
    compiled = summed.lower(ones).compile()
    if jax.process_index() == args.skip:
        time.sleep(args.hold)
        return
    found = collectives(compiled).collectives
    over = [f"{c.kind} over {', '.join(map(repr, c.mesh_axes(mesh) or ()))}" for c in found]
    tell(events.Entering, collective="; ".join(over))
    total = int(compiled(ones))
    tell(
        events.Hello,
        processes=jax.process_count(),
        local_devices=jax.local_device_count(),
        devices=jax.device_count(),
        sum=total,
    )
    time.sleep(args.hold)


def _crossing(args: argparse.Namespace) -> None:
    """In a launched run: compile a train step of rule set `--rules` on a mesh whose first
    axis lies across the processes and the others inside each (`hybrid_mesh`), and report
    which collectives cross processes, with their bytes."""
    rules = STRATEGIES[args.rules]
    inside = rules.replace(sizes=(1, *rules.sizes[1:])).mesh_shape(jax.local_device_count())
    across = (jax.process_count(), *[1] * (len(inside) - 1))
    mesh = hybrid_mesh(inside, across, rules.axes)
    trainer = Trainer.create(create(TINY), adamw(), rules, mesh)
    report = collectives(trainer.compile(trainer.batch(book_batches(args.batch_size))))
    report = report.without_flags()
    crossing = {(c.kind, c.mesh_axes(mesh)) for c in report.across_processes(mesh).collectives}
    moved = [
        [kind, list(axes or ()), size, (kind, axes) in crossing]
        for (kind, axes), size in report.by_axes(mesh).items()
    ]
    tell(
        events.Crossing,
        mesh=dict(mesh.shape),
        inside=dict(zip(rules.axes, inside, strict=True)),
        moved=moved,
    )


def _positive(text: str) -> int:
    """An argument that must be a whole number of at least 1."""
    value = int(text) if text.strip().lstrip("+").isdigit() else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """An argument that must be a JSON object, such as '{"layers": 4}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({error})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a JSON object such as '{{\"layers\": 4}}'"
        )
    return value


def _config_changes(text: str) -> dict[str, Any]:
    """Changes to the TINY config, as JSON, checked as the Config they make."""
    changes = _json_object(text)
    try:
        TINY.replace(**changes)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return changes


def _parser() -> argparse.ArgumentParser:
    """The command line: its commands and their arguments."""
    parser = argparse.ArgumentParser(prog="python -m nnxscale", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train and checkpoint (resuming if DIR has one)")
    restore = commands.add_parser("restore", help="restore the latest checkpoint and report")
    collective = commands.add_parser("collective", help="in a launched run: sum over devices")
    collective.add_argument("--hold", type=float, default=0.0, help="seconds to wait after")
    collective.add_argument(
        "--skip", type=int, default=None, metavar="PROCESS", help="this process does not sum"
    )
    crossing = commands.add_parser(
        "crossing", help="in a launched run: which collectives of a step cross processes"
    )
    crossing.add_argument("--rules", default="HSDP", choices=("HSDP", "HSDP+TP"))
    crossing.add_argument("--batch-size", type=_positive, default=16)
    for command in (train, restore):
        command.add_argument("directory")
        command.add_argument(
            "--devices", default=None, help="emulated devices per process (default: 8), or native"
        )
        command.add_argument("--rules", default="FSDP", choices=sorted(RULE_SETS))
        command.add_argument(
            "--processes",
            type=_positive,
            default=None,
            help="the processes the run must have, refused otherwise (default: as started)",
        )
    train.add_argument("--steps", type=_positive, required=True, help="train until this step")
    train.add_argument("--save-every", type=_positive, required=True)
    train.add_argument("--keep", type=_positive, default=3, help="checkpoints kept")
    train.add_argument("--batch-size", type=_positive, default=16)
    train.add_argument(
        "--config", type=_config_changes, default={}, help="JSON changes to the TINY config"
    )
    train.add_argument(
        "--compiler-options",
        type=_json_object,
        default={},
        help="JSON options for XLA when a new run's step compiles (a resumed run: the saved ones)",
    )
    train.add_argument(
        "--crash-during-save",
        type=int,
        default=None,
        metavar="STEP",
        help="SIGKILL this process as soon as the save of STEP has started writing",
    )
    restore.add_argument("--step", type=int, default=None, help="default: the latest")
    restore.add_argument("--report", default=None, help="write checksums here as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the command line, join the run (emulating the devices asked for), and run the
    command."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command in ("collective", "crossing") and detect() is None:
        parser.error(
            f"{args.command} runs in processes that a launcher starts (nnxscale.launch, "
            "srun, mpirun)"
        )
    joined = join(getattr(args, "processes", None), getattr(args, "devices", None))
    if joined.engine != "none":  # what it joined, for the launcher's or the job's output
        events.emit(joined)
    programs = {"train": _train, "restore": _restore, "collective": _collective}
    {**programs, "crossing": _crossing}[args.command](args)


def run(*args: str, devices: int, timeout: float = 300) -> str:
    """Run `python -m nnxscale ARGS` with `devices` devices; its output, or a LaunchError
    with its last lines."""
    return launch.run([*PROGRAM, *args], devices, timeout=timeout).text


@dataclasses.dataclass
class Crash:
    """What a training run killed during a save printed before it died."""

    output: list[str]
    losses: dict[int, float]  # step -> loss, from its `Step` events
    checksums: dict[int, dict[str, str]]  # step -> sums, from its `Checksums` events
    killed_at: int
    returncode: int


@dataclasses.dataclass
class CrashingRun:
    """A training run started by `start_crash_during_save`: it trains while the caller goes
    on, and kills itself during its last save."""

    run: launch.Run
    steps: int
    timeout: float

    def result(self) -> Crash:
        """Wait for the run to die; what it printed before. RuntimeError if it ended any other
        way than killed during its last save."""
        self.run.wait(self.timeout, check=False)
        (returncode,) = self.run.returncodes
        output = self.run.output
        if returncode != -signal.SIGKILL or not any(
            saving.step == self.steps for saving in events.read(output, events.Saving)
        ):
            raise RuntimeError(
                f"the training run ended with {returncode} before its step-{self.steps} save "
                "could be interrupted:\n" + "\n".join(output)
            )
        losses = {e.step: e.loss for e in events.read(output, events.Step)}
        sums = {e.step: e.sums for e in events.read(output, events.Checksums)}
        return Crash(output, losses, sums, self.steps, returncode)


def start_crash_during_save(
    directory: str | Path,
    *,
    steps: int,
    save_every: int,
    devices: int,
    rules: str = "FSDP",
    batch_size: int = 16,
    config: str = "{}",
    compiler_options: dict[str, Any] | None = None,
    timeout: float = 300,
) -> CrashingRun:
    """Start, in another process, a run that trains to `steps`, saving every `save_every`, and
    SIGKILLs itself as its last save starts; returns at once (`result()` waits for it).

    The process kills itself right after its last `Saving` event, as soon as Orbax has taken
    the state off the devices and its background thread has made the save's unfinished
    directory: the kill lands while the files are written, without waiting for another
    process to react. The step compiles with `compiler_options` (such as
    `nnxscale.devices.FAST_COMPILE`), which the run's checkpoints record, so a run restored
    from them computes the same bits. `timeout` counts from the call to `result()`.
    """
    command = [
        *PROGRAM,
        "train",
        str(directory),
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
        "--compiler-options",
        json.dumps(dict(compiler_options or {})),
        "--crash-during-save",
        str(steps),
    ]
    return CrashingRun(launch.start(command, 1, devices, echo=None), steps, timeout)


def crash_during_save(directory: str | Path, **options: Any) -> Crash:
    """Train to `steps`, saving every `save_every`; SIGKILL the process as its last save starts
    (`start_crash_during_save` with the same options, waited for)."""
    return start_crash_during_save(directory, **options).result()


def crossing(rules: str, processes: int = 2, devices: int = 4) -> events.Crossing:
    """Launch `python -m nnxscale crossing` for rule set `rules` as `processes` processes of
    `devices` devices each; process 0's report (every process reports the same program)."""
    output = launch.launch(
        [*PROGRAM, "crossing", "--rules", rules], processes, devices, timeout=240, echo=None
    )
    reports = events.read(output, events.Crossing)
    if len(reports) != processes or any(r.moved != reports[0].moved for r in reports):
        raise RuntimeError("the processes did not report one program:\n" + "\n".join(output))
    return reports[0]
