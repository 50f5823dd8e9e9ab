"""The trace reader against traces the profiler writes, and hand-made ones for what a real
trace cannot be made to show on demand (an op whose end comes later, a lost event); the
ops' FLOPs and bytes against XLA's own counts; the roofline's placement and MFU."""

from __future__ import annotations

import gzip
import json
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest

import nnxscale as nx
from nnxscale import machine, profiles
from nnxscale.costs import HARDWARE
from nnxscale.runtime.devices import OPTIMIZED

CFG = nx.Config(
    vocab=128, embed=64, heads=4, head_dim=16, mlp=256, layers=2, max_len=32, dropout=0.0
)
OPTIONS = {**OPTIMIZED, **profiles.OP_TRACING}


@pytest.fixture(scope="module")
def fsdp() -> nx.Trainer:
    """The book's model under FSDP on the test's 8 devices, compiled to name its ops."""
    trainer = nx.Trainer.create(
        lambda: nx.create(CFG), nx.adamw(), nx.FSDP, nx.strategy_mesh(nx.FSDP),
        dropout=False, compiler_options=OPTIONS,
    )  # fmt: skip
    trainer.train(nx.book_batches(8, CFG.max_len), 1)
    return trainer


@pytest.fixture(scope="module")
def profiled(fsdp: nx.Trainer, tmp_path_factory: pytest.TempPathFactory) -> profiles.Profile:
    probe = machine.Probe(jax.devices()[0], size=256, megabytes=8)
    batches = nx.book_batches(8, CFG.max_len)
    return profiles.profile(fsdp, batches, probe, directory=tmp_path_factory.mktemp("trace"))


@pytest.mark.slow
def test_a_profile_of_fsdp_holds_every_device_and_every_kind_of_op(
    profiled: profiles.Profile, fsdp: nx.Trainer
) -> None:
    rows = profiled.rows
    assert sorted({r.device for r in rows}) == list(range(8))
    assert {"matmul", "collective", "other"} <= {r.kind for r in rows}
    assert {"forward", "backward", "optimizer"} <= {r.phase for r in rows}
    for r in rows:
        assert len(r.starts) == r.executions
    per_device = nx.hlo.dot_flops(fsdp.compiled)
    assert sum(r.flops for r in rows if r.device == 3) == per_device
    gathers = {r.name for r in rows if r.kind == "collective" and r.name.startswith("all-gather")}
    assert len(gathers) == nx.collectives(fsdp.compiled).count("all-gather")
    # the trace file is Chrome trace JSON, what Perfetto and XProf open
    events = json.loads(gzip.decompress(profiled.trace.path.read_bytes()))["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans and all({"pid", "tid", "ts", "dur", "name"} <= e.keys() for e in spans)


def test_the_shares_of_a_device_add_up_to_its_busy_time(profiled: profiles.Profile) -> None:
    for device in range(8):
        ops = [o for o in profiled.trace.ops if o.device == device]
        share = profiles.shared(ops)
        union, end = 0.0, float("-inf")
        for o in sorted(ops, key=lambda o: o.start):
            union += max(0.0, o.end - max(o.start, end))
            end = max(end, o.end)
        assert sum(share.values()) == pytest.approx(union, rel=1e-9)
    total = sum(profiles.breakdown(profiled.rows).values())
    assert total == pytest.approx(sum(r.seconds for r in profiled.rows) / 8, rel=1e-12)


def one_device_step(cfg: nx.Config) -> object:
    """The book's train step for `cfg` on one device, compiled with XLA's own options."""
    trainer = nx.Trainer.create(
        lambda: nx.create(cfg), nx.adamw(), nx.DP, nx.strategy_mesh(nx.DP, 1),
        dropout=False, compiler_options=OPTIMIZED,
    )  # fmt: skip
    return trainer.compile(trainer.batch(nx.book_batches(8, cfg.max_len)))


@pytest.mark.slow
def test_the_ops_bytes_and_flops_are_xlas_on_one_device() -> None:
    program = one_device_step(CFG)
    table = profiles.costs(program)
    xla = program.cost_analysis()
    moved = sum(c.bytes * c.executions for c in table.values())
    assert abs(moved - xla["bytes accessed"]) <= 0.01 * xla["bytes accessed"]
    flops = sum(c.flops * c.executions for c in table.values())
    assert flops == nx.hlo.dot_flops(program) == nx.costs.step_flops(CFG, 8, CFG.max_len)
    # XLA's count adds elementwise work to the products
    assert flops <= xla["flops"] <= 1.1 * flops


@pytest.mark.slow
def test_loop_trip_counts_multiply_the_ops_of_a_scanned_model() -> None:
    cfg = CFG.replace(scan_layers=True)
    program = one_device_step(cfg)
    table = profiles.costs(program)
    assert max(c.executions for c in table.values()) == cfg.layers
    flops = sum(c.flops * c.executions for c in table.values())
    assert flops == nx.costs.step_flops(cfg, 8, cfg.max_len)


def _trace_file(folder: Path, events: list[dict]) -> Path:
    path = folder / "plugins" / "profile" / "run" / "host.trace.json.gz"
    path.parent.mkdir(parents=True)
    names = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]
    path.write_bytes(gzip.compress(json.dumps({"traceEvents": names + events}).encode()))
    return path


def _op(name: str, ts: float, dur: float, device: int = 0, tid: int = 1) -> dict:
    args = {"hlo_op": name, "hlo_module": "jit_f", "device_ordinal": str(device), "run_id": "7"}
    return {"ph": "X", "pid": 1, "tid": tid, "ts": ts, "dur": dur, "name": name, "args": args}


def test_an_op_handed_to_a_thread_pool_lasts_until_its_end_event(tmp_path: Path) -> None:
    # the CPU runtime's asynchronous product: its event ends at launch, `end:` when done
    _trace_file(
        tmp_path,
        [
            _op("dot.1", 10.0, 2.0),
            _op("fusion.2", 13.0, 5.0),
            {"ph": "X", "pid": 1, "tid": 9, "ts": 40.0, "dur": 1.0, "name": "end: dot.1"},
        ],
    )
    trace = profiles.read(tmp_path)
    durations = {o.name: o.duration for o in trace.ops}
    assert durations == {"dot.1": 31.0, "fusion.2": 5.0}
    share = profiles.shared(trace.ops)
    # dot.1 ran alone for 3 us, beside fusion.2 for 5 (half each), alone again for 23
    assert share[trace.ops[0]] == pytest.approx(3 + 2.5 + 23)
    assert sum(share.values()) == pytest.approx(31.0)


def test_a_gpu_trace_names_its_device_by_process(tmp_path: Path) -> None:
    event = _op("fusion.3", 5.0, 1.0)
    del event["args"]["device_ordinal"]
    event["pid"] = 2
    process = {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:3"}}
    _trace_file(tmp_path, [process, event])
    assert [o.device for o in profiles.read(tmp_path).ops] == [3]


def test_a_folder_without_a_trace_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(profiles.TraceNotFoundError, match=r"jax\.profiler\.trace"):
        profiles.read(tmp_path)


def test_a_trace_of_another_program_is_refused(fsdp: nx.Trainer, tmp_path: Path) -> None:
    """By its module's name, even where its op names coincide with the program's (`join`
    returned that program's costs), and by an op the program does not hold."""
    name = nx.program.Program.of(fsdp.compiled).name
    ours = next(i.name for _, i in nx.program.Program.of(fsdp.compiled).instructions())
    _trace_file(tmp_path / "other", [_op(ours, 1.0, 1.0)])  # module jit_f
    with pytest.raises(ValueError, match=rf"ops of 'jit_f', and the compiled program is '{name}'"):
        profiles.join(profiles.read(tmp_path / "other"), fsdp.compiled)
    event = _op("no-such-op.9", 1.0, 1.0)
    event["args"]["hlo_module"] = name
    _trace_file(tmp_path / "same", [event])
    with pytest.raises(ValueError, match="not in the compiled program"):
        profiles.join(profiles.read(tmp_path / "same"), fsdp.compiled)


@pytest.mark.parametrize(
    "content",
    [b"", b"not gzip", gzip.compress(b'{"traceEvents": [')[:-4], gzip.compress(b"{}")],
    ids=["empty", "not gzip", "cut short", "not a trace"],
)
def test_a_trace_that_cannot_be_read_is_named(tmp_path: Path, content: bytes) -> None:
    path = _trace_file(tmp_path, [])
    path.write_bytes(content)
    with pytest.raises(profiles.TraceNotFoundError, match="not a trace the profiler finished"):
        profiles.read(tmp_path)


def test_an_empty_trace_has_no_span(tmp_path: Path) -> None:
    _trace_file(tmp_path, [])
    with pytest.raises(ValueError, match="holds no ops"):
        profiles.read(tmp_path).span()


def test_runs_that_lost_events_are_not_chosen() -> None:
    def run(counts: dict[int, int]) -> profiles.Trace:
        ops = tuple(
            profiles.Op(d, "m", f"op.{k}", float(k), 1.0, "r", 0)
            for d, c in counts.items()
            for k in range(c)
        )
        return profiles.Trace(ops, Path("."))

    runs = [run({0: 5, 1: 5}), run({0: 5, 1: 3}), run({0: 5}), run({0: 5, 1: 5})]
    assert profiles._complete(runs, 2) == [0, 3]


def test_the_roofline_places_ops_by_intensity_against_the_ridge() -> None:
    hw = HARDWARE["H100"]
    ridge = profiles.ridge(hw)
    assert ridge == hw.flops / hw.hbm
    rows = [
        profiles.Timed("low", 0, "other", "forward", 1.0, 1.0, 10, 100, 1, (0.0,), (1.0,)),
        profiles.Timed("high", 0, "matmul", "forward", 1.0, 2.0, 10**6, 10, 1, (0.0,), (1.0,)),
        profiles.Timed("none", 0, "other", "forward", 1.0, 1.0, 0, 10, 1, (0.0,), (1.0,)),
    ]
    placed = {p.name: p for p in profiles.roofline(rows, hw)}
    assert set(placed) == {"low", "high"}  # an op without FLOPs has no place on it
    assert placed["low"].bound == "memory" and placed["low"].roof == 0.1 * hw.hbm
    assert placed["high"].bound == "compute" and placed["high"].roof == hw.flops
    assert placed["high"].achieved == 10**6 / 2.0  # over its wall time, not its share
    assert profiles.attainable(ridge, hw) == pytest.approx(hw.flops)
    assert profiles.mfu(hw.flops * 0.5, 1.0, hw) == 0.5
    assert profiles.reached(placed.values()) == 10**6 / 2.0  # the one product's rate
    assert profiles.reached(placed.values(), "other") == 10 / 1.0
    with pytest.raises(ValueError, match="no attention op"):
        profiles.reached(placed.values(), "attention")


def test_the_phase_of_an_op_comes_from_its_source() -> None:
    assert profiles.phase("jit(train_step)/optimizer/cond/add") == "optimizer"
    assert profiles.phase("jit(train_step)/transpose(jvp(ble,ev->blv))/dot_general") == ("backward")
    assert profiles.phase("jit(train_step)/jvp()/mul") == "forward"
    assert profiles.phase("jit(f)/add") == "other"


def test_the_probe_measures_a_peak_and_alongside_keeps_the_fastest() -> None:
    probe = machine.Probe(jax.devices()[0], size=256, megabytes=8)
    times = iter([3.0, 1.0, 2.0])
    best, hw = machine.alongside(lambda: next(times), probe)
    assert best == 1.0
    assert hw.flops > 0 and hw.hbm > 0 and hw.flops == probe.flops
    shared = machine.emulated(hw, 4)
    assert shared.flops == hw.flops / 4 and shared.hbm == shared.fast == hw.hbm / 4


def test_an_accelerators_ops_belong_to_the_launch_before_them(tmp_path: Path) -> None:
    # a GPU trace: kernels name their op and program but not their run; the host's launch
    # of the program names the run
    def launch(ts: float, run: str) -> dict:
        args = {"name": "jit_f", "run_id": run}
        return {"ph": "X", "pid": 1, "tid": 1, "ts": ts, "dur": 5.0, "name": "Run", "args": args}

    kernels = []
    for ts in (20.0, 120.0):
        event = _op("gemm_fusion.1", ts, 3.0, tid=7)
        del event["args"]["run_id"], event["args"]["device_ordinal"]
        event["args"]["hlo_module"], event["pid"] = "jit_f", 2
        kernels.append(event)
    process = {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}}
    _trace_file(tmp_path, [process, launch(10.0, "a"), launch(110.0, "b"), *kernels])
    trace = profiles.read(tmp_path)
    assert [(o.run, o.device) for o in trace.ops] == [("a", 0), ("b", 0)]
    assert trace.runs() == ["a", "b"]


def test_step_options_ask_each_backend_only_for_what_it_knows() -> None:
    options = profiles.step_options(jax.devices()[0])
    assert options == OPTIMIZED | {"xla_cpu_enable_xprof_traceme": True}
    assert nx.compiling.accepts("cpu", "xla_backend_optimization_level", 3)
    assert not nx.compiling.accepts("cpu", "xla_no_such_option_anywhere", True)


def test_the_wait_for_the_last_device_is_read_off_the_starts() -> None:
    def row(device: int, start: float, duration: float) -> profiles.Timed:
        return profiles.Timed(
            "all-reduce.1", device, "collective", "backward", 1.0, 1.0, 0, 8, 1,
            (start,), (duration,),
        )  # fmt: skip

    # device 0 arrives at 0 and waits 6 of its 8; device 1 arrives last and waits none
    assert profiles.waiting([row(0, 0.0, 8.0), row(1, 6.0, 2.0)]) == pytest.approx(0.6)
    assert profiles.waiting([]) == 0.0


def test_an_op_that_takes_no_time_takes_no_share(tmp_path: Path) -> None:
    _trace_file(tmp_path, [_op("a.1", 0.0, 0.0), _op("b.2", 5.0, 2.0)])
    share = profiles.shared(profiles.read(tmp_path).ops)
    assert sorted(share.values()) == [2.0]


def test_cpu_seconds_count_work_and_not_waiting() -> None:
    start = machine.cpu_seconds()
    time.sleep(0.3)
    slept = machine.cpu_seconds() - start
    start, wall = machine.cpu_seconds(), time.perf_counter()
    while time.perf_counter() - wall < 0.3:
        sum(range(1000))
    worked = machine.cpu_seconds() - start
    assert slept < 0.02 < worked  # one busy thread: up to 0.3 s over the cores, less if shared
    assert worked <= 0.3 / machine.cores() + 0.02


def test_time_step_times_the_step_and_the_probe_on_the_probes_clock(fsdp: nx.Trainer) -> None:
    ticks = []

    def clock() -> float:
        ticks.append(time.perf_counter())
        return ticks[-1]

    probe = machine.Probe(jax.devices(), size=256, megabytes=8, clock=clock)
    batches = nx.book_batches(8, CFG.max_len)
    best, hw = machine.time_step(fsdp, batches, probe, repeats=2)
    assert len(ticks) == 2 * (2 + 2 + 2)  # 2 steps, 2 products, 2 passes: a start and an end
    steps = [ticks[i + 1] - ticks[i] for i in (0, 6)]
    assert best == min(steps) and hw.flops == probe.flops > 0
    on_cpu = machine.Probe(jax.devices(), size=256, megabytes=8, clock=machine.cpu_seconds)
    best, hw = machine.time_step(fsdp, batches, on_cpu, repeats=1)
    assert best > 0 and hw.flops > 0 and hw.hbm > 0


def test_cpu_time_is_refused_for_an_accelerator_and_a_probe_of_other_devices() -> None:
    with pytest.raises(ValueError, match="wall clock"):
        machine.check_clock(machine.cpu_seconds, "gpu")
    machine.check_clock(machine.cpu_seconds, "cpu")
    machine.check_clock(time.perf_counter, "gpu")
    probe = machine.Probe(jax.devices()[0], size=64, megabytes=1)
    gpus = np.array([types.SimpleNamespace(platform="gpu")])
    trainer = types.SimpleNamespace(
        layout=types.SimpleNamespace(mesh=types.SimpleNamespace(devices=gpus))
    )
    with pytest.raises(ValueError, match="probe the devices the step runs on"):
        machine.time_step(trainer, None, probe)
