"""Pipeline schedules as plain data: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V, checked and
simulated.

A schedule says, for each pipeline device, the order in which it runs its tasks: the forward
or backward pass of one micro-batch through one of its model stages. A zero-bubble schedule
splits the backward pass in two: `B`, the input gradient the previous stage waits for, and
`W`, the weight gradient nobody waits for, which can be deferred. With `v` virtual stages
per device (interleaving), device `d` holds model stages `d, d + p, d + 2p, ...`; a V-shaped
schedule (ZB-V) holds two, `d` and `2p - 1 - d`, so that the pass turns around on the last
device and ends on the first, where it began. The same
objects are validated (every task once, on the right device, no deadlock), simulated into a
timeline with a bubble fraction and the peak number of micro-batches whose activations a
device holds, drawn as Gantt charts, and run by the executor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

FORWARD, BACKWARD, WEIGHTS = "F", "B", "W"


class ScheduleError(ValueError):
    """Parameters no schedule can be built from, or a schedule that cannot run as written."""


@dataclasses.dataclass(frozen=True)
class Task:
    """One pass of one micro-batch through one model stage."""

    kind: str  # FORWARD, BACKWARD (the input gradient, too the weights' unless split) or WEIGHTS
    micro: int
    stage: int  # the model stage, 0 .. p * v - 1

    def __str__(self) -> str:
        return f"{self.kind}{self.micro}@{self.stage}"


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per device, the tasks it runs in order."""

    name: str
    devices: int
    micro_batches: int
    virtual: int
    order: tuple[tuple[Task, ...], ...]
    placement: str = "looped"  # or "v": device d holds stages d and 2p - 1 - d

    @property
    def stages(self) -> int:
        """Model stages: devices times virtual stages per device."""
        return self.devices * self.virtual

    def device_of(self, stage: int) -> int:
        """The device that holds model stage `stage`."""
        p = self.devices
        if self.placement == "v" and stage >= p:
            return 2 * p - 1 - stage
        return stage % p

    @property
    def split(self) -> bool:
        """Whether the backward pass is split into B (input gradient) and W (weight gradient)."""
        return any(task.kind == WEIGHTS for tasks in self.order for task in tasks)


def _check(devices: int, micro_batches: int, virtual: int = 1) -> None:
    for name, value in (
        ("devices", devices),
        ("micro_batches", micro_batches),
        ("virtual", virtual),
    ):
        if value < 1:
            raise ScheduleError(f"{name}={value}: a pipeline needs at least 1")


def gpipe(devices: int, micro_batches: int) -> Schedule:
    """GPipe: every forward pass, then every backward pass (all m activations held)."""
    _check(devices, micro_batches)
    order = tuple(
        tuple(Task(FORWARD, i, d) for i in range(micro_batches))
        + tuple(Task(BACKWARD, i, d) for i in range(micro_batches))
        for d in range(devices)
    )
    return Schedule("GPipe", devices, micro_batches, 1, order)


def one_f_one_b(devices: int, micro_batches: int) -> Schedule:
    """1F1B: a few forwards to fill the pipe, then one forward, one backward (at most p held)."""
    _check(devices, micro_batches)
    order = []
    for d in range(devices):
        warmup = min(devices - d - 1, micro_batches)
        tasks = [Task(FORWARD, i, d) for i in range(warmup)]
        for i in range(micro_batches - warmup):
            tasks += [Task(FORWARD, warmup + i, d), Task(BACKWARD, i, d)]
        tasks += [Task(BACKWARD, i, d) for i in range(micro_batches - warmup, micro_batches)]
        order.append(tuple(tasks))
    return Schedule("1F1B", devices, micro_batches, 1, tuple(order))


def interleaved(devices: int, micro_batches: int, virtual: int) -> Schedule:
    """Interleaved 1F1B (Megatron-LM): v stages per device, micro-batches in groups of p."""
    _check(devices, micro_batches, virtual)
    if micro_batches % devices:
        raise ScheduleError(
            f"interleaved 1F1B runs micro-batches in groups of p={devices}, and "
            f"m={micro_batches} is not a multiple of it: use m = "
            f"{devices * max(1, micro_batches // devices)} or another multiple of p."
        )
    total = micro_batches * virtual

    def task(kind: str, k: int, d: int) -> Task:
        chunk = (k // devices) % virtual
        if kind == BACKWARD:
            chunk = virtual - 1 - chunk
        micro = (k // (devices * virtual)) * devices + k % devices
        return Task(kind, micro, chunk * devices + d)

    order = []
    for d in range(devices):
        warmup = min((devices - d - 1) * 2 + (virtual - 1) * devices, total)
        tasks = [task(FORWARD, k, d) for k in range(warmup)]
        for k in range(total - warmup):
            tasks += [task(FORWARD, warmup + k, d), task(BACKWARD, k, d)]
        tasks += [task(BACKWARD, k, d) for k in range(total - warmup, total)]
        order.append(tuple(tasks))
    return Schedule(
        f"interleaved 1F1B (v={virtual})", devices, micro_batches, virtual, tuple(order)
    )


def zero_bubble(devices: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al.): 1F1B with each backward split into B and W, device d deferring d Ws.

    Device d keeps 1F1B's warm-up, so it holds no more micro-batches before its first B than
    1F1B does; it runs the W of micro-batch i only after the B of micro-batch i + d, so the
    last devices, which wait longest for gradients at the end, fill that wait with their Ws.
    No device holds more than p micro-batches (1F1B's peak, on device 0).
    """
    _check(devices, micro_batches)
    order = []
    for d in range(devices):
        warmup = min(devices - d - 1, micro_batches)
        tasks = [Task(FORWARD, i, d) for i in range(warmup)]
        for i in range(micro_batches):
            if warmup + i < micro_batches:
                tasks.append(Task(FORWARD, warmup + i, d))
            tasks.append(Task(BACKWARD, i, d))
            if i >= d:
                tasks.append(Task(WEIGHTS, i - d, d))
        tasks += [Task(WEIGHTS, i, d) for i in range(max(0, micro_batches - d), micro_batches)]
        order.append(tuple(tasks))
    return Schedule("ZB-H1", devices, micro_batches, 1, tuple(order))


def zero_bubble_v(devices: int, micro_batches: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6): two stages per device in a V, backward split in B and W.

    Device d holds stages d (chunk 0) and 2p - 1 - d (chunk 1). It warms up with forwards on
    chunk 0, then on both chunks, then fills the wait for its first gradients with chunk 1's
    F, B and W; in the steady state it runs F, B, W on chunk 0 and then on chunk 1; it cools
    down with the Bs the previous devices wait for, and the deferred Ws last. With F, B and W
    of equal cost each device holds at most 2p chunks' activations, p stages' worth, as 1F1B's
    first device does, and the idle share is (p - 1) / (6m + p - 1): a sixth of 1F1B's for
    large m. The first device's V needs 2p - 1 micro-batches in flight: fewer are refused.
    """
    _check(devices, micro_batches)
    p, m = devices, micro_batches
    if m < 2 * p - 1:
        raise ScheduleError(
            f"ZB-V fills its V of {2 * p} stages with 2p - 1 = {2 * p - 1} micro-batches "
            f"before the first device's first backward, and m={m}: use m >= {2 * p - 1}, or "
            "1F1B or ZB-H1 for fewer micro-batches."
        )
    order = tuple(_zero_bubble_v_device(p, m, d) for d in range(p))
    return Schedule("ZB-V", p, m, 2, order, placement="v")


def _zero_bubble_v_device(p: int, m: int, d: int) -> tuple[Task, ...]:
    """Device d's tasks in ZB-V: its chunk 0 is stage d, its chunk 1 stage 2p - 1 - d."""
    chunks, done = (d, 2 * p - 1 - d), {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
    tasks: list[Task] = []

    def run(*steps: tuple[str, int]) -> None:
        for kind, c in steps:
            tasks.append(Task(kind, done[kind, c], chunks[c]))
            done[kind, c] += 1

    run(*[(FORWARD, 0)] * (2 * (p - d) - 1))
    run(*[(FORWARD, 1), (FORWARD, 0)] * d)
    run(*[(FORWARD, 1), (BACKWARD, 1), (WEIGHTS, 1)] * (p - d))
    while done[FORWARD, 1] < done[FORWARD, 0] or done[FORWARD, 0] < m:
        run(*[(FORWARD, 0)] * (done[FORWARD, 0] < m))
        run((BACKWARD, 0), (WEIGHTS, 0), (FORWARD, 1), (BACKWARD, 1), (WEIGHTS, 1))
    run(*[(BACKWARD, 0), (BACKWARD, 1)] * d)
    run(*[(BACKWARD, 0), (WEIGHTS, 0)] * (p - d))
    run(*[(WEIGHTS, 1)] * (done[BACKWARD, 1] - done[WEIGHTS, 1]))
    run(*[(WEIGHTS, 0)] * (done[BACKWARD, 0] - done[WEIGHTS, 0]))
    return tuple(tasks)


def dependencies(task: Task, stages: int) -> list[Task]:
    """The tasks that must finish first: the previous stage's forward, the next's backward,
    and for W the B of the same micro-batch and stage (whose output gradient it reuses)."""
    if task.kind == FORWARD:
        return [Task(FORWARD, task.micro, task.stage - 1)] if task.stage else []
    if task.kind == WEIGHTS:
        return [Task(BACKWARD, task.micro, task.stage)]
    after = Task(FORWARD, task.micro, task.stage)
    if task.stage == stages - 1:
        return [after]
    return [after, Task(BACKWARD, task.micro, task.stage + 1)]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A simulated run: each device's tasks with start and end times."""

    schedule: Schedule
    runs: tuple[tuple[tuple[Task, float, float], ...], ...]

    @property
    def makespan(self) -> float:
        """Time from the first task's start to the last task's end."""
        return max(end for device in self.runs for _, _, end in device)

    def bubble(self) -> float:
        """Share of device time spent idle: 1 - busy / (devices x makespan)."""
        busy = sum(end - start for device in self.runs for _, start, end in device)
        return 1 - busy / (self.schedule.devices * self.makespan)

    def peak_in_flight(self) -> list[int]:
        """Per device, the most micro-batch stages whose activations it holds at once: from
        the forward pass to the last pass that needs them (B, or W when the backward is split)."""
        release = WEIGHTS if self.schedule.split else BACKWARD
        peaks = []
        for device in self.runs:
            held = peak = 0
            for task, _, _ in device:
                held += {FORWARD: 1, release: -1}.get(task.kind, 0)
                peak = max(peak, held)
            peaks.append(peak)
        return peaks


def simulate(
    schedule: Schedule, cost: Callable[[Task], float] | None = None, latency: float = 0.0
) -> Timeline:
    """Run the schedule in time: a task starts once its device is free and its inputs arrived.

    `cost` gives a task's duration (default: forward 1 and backward 2, or B 1 and W 1 when
    split, divided by v, so a micro-batch's whole pass costs the same at every v); `latency`
    delays every hand-over between devices. Raises ScheduleError on a deadlock, naming the
    stuck tasks.
    """
    _check_tasks(schedule)
    v, whole = schedule.virtual, 1.0 if schedule.split else 2.0
    cost = cost or (lambda t: (whole if t.kind == BACKWARD else 1.0) / v)
    done: dict[Task, tuple[int, float]] = {}
    position = [0] * schedule.devices
    free = [0.0] * schedule.devices
    runs: list[list[tuple[Task, float, float]]] = [[] for _ in range(schedule.devices)]
    remaining = sum(len(tasks) for tasks in schedule.order)
    while remaining:
        progressed = False
        for d, tasks in enumerate(schedule.order):
            while position[d] < len(tasks):
                task = tasks[position[d]]
                needs = dependencies(task, schedule.stages)
                if any(n not in done for n in needs):
                    break
                ready = [
                    end + (latency if device != d else 0.0)
                    for device, end in (done[n] for n in needs)
                ]
                start = max([free[d], *ready])
                free[d] = start + cost(task)
                done[task] = (d, free[d])
                runs[d].append((task, start, free[d]))
                position[d] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            waits = []
            for d, tasks in enumerate(schedule.order):
                if position[d] < len(tasks):
                    task = tasks[position[d]]
                    missing = [n for n in dependencies(task, schedule.stages) if n not in done]
                    waits.append(f"{task} waits for {missing[0]}")
            raise ScheduleError(
                f"{schedule.name} deadlocks: {'; '.join(waits)}. Reorder so that every task "
                "comes after the tasks it needs."
            )
    return Timeline(schedule, tuple(tuple(r) for r in runs))


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless every task runs once, on its stage's device, without deadlock."""
    simulate(schedule)


def _check_tasks(schedule: Schedule) -> None:
    """Raise ScheduleError unless every task appears exactly once, on the device of its stage."""
    expected = {
        Task(kind, i, s)
        for kind in (FORWARD, BACKWARD, WEIGHTS)[: 3 if schedule.split else 2]
        for i in range(schedule.micro_batches)
        for s in range(schedule.stages)
    }
    seen: set[Task] = set()
    for d, tasks in enumerate(schedule.order):
        for task in tasks:
            if task in seen:
                raise ScheduleError(f"{schedule.name}: {task} appears twice")
            if task not in expected:
                raise ScheduleError(f"{schedule.name}: {task} is not a task of this pipeline")
            if schedule.device_of(task.stage) != d:
                raise ScheduleError(
                    f"{schedule.name}: {task} is on device {d}, but stage {task.stage} lives "
                    f"on device {schedule.device_of(task.stage)}"
                )
            seen.add(task)
    missing = sorted(map(str, expected - seen))
    if missing:
        raise ScheduleError(f"{schedule.name}: {len(missing)} tasks never run, e.g. {missing[:4]}")


def bubble_formula(devices: int, micro_batches: int, virtual: int = 1) -> float:
    """The idle share the literature gives: (p - 1) / (v m + p - 1)."""
    return (devices - 1) / (virtual * micro_batches + devices - 1)


def zero_bubble_formula(
    devices: int, micro_batches: int, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """ZB-H1's idle share: (p-1)(f+b-w) / (m(f+b+w) + (p-1)(f+b-w)), Qi et al.'s bubble
    (p-1)(T_F+T_B-T_W) over the makespan; with f = b = w, (p-1) / (3m+p-1)."""
    idle = (devices - 1) * (f + b - w)
    return idle / (micro_batches * (f + b + w) + idle)


def zero_bubble_v_formula(
    devices: int, micro_batches: int, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """ZB-V's idle share: ZB-H1's with 2m micro-batches, since each device runs every
    micro-batch as two chunks of half a stage (for F = W and B from one to two forwards,
    checked in simulation; `zero_bubble_v`'s order idles longer outside that range); with
    F, B and W of equal cost, (p - 1) / (6m + p - 1). With equal costs each device computes
    6m chunk tasks (3m stage-passes); the last device starts p - 1 chunk forwards late and
    the first finishes as late after it, which is all the idle time: (p - 1) / 2
    stage-passes per device."""
    return zero_bubble_formula(devices, 2 * micro_batches, f, b, w)


def split_layers(layers: int, stages: int) -> list[range]:
    """The layers of each model stage: equal consecutive runs, or an error saying what fits."""
    if stages < 1 or layers % stages:
        fits = [s for s in range(1, layers + 1) if layers % s == 0]
        raise ScheduleError(
            f"{layers} layers cannot be split into {stages} equal stages: use a number of "
            f"stages (devices x virtual stages) among {fits}, or change the layer count."
        )
    size = layers // stages
    return [range(s * size, (s + 1) * size) for s in range(stages)]


def expected_bubble(schedule: Schedule) -> float:
    """The idle share the literature gives for this schedule with equal F, B (and W) costs:
    ZB-V's (p-1)/(6m+p-1), ZB-H1's (p-1)/(3m+p-1), else (p-1)/(vm+p-1)."""
    p, m = schedule.devices, schedule.micro_batches
    if schedule.placement == "v":
        return zero_bubble_v_formula(p, m)
    if schedule.split:
        return zero_bubble_formula(p, m)
    return bubble_formula(p, m, schedule.virtual)


def expected_peaks(schedule: Schedule) -> list[int]:
    """Per device, the micro-batch stages whose activations it holds at its peak, by each
    schedule's rule: m (GPipe), min(m, p - d) (1F1B), min(m, p) (ZB-H1), 2p chunks of half a
    stage on every device (ZB-V), and interleaved's warm-up plus one,
    min(2(p-1-d) + (v-1)p + 1, vm)."""
    p, m, v = schedule.devices, schedule.micro_batches, schedule.virtual
    rules = {
        "GPipe": lambda d: m,
        "1F1B": lambda d: min(m, p - d),
        "ZB-H1": lambda d: min(m, p),
        "ZB-V": lambda d: 2 * p,
    }
    if schedule.name.startswith("interleaved"):
        return [min(2 * (p - 1 - d) + (v - 1) * p + 1, v * m) for d in range(p)]
    if schedule.name not in rules:
        raise ScheduleError(f"{schedule.name}: no peak formula is known for this schedule")
    return [rules[schedule.name](d) for d in range(p)]


CHECK_COLUMNS = (
    "schedule",
    "p",
    "m",
    "v",
    "bubble (simulated)",
    "bubble (formula)",
    "peak held, device 0 (simulated)",
    "peak held (formula)",
)
"""The columns of the rows `check` returns."""


def check(shapes: Sequence[tuple[int, int, int]]) -> list[list[object]]:
    """Simulate each schedule at every (p, m, v) and raise AssertionError unless its bubble
    equals the formula to 1e-12 and every device's peak equals the formula's; the rows checked
    (`CHECK_COLUMNS`). v = 1 checks GPipe, 1F1B and ZB-H1 (ZB-H1's formula needs m >= p),
    v > 1 interleaved 1F1B (when p divides m), and v = 2 ZB-V too (when m >= 2p - 1)."""
    rows = []
    for p, m, v in shapes:
        if v == 1:
            schedules = [gpipe(p, m), one_f_one_b(p, m)] + [zero_bubble(p, m)] * (m >= p)
        else:
            schedules = [interleaved(p, m, v)] if m % p == 0 else []
            schedules += [zero_bubble_v(p, m)] if v == 2 and m >= 2 * p - 1 else []
        for schedule in schedules:
            timeline = simulate(schedule)
            bubble, peaks = timeline.bubble(), timeline.peak_in_flight()
            formula, expected = expected_bubble(schedule), expected_peaks(schedule)
            if abs(bubble - formula) >= 1e-12 or peaks != expected:
                raise AssertionError(
                    f"{schedule.name} at p={p}, m={m}: bubble {bubble!r} against the "
                    f"formula's {formula!r}, peaks {peaks} against {expected}"
                )
            rows.append([schedule.name, p, m, v, bubble, formula, peaks[0], expected[0]])
    return rows
