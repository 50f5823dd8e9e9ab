"""A multi-process run planned before it starts equals what its workers report, and each
process writes its devices' shards of the checkpoint."""

from __future__ import annotations

import math

import pytest

from nnxscale import Checkpoints, cli, events, launch
from nnxscale.checkpoint.multi import bytes_written, planned
from nnxscale.costs import crossing
from nnxscale.placement.catalogue import FSDP_TP


def test_each_process_owns_a_run_of_devices_and_loads_their_rows() -> None:
    starts = planned(4, 16, 256)
    assert [s.device_ids for s in starts] == [list(range(4 * p, 4 * p + 4)) for p in range(4)]
    assert [s.rows for s in starts] == [[64 * p, 64 * p + 64] for p in range(4)]
    assert {s.processes for s in starts} == {4} and {s.local_devices for s in starts} == {4}
    assert starts[0].mesh_device_ids == [[d] for d in range(16)]  # FSDP's (data, model)


def test_a_batch_split_over_one_axis_of_two_is_loaded_by_its_rows() -> None:
    starts = planned(2, 8, 16, FSDP_TP)  # batch over `data` (4), `model` (2) holds the same rows
    assert starts[0].mesh_device_ids == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert [s.rows for s in starts] == [[0, 8], [8, 16]]


def test_the_default_run_has_at_least_a_device_per_process_and_two_rows_each() -> None:
    starts = planned(3)  # 8 devices here: 2 each, 6 in the run
    assert [s.device_ids for s in starts] == [[0, 1], [2, 3], [4, 5]]
    assert starts[0].batch_size == 12


@pytest.mark.parametrize(
    ("args", "message"),
    [((0,), "whole number"), ((3, 8), "multiple of 3, such as 6"), ((2, 8, 12), "multiple of 8")],
)
def test_a_run_that_cannot_be_shared_is_refused(args, message) -> None:
    with pytest.raises(ValueError, match=message):
        planned(*args)


@pytest.mark.slow
def test_the_plan_is_what_the_workers_report_and_each_writes_its_shards(tmp_path) -> None:
    """Two processes of one device each train and save; their `Start` events are the plan
    (device ids by position), and each wrote half of every array split over both devices,
    process 0 the arrays kept whole."""
    args = ["train", str(tmp_path), "--steps", "1", "--save-every", "1", "--batch-size", "4"]
    output = launch.launch([*cli.PROGRAM, *args], 2, 1, timeout=240, echo=None)
    reported = sorted(events.read(output, events.Start), key=lambda s: s.process)
    ids = sorted(d for s in reported for d in s.device_ids)  # CPU ids: an offset per process
    for got, want in zip(reported, planned(2, 2, 4), strict=True):
        assert [ids.index(d) for d in got.device_ids] == want.device_ids
        assert (got.rows, got.mesh_axes, got.batch_size) == (want.rows, want.mesh_axes, 4)
    with Checkpoints(tmp_path, create=False) as checkpoints:
        written = bytes_written(checkpoints)
        arrays, chunks = checkpoints.saved_arrays(), checkpoints.chunks()
    itemsize = {"float32": 4, "int32": 4, "uint32": 4}
    sizes = {path: itemsize[dtype] * math.prod(shape) for path, (shape, dtype) in arrays.items()}
    split = sum(b for path, b in sizes.items() if chunks[path] != arrays[path][0])
    whole = sum(sizes.values()) - split
    assert split and whole  # FSDP splits the weights; the step counters stay whole
    assert written == {0: split // 2 + whole, 1: split // 2}


@pytest.mark.slow
@pytest.mark.parametrize("rules", ["HSDP", "HSDP+TP"])
def test_on_a_mesh_across_processes_only_the_replica_axis_crosses_as_the_cost_model_says(
    rules,
) -> None:
    """Two processes of 4 devices, `replica` across them and FSDP (and TP) inside each: the
    compiled step's collectives that cross processes are exactly those over `replica`, the
    ones the cost model puts on the slow links when a fast domain is one process's devices;
    and every byte of the gradient crosses once, as the cost model prices it: a 1/d slice
    over `replica`, except the small arrays the compiler reduces whole over both axes."""
    report = cli.crossing(rules)
    assert report.inside["replica"] == 1 and math.prod(report.inside.values()) == 4
    crossing.compare(rules, report).check()
    shown = crossing.recorded(rules)  # what chapter 8 shows
    assert (report.mesh, report.inside, report.moved) == (shown.mesh, shown.inside, shown.moved), (
        "chapter 8's recording differs from this run: run benchmarks/crossing.py to record again"
    )
