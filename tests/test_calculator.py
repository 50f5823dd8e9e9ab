"""The calculator's Python side (`nnxscale.calculator`) and its script, run in Node.js on the
browser test's grid: the same numbers without building the book."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from importlib import resources

import pytest
from test_browser import calculator_grid, library_answer

from nnxscale import calculator, costs
from nnxscale.placement.catalogue import STRATEGIES

RUN = """
globalThis.window = {};
globalThis.document = { querySelectorAll: () => [] };
%s
const spec = %s;
process.stdout.write(JSON.stringify(%s.map((i) => window.nnxscaleCalculator.stepCost(
  spec, i, i.strategy, i.remat, spec.hardware.find((h) => h.name === i.hardware), i.devices,
  Object.fromEntries(Object.values(spec.degrees).map((name) => [name, i[name]])),
  i.batch, i.seq, i.micro, i.schedule, i.virtual, i.ledger, i.precision))));
"""
"""The script's `stepCost` over a list of the grid's inputs, without a page."""


def test_a_pipeline_takes_its_schedule_and_other_rule_sets_ignore_it() -> None:
    degrees = {"tensor": 2, "stages": 2, "context": 2, "replicas": 2, "expert_axis": 2}
    pp = STRATEGIES["PP+FSDP+TP"]
    lockstep = calculator.setup_for(pp, 8, degrees, 4, "full", "lockstep", 2, "program")
    assert (lockstep.schedule, lockstep.virtual, lockstep.remat) == ("lockstep", 1, False)
    assert lockstep.precision == costs.PLANNING and lockstep.ledger == "program"
    interleaved = calculator.setup_for(pp, 8, degrees, 4, "full", "1F1B", 2)
    assert (interleaved.schedule, interleaved.virtual, interleaved.remat) == ("1F1B", 2, "full")
    fsdp = calculator.setup_for(STRATEGIES["FSDP"], 8, degrees, 4, "dots", "1F1B", 2)
    assert (fsdp.schedule, fsdp.virtual, fsdp.remat) == ("lockstep", 1, "dots")
    strategies = calculator.spec()["strategies"]
    for ledger in costs.LEDGERS:
        forms = strategies["PP+FSDP+TP"]["ledgers"][ledger]
        assert set(forms["one_f_one_b"]["0"]) == {"no", "dots", "full"}
        assert strategies["FSDP"]["ledgers"][ledger]["one_f_one_b"] == {}
    assert strategies["PP+FSDP+TP"]["ledgers"]["fused"]["mlp"] == {}  # no lockstep executor
    assert "ledger='program'" in strategies["PP+FSDP+TP"]["unledgered"]


def test_the_script_computes_what_the_library_computes() -> None:
    """Every fourth input of the browser test's grid, and a pipeline with no virtual stage,
    in Node.js: the library's step time, exposed communication, peak and bound (to 1e-9
    relative), or its reason."""
    node = shutil.which("node")
    if node is None:
        if os.environ.get("NNXSCALE_REQUIRE_BROWSER") == "1":
            pytest.fail("Node.js is not installed (.ci/setup installs it)")
        pytest.skip("Node.js is not installed")
    grid = calculator_grid()[::4]
    staged = next(i for i in grid if i["schedule"] == "1F1B" and library_answer(i)[0] != "mesh")
    grid.append({**staged, "virtual": 0})  # refused, with the library's words
    script = resources.files("nnxscale.costs").joinpath("calculator.js").read_text()
    source = RUN % (script, json.dumps(calculator.spec()), json.dumps(grid))
    shown = json.loads(
        subprocess.run([node], input=source, capture_output=True, text=True, check=True).stdout
    )
    priced = 0
    for inputs, got in zip(grid, shown, strict=True):
        kind, answer = library_answer(inputs)
        if kind == "mesh":
            assert "do not divide" in got["reason"], inputs
            continue
        if kind == "reason":
            assert got["reason"] == answer, inputs
            continue
        _, cost = answer
        priced += 1
        assert got["bound"] == cost.bound, inputs
        for field, value in (
            ("step_time", cost.step_time),
            ("exposed", cost.exposed),
            ("peak", cost.peak),
            ("bubble", cost.bubble),
        ):
            assert got[field] == pytest.approx(value, rel=1e-9, abs=1e-12), (field, inputs)
    assert priced >= 250
