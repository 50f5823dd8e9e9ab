"""Where a step's time goes: `jax.profiler` traces read back from the files the profiler
writes, each op joined to its instruction in the compiled program, and placed on a roofline.

`record(run, directory)` profiles a call and `read(directory)` parses the Chrome/Perfetto
trace JSON the profiler leaves (`<host>.trace.json.gz`), the same file Perfetto's UI and
XProf open. `steps(trace, compiled)` names each op the program ran: what it is (a matrix
product, a collective, other work), which part of the step it belongs to (forward,
backward, optimizer), and its FLOPs and bytes, read off the compiled program with loop trip
counts (`nnxscale.program`). `roofline(...)` places each op against a device's peak FLOP/s
and memory bandwidth.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gzip
import itertools
import json
import re
import tempfile
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from nnxscale.analysis.hlo import gemm_flops, shape_bytes
from nnxscale.analysis.program import Instruction, Program
from nnxscale.costs.hardware import Hardware

OP_TRACING = {"xla_cpu_enable_xprof_traceme": True, "xla_gpu_enable_command_buffer": ""}
"""Compiler options under which a profile names each HLO op: the CPU backend records them
when asked; a GPU runs most of a step as one CUDA graph (a command buffer), whose kernels a
profile does not see one by one, unless command buffers are off. Each backend takes the
options it knows (`step_options`)."""


def step_options(device: jax.Device) -> dict[str, Any]:
    """Compiler options for a step to be profiled on `device`: XLA's own optimisations
    (`nnxscale.devices.OPTIMIZED`), and those of `OP_TRACING` for its backend that it knows."""
    from nnxscale.placement.compiling import accepts
    from nnxscale.runtime.devices import OPTIMIZED

    prefix = "xla_cpu_" if device.platform == "cpu" else "xla_gpu_"
    mine = {k: v for k, v in OP_TRACING.items() if k.startswith(prefix)}
    return OPTIMIZED | {k: v for k, v in mine.items() if accepts(device.platform, k, v)}


COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
"""The opcodes of collectives (their asynchronous `-start`/`-done` halves count too)."""

PHASES = ("forward", "backward", "optimizer", "other")
"""The parts of a training step an op can belong to, read off its source (`phase`)."""

KINDS = ("matmul", "collective", "other")
"""What an op is: a matrix product, a collective, or other (elementwise, reductions, copies)."""

_DEVICE = re.compile(r"/device:[A-Za-z_]+:(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_PLUMBING = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all"}
_CONTROL = {"while", "conditional", "call"}


class TraceNotFoundError(FileNotFoundError):
    """A directory holds no trace the profiler wrote."""


@dataclass(frozen=True)
class Op:
    """One execution of one HLO op, as the profiler saw it (times in microseconds)."""

    device: int
    module: str
    name: str
    start: float
    duration: float
    run: str
    thread: int

    @property
    def end(self) -> float:
        return self.start + self.duration


@dataclass(frozen=True)
class Trace:
    """The HLO ops of a profile, in time order, and the file they were read from."""

    ops: tuple[Op, ...]
    path: Path

    def of(self, module: str) -> Trace:
        """The ops of the program named `module` (such as `jit_train_step`)."""
        return Trace(tuple(o for o in self.ops if o.module == module), self.path)

    def runs(self) -> list[str]:
        """The program's executions, in the order they started (one per step)."""
        first: dict[str, float] = {}
        for o in self.ops:
            first[o.run] = min(first.get(o.run, o.start), o.start)
        return sorted(first, key=first.__getitem__)

    def run(self, index: int) -> Trace:
        """The ops of one execution (`runs()[index]`)."""
        wanted = self.runs()[index]
        return Trace(tuple(o for o in self.ops if o.run == wanted), self.path)

    def span(self) -> float:
        """Microseconds from the first op's start to the last op's end."""
        if not self.ops:
            raise ValueError(
                f"the trace {self.path} holds no ops here: the program did not run while the "
                "profiler recorded, or `of()` named another module"
            )
        return max(o.end for o in self.ops) - min(o.start for o in self.ops)


def trace_file(directory: str | Path) -> Path:
    """The newest trace JSON under `directory` (what `jax.profiler.trace(directory)` wrote)."""
    found = sorted(Path(directory).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    found = found or sorted(Path(directory).rglob("perfetto_trace.json.gz"))
    if not found:
        raise TraceNotFoundError(
            f"no trace under {directory}: profile into it first (nnxscale.profiles.record, or "
            "jax.profiler.trace(directory)); the profiler writes "
            "plugins/profile/<run>/<host>.trace.json.gz"
        )
    return found[-1]


def read(directory: str | Path) -> Trace:
    """The HLO ops of the newest trace under `directory`: every event that names an HLO op
    (CPU, GPU and TPU traces carry it as the event's `hlo_op`), with the device it ran on
    (`device_ordinal`, else the `/device:GPU:N` of its process), in time order.

    The CPU runtime runs some ops asynchronously (a matrix product handed to a thread pool):
    their event ends when the op is launched, and a later `end: <op>` event marks when it
    finished. Each op lasts until its end event (the k-th start of an op paired with its k-th
    end, which keeps every op's total time exact however the devices interleave). A GPU's
    ops do not name their run: each belongs to the last launch of its program before it."""
    path = trace_file(directory)
    try:
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        processes = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    except (OSError, EOFError, ValueError, KeyError, TypeError) as error:
        raise TraceNotFoundError(
            f"{path} is not a trace the profiler finished writing ({type(error).__name__}: "
            f"{error}): it is empty, cut short, or not a JAX profile. Profile again into an "
            "empty directory (nnxscale.profiles.record)."
        ) from None
    ends: dict[str, list[float]] = defaultdict(list)
    launches: dict[str, list[tuple[float, str]]] = defaultdict(list)
    ops = []
    for e in sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"]):
        args = e.get("args") or {}
        if e["name"].startswith("end: "):
            ends[e["name"][5:]].append(float(e["ts"]) + float(e.get("dur", 0.0)))
        if "run_id" in args and "hlo_op" not in args and "name" in args:
            launches[args["name"]].append((float(e["ts"]), str(args["run_id"])))
        if "hlo_op" not in args:
            continue
        where = _DEVICE.search(processes.get(e["pid"], ""))
        device = args.get("device_ordinal", where.group(1) if where else 0)
        ops.append(
            Op(
                device=int(device),
                module=str(args.get("hlo_module", "")),
                name=str(args["hlo_op"]),
                start=float(e["ts"]),
                duration=float(e.get("dur", 0.0)),
                run=str(args.get("run_id", _launched(launches, args, float(e["ts"])))),
                thread=int(e.get("tid", 0)),
            )
        )
    started: dict[str, int] = defaultdict(int)
    finished = []
    for o in ops:
        k, started[o.name] = started[o.name], started[o.name] + 1
        marks = ends.get(o.name, [])
        end = marks[k] if k < len(marks) and marks[k] > o.end else o.end
        finished.append(dataclasses.replace(o, duration=end - o.start))
    return Trace(tuple(sorted(finished, key=lambda o: (o.start, o.device))), path)


SETTLE = 0.05
"""Seconds the profiler keeps recording after the profiled call's results are ready: the
runtime's threads hand over their last events a moment later (stopped at once, a trace of
the CPU runtime lost the last ops of about one run in ten)."""


def _launched(launches: dict[str, list[tuple[float, str]]], args: dict, start: float) -> str:
    """The run an op of an accelerator belongs to, which its event does not name: the last
    launch of its program (a host event with the run's id) before the op started."""
    before = [run for at, run in launches.get(str(args.get("hlo_module", "")), []) if at <= start]
    return before[-1] if before else ""


def record(run: Callable[[], Any], directory: str | Path | None = None) -> Trace:
    """Profile one call of `run` (its results waited for, then `SETTLE` seconds) and read the
    trace back. Each call writes into a fresh folder under `directory` (default: a temporary
    one)."""
    base = Path(directory or tempfile.mkdtemp(prefix="nnxscale-profile-"))
    base.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(dir=base))
    with jax.profiler.trace(str(folder)):
        jax.block_until_ready(run())
        time.sleep(SETTLE)
    return read(folder)


def shared(ops: Iterable[Op]) -> dict[Op, float]:
    """Each op's share of its device's wall time, in microseconds: every instant goes in
    equal parts to the ops running then (the CPU runtime runs independent ops at once), so
    the shares of a device add up to the time it was busy."""
    share: dict[Op, float] = defaultdict(float)
    lanes: dict[int, list[Op]] = defaultdict(list)
    for o in ops:
        lanes[o.device].append(o)
    for lane in lanes.values():
        edges = sorted({t for o in lane for t in (o.start, o.end)})
        running: set[Op] = set()
        starting = defaultdict(list)
        for o in lane:
            starting[o.start].append(o)
        for here, after in itertools.pairwise(edges):
            running = {o for o in running if o.end > here}
            running |= {o for o in starting[here] if o.end > here}
            for o in running:
                share[o] += (after - here) / len(running)
    return share


@dataclass(frozen=True)
class Cost:
    """What one op of a compiled program does each time it runs: FLOPs of its matrix
    products, bytes it reads and writes (its operands and result), and how often a call of
    the program runs it (loop trip counts included)."""

    opcode: str
    kind: str
    phase: str
    flops: int
    bytes: int
    executions: int


def _inside(program: Program, ins: Instruction) -> Iterable[tuple[str, Instruction]]:
    """The instruction and every one in the computations it fuses or applies, recursively."""
    yield "", ins
    for role, callee in ins.callees():
        if role in ("calls", "to_apply"):
            for inner in program.computations.get(callee, {}).values():
                yield from ((callee, i) for _, i in _inside(program, inner))


def phase(source: str) -> str:
    """The part of a training step an op's source name (`op_name` metadata) belongs to: the
    optimizer (the step's `optimizer` name scope), the backward pass (a transpose of the
    forward pass), the forward pass (under `jvp`), or other."""
    if "/optimizer" in source:
        return "optimizer"
    if "transpose(" in source:
        return "backward"
    return "forward" if "jvp(" in source else "other"


def costs(program: object) -> dict[str, Cost]:
    """The `Cost` of every op that runs on its own (what a profile names: an instruction of
    the entry computation, a loop body or a branch, not one fused into another), by name.
    Read once per compiled program."""
    if not isinstance(program, str) and program in _COSTS:
        return _COSTS[program]
    read = Program.of(program)
    fused = _fused(read)
    found: dict[str, Cost] = {}
    for name, ins, executions in read.walk():
        computation = read.computations[name]
        if ins.opcode in _PLUMBING or name in fused:
            continue
        flops, source = 0, ""
        for inner_name, inner in _inside(read, ins):
            flops += gemm_flops(inner, read.computations.get(inner_name, computation))
            found_name = _OP_NAME.search(inner.attributes)
            source = source or (found_name.group(1) if found_name else "")
        base = ins.opcode.removesuffix("-start").removesuffix("-done")
        kind = "collective" if base in COLLECTIVES else "matmul" if flops else "other"
        moved = 0
        if ins.opcode not in _CONTROL and not ins.opcode.endswith("-done"):
            moved = shape_bytes(ins.shape) + sum(
                shape_bytes(computation[o].shape) for o in ins.operands if o in computation
            )
        found[ins.name] = Cost(ins.opcode, kind, phase(source), flops, moved, executions)
    if not isinstance(program, str):
        _COSTS[program] = found
    return found


_COSTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""The costs read so far, by the compiled program they came from (while it lives)."""


def _fused(read: Program) -> set[str]:
    """The computations that are fused into an op or applied by one (not run on their own)."""
    return {
        callee
        for _, ins in read.instructions()
        for role, callee in ins.callees()
        if role in ("calls", "to_apply")
    }


@dataclass(frozen=True)
class Timed:
    """One op of one execution of a program on one device, with what the compiled program
    says it is: its share of the device's time (`shared`) and its wall seconds from start to
    end (more than the share when other ops ran beside it)."""

    name: str
    device: int
    kind: str
    phase: str
    seconds: float
    wall: float
    flops: int
    bytes: int
    executions: int
    starts: tuple[float, ...]
    durations: tuple[float, ...]


_CONTAINER = Cost("", "other", "other", 0, 0, 0)


def join(trace: Trace, program: object) -> list[Timed]:
    """The ops of one execution (`trace.run(i)`), per device and op, joined to the compiled
    program's `costs` (FLOPs and bytes per call, loop trip counts included). Loops and
    conditionals are left out: the ops inside them are traced and counted themselves. An op
    the program does not hold raises: the trace is of another program."""
    table = costs(program)
    name = Program.of(program).name
    foreign = sorted({o.module for o in trace.ops} - {name})
    if foreign:
        raise ValueError(
            f"the trace holds ops of {', '.join(map(repr, foreign))}, and the compiled program "
            f"is {name!r}: pass the program that ran, or the trace of it alone "
            f"(trace.of({name!r}))"
        )
    work = [o for o in trace.ops if table.get(o.name, _CONTAINER).opcode not in _CONTROL]
    share = shared(work)
    grouped: dict[tuple[int, str], list[Op]] = defaultdict(list)
    for o in work:
        grouped[o.device, o.name].append(o)
    rows = []
    for (device, name), ops in sorted(grouped.items()):
        if name not in table:
            if name in {i.name for _, i in Program.of(program).instructions()}:
                continue  # plumbing: a parameter or tuple the runtime names
            raise ValueError(
                f"op {name!r} of the trace is not in the compiled program: pass the program "
                f"that ran (the trace's module is {ops[0].module!r})"
            )
        cost = table[name]
        rows.append(
            Timed(
                name=name,
                device=device,
                kind=cost.kind,
                phase=cost.phase,
                seconds=sum(share[o] for o in ops) * 1e-6,
                wall=sum(o.duration for o in ops) * 1e-6,
                flops=cost.flops * cost.executions,
                bytes=cost.bytes * cost.executions,
                executions=cost.executions,
                starts=tuple(o.start for o in ops),
                durations=tuple(o.duration for o in ops),
            )
        )
    return rows


def breakdown(rows: Iterable[Timed], by: str = "kind") -> dict[str, float]:
    """Seconds per device spent on each kind of op (or each `phase`), averaged over devices."""
    rows = list(rows)
    devices = len({r.device for r in rows}) or 1
    total: dict[str, float] = dict.fromkeys(KINDS if by == "kind" else PHASES, 0.0)
    for r in rows:
        total[getattr(r, by)] += r.seconds / devices
    return total


def waiting(rows: Iterable[Timed]) -> float:
    """The share of the collectives' time their devices spent waiting for the last device
    to arrive: for each execution of each collective, each device's start against the
    latest start among the devices of the profile (one group, as when a collective spans
    every device), at most its duration."""
    by_name: dict[str, list[Timed]] = defaultdict(list)
    for r in rows:
        if r.kind == "collective":
            by_name[r.name].append(r)
    waited = total = 0.0
    for group in by_name.values():
        for k in range(min(len(r.starts) for r in group)):
            last = max(r.starts[k] for r in group)
            waited += sum(min(r.durations[k], last - r.starts[k]) for r in group)
            total += sum(r.durations[k] for r in group)
    return waited / total if total else 0.0


def ridge(hw: Hardware) -> float:
    """FLOPs per byte above which an op is compute-bound on `hw`: peak FLOP/s over bandwidth."""
    return hw.flops / hw.hbm


def attainable(intensity: float, hw: Hardware) -> float:
    """The roofline: the most FLOP/s an op of `intensity` FLOPs per byte can reach on `hw`."""
    return min(hw.flops, intensity * hw.hbm)


@dataclass(frozen=True)
class Placed:
    """An op on the roofline: its FLOPs per byte, measured FLOP/s, and the roof above it."""

    name: str
    kind: str
    seconds: float
    intensity: float
    achieved: float
    roof: float
    bound: str


def roofline(rows: Iterable[Timed], hw: Hardware) -> list[Placed]:
    """Each op that computes (FLOPs > 0) placed against `hw`, at the FLOP/s it reached over
    its wall time: compute-bound when its intensity is above `ridge(hw)`, memory-bound below."""
    placed = []
    for r in rows:
        if r.flops <= 0 or r.bytes <= 0 or r.wall <= 0:
            continue
        intensity = r.flops / r.bytes
        bound = "compute" if intensity >= ridge(hw) else "memory"
        achieved, roof = r.flops / r.wall, attainable(intensity, hw)
        placed.append(Placed(r.name, r.kind, r.wall, intensity, achieved, roof, bound))
    return placed


def reached(placed: Iterable[Placed], kind: str = "matmul") -> float:
    """The FLOP/s the ops of `kind` reached together, their FLOPs over their summed time: over
    the peak, the share a time model's `efficiency` takes for this step's products."""
    ops = [p for p in placed if p.kind == kind]
    if not ops:
        raise ValueError(f"no {kind} op on the roofline: profile a step that computes one")
    return sum(p.achieved * p.seconds for p in ops) / sum(p.seconds for p in ops)


def mfu(model_flops: float, seconds: float, hw: Hardware) -> float:
    """Model FLOPs utilisation: the model's FLOPs per step over the step's seconds, as a
    share of `hw`'s peak FLOP/s."""
    return model_flops / seconds / hw.flops


def fastest_device() -> jax.Device:
    """The device a one-device profile should run on: an accelerator JAX has beside the
    emulated CPU devices (`NNXSCALE_DEVICES=native` on a one-GPU machine), else the first."""
    for platform in ("tpu", "gpu"):
        with contextlib.suppress(RuntimeError):
            if platform != jax.default_backend() and jax.devices(platform):
                return jax.devices(platform)[0]
    return jax.devices()[0]


@dataclass(frozen=True)
class Profile:
    """A trainer's step, profiled: the fastest of the profiled steps (its ops, joined to the
    compiled program), its wall seconds, and the device measured between the steps."""

    trace: Trace
    rows: list[Timed]
    seconds: float
    hw: Hardware


def profile(
    trainer: Any,
    batches: Callable[..., Any],
    probe: Any,
    steps: int = 3,
    directory: str | Path | None = None,
) -> Profile:
    """Profile `steps` steps of `trainer` on `batches`, with `probe` (a
    `nnxscale.machine.Probe`) measuring the device between them (`machine.alongside`), and
    keep the fastest step. The step must have run once (compiled)."""
    from nnxscale.profiling.machine import alongside

    times: list[float] = []

    def timed() -> float:
        times.append(trainer.time_steps(batches, 1, first=1000 + len(times))[0])
        return times[-1]

    found: dict[str, Any] = {}
    trace = record(lambda: found.update(best=alongside(timed, probe, steps)), directory)
    module = Program.of(trainer.compiled).name
    runs = [trace.of(module).run(i) for i in range(len(times))]
    whole = _complete(runs, Program.of(trainer.compiled).partitions)
    if not whole:
        raise RuntimeError(f"the profiler lost ops of every step in {trace.path}: profile again")
    fastest = min(whole, key=times.__getitem__)
    step = runs[fastest]
    return Profile(step, join(step, trainer.compiled), times[fastest], found["best"][1])


def _complete(runs: list[Trace], devices: int) -> list[int]:
    """The runs whose every one of `devices` devices holds as many ops as the most any
    device held in any run: the others lost events."""
    counts = [Counter(o.device for o in run.ops) for run in runs]
    most = max((max(c.values(), default=0) for c in counts), default=0)
    return [i for i, c in enumerate(counts) if len(c) == devices and set(c.values()) == {most}]
