"""The cost model as a calculator in the page: plain JavaScript, no server, no network.

`widget()` returns an HTML output (Jupyter, Colab and the built book all show it) holding a
form, the formulas `nnxscale.costs.derive` derives from every rule set the planner considers
(`spec`, as JSON) and `calculator.js`, which evaluates them: a new rule set is a new entry of
that data, not new code in the page. The script repeats only `step_cost`'s arithmetic rules
(phases of memory, links, overlap, a pipeline's ticks), and a browser test compares its
answers with the library's over a grid of inputs.
"""

from __future__ import annotations

import dataclasses
import html
import json
import math
from importlib import resources
from typing import Any

from nnxscale.costs.counts import (
    LEDGERS,
    PLANNING,
    PRECISIONS,
    SCHEDULES,
    STATE_BYTES,
    Precision,
    Setup,
)
from nnxscale.costs.coverage import unpriced
from nnxscale.costs.derive import derive, unledgered
from nnxscale.costs.hardware import HARDWARE, TUNED_SHARE
from nnxscale.costs.moves import OVERLAPS
from nnxscale.costs.network import HIDDEN
from nnxscale.costs.planner import EXPERT_PLANNED, HEADROOM, PLANNED, REMATS
from nnxscale.model.config import Config
from nnxscale.model.configs import LLAMA3_8B
from nnxscale.model.context import BLOCK
from nnxscale.placement.catalogue import STRATEGIES
from nnxscale.placement.rules import Rules

DTYPE = "bfloat16"
"""The compute dtype the calculator prices: what large models train in."""

DEGREES = {
    "model": "tensor",
    "stage": "stages",
    "context": "context",
    "replica": "replicas",
    "expert": "expert_axis",
}
"""The mesh axes whose size the calculator asks for, and the form's name for each."""


def setup_for(
    rules: Rules,
    devices: int,
    degrees: dict[str, int],
    micro: int,
    remat: bool | str,
    schedule: str = "lockstep",
    virtual: int = 1,
    ledger: str = "fused",
    precision: Precision = PLANNING,
) -> Setup:
    """The setup the calculator prices: the axes named in `DEGREES` of the size asked, the
    rest of the devices on the first other axis the rule set uses (a rule set of one axis
    takes them all), and the axes it does not use of one device. A pipeline runs on
    `schedule`, with `virtual` stages on 1F1B (two on ZB-V); the lockstep executor rebuilds
    its stages itself, so it takes no remat policy (nor do other rule sets take a
    schedule). Memory is `ledger`'s, the state holds `precision`'s bytes per parameter."""
    chosen = {"precision": precision, "ledger": ledger}
    used = rules.mesh_axes()
    sizes = {a: degrees.get(DEGREES[a], 1) for a in rules.axes if a in DEGREES and a in used}
    if len(rules.axes) == 1:
        sizes = {}
    rest = [a for a in rules.axes if a in used and a not in sizes]
    fixed = math.prod(sizes.values())
    if rest:
        sizes[rest[0]] = devices // fixed if devices % fixed == 0 else 0
    mesh = {a: sizes.get(a, 1) for a in rules.axes}
    if math.prod(mesh.values()) != devices:
        raise ValueError(
            f"a mesh {mesh} for {rules.name} does not use all {devices} devices: choose "
            "degrees whose product divides the device count"
        )
    if not rules.axes_of("layers"):
        return Setup.of(rules, mesh, micro, remat, **chosen)
    if schedule == "lockstep":
        return Setup.of(rules, mesh, micro, False, **chosen)
    return Setup.of(rules, mesh, micro, remat, schedule=schedule, virtual=virtual, **chosen)


MLPS = (0, 1, 2)
"""The kinds of MLP the calculator prices (`nnxscale.activations.mixture`): dense, a mixture
whose tokens choose one expert, one whose tokens choose several."""


def spec() -> dict[str, Any]:
    """What the JavaScript computes with, all from the library: hardware, constants, the
    precisions, and for each planned rule set, ledger, kind of MLP and remat policy the
    formulas `costs.derive` gives (or why the cost model has none: `unpriced`,
    `unledgered`)."""
    strategies = {}
    for name in PLANNED + EXPERT_PLANNED:
        rules = STRATEGIES[name]
        pipeline = bool(rules.axes_of("layers"))
        strategies[name] = {
            "axes": list(rules.axes),
            "used": [a for a in rules.axes if a in rules.mesh_axes()],
            "unpriced": {
                schedule: {str(moe): unpriced(rules, moe, schedule) for moe in MLPS}
                for schedule in ("lockstep", "1F1B")
            },
            "unledgered": unledgered(rules, "lockstep", "fused"),
            "ledgers": {
                ledger: {
                    "mlp": {}
                    if pipeline and ledger == "fused"
                    else _formulas(rules, "lockstep", (False,) if pipeline else REMATS, ledger),
                    "one_f_one_b": _formulas(rules, "1F1B", REMATS, ledger) if pipeline else {},
                }
                for ledger in LEDGERS
            },
        }
    return {
        "hardware": [dataclasses.asdict(hw) for hw in HARDWARE.values()],
        "strategies": strategies,
        "degrees": DEGREES,
        "overlaps": list(OVERLAPS),
        "precisions": {k: dataclasses.asdict(v) for k, v in PRECISIONS.items()},
        "ledgers": LEDGERS,
        "constants": {
            "HIDDEN": list(HIDDEN),
            "HEADROOM": HEADROOM,
            "STATE_BYTES": STATE_BYTES,
            "BLOCK": BLOCK,
            "TUNED_SHARE": TUNED_SHARE,
            "BOOK": dataclasses.asdict(Precision()),
        },
        "parameters": {
            str(moe): derive(STRATEGIES["DP"], DTYPE, False, moe).state["parameters"].json()
            for moe in MLPS
        },
    }


def _formulas(
    rules: Rules, schedule: str, remats: tuple[bool | str, ...], ledger: str
) -> dict[str, object]:
    """Per kind of MLP the cost model prices for `rules`, and per remat policy, the formulas
    of a step on `schedule` (a pipeline's; the others ignore it) under `ledger`."""
    return {
        str(moe): {
            _remat_name(r): derive(rules, DTYPE, r, moe, schedule, ledger=ledger).json()
            for r in remats
        }
        for moe in MLPS
        if not unpriced(rules, moe, schedule)
    }


def _remat_name(remat: bool | str) -> str:
    return remat if isinstance(remat, str) else ("full" if remat else "no")


FIELDS = (
    ("vocab", "vocabulary"),
    ("embed", "embed (E)"),
    ("heads", "heads (H)"),
    ("kv_heads", "key/value heads (K)"),
    ("head_dim", "head dim (D)"),
    ("mlp", "MLP width (F)"),
    ("layers", "layers (L)"),
    ("experts", "experts (0: dense)"),
    ("top_k", "experts per token (k)"),
)


class Calculator:
    """An HTML output: the form, the formulas and the script."""

    def __init__(self, markup: str) -> None:
        self.markup = markup

    def _repr_html_(self) -> str:
        return self.markup


def widget(
    cfg: Config = LLAMA3_8B,
    *,
    strategy: str = "FSDP",
    hardware: str = "H100",
    devices: int = 8,
    sequences: int = 64,
    micro_batches: int = 4,
    remat: str = "dots",
    ledger: str = "fused",
) -> Calculator:
    """The in-page calculator, starting from `cfg` and a cluster; every input can be changed,
    the memory ledger (`nnxscale.costs.LEDGERS`) and the precision of the state included
    (the planner's by default: `nnxscale.costs.PLANNING`)."""
    planning = next(k for k, v in PRECISIONS.items() if v == PLANNING)

    number, choice = _number, _choice
    inputs = [
        number(name, label, getattr(cfg, name), 0 if name == "experts" else 1)
        for name, label in FIELDS
    ]
    inputs += [
        number("capacity_factor", "capacity factor", cfg.capacity_factor, 0, 0.05),
        number("seq", "sequence length (s)", cfg.max_len),
        number("batch", "global batch (sequences)", sequences),
        number("devices", "devices", devices),
        choice("hardware", "hardware", list(HARDWARE), hardware),
        choice("strategy", "strategy", list(PLANNED + EXPERT_PLANNED), strategy),
        number("tensor", "tensor width (model)", 2),
        number("stages", "pipeline stages", 2),
        number("context", "context ring", 2),
        number("replicas", "replicas (HSDP)", 2),
        number("expert_axis", "expert axis (EP)", 2),
        number("micro", "micro-batches", micro_batches),
        choice("remat", "remat", ["no", "dots", "full"], remat),
        choice("schedule", "pipeline schedule", list(SCHEDULES), "1F1B"),
        number("virtual", "virtual stages (1F1B)", 1),
        choice("ledger", "memory ledger", list(LEDGERS), ledger),
        choice("precision", "state per parameter", list(PRECISIONS), planning),
    ]
    script = resources.files("nnxscale.costs").joinpath("calculator.js").read_text()
    data = json.dumps(spec()).replace("</", "<\\/")
    markup = (
        '<div class="nnxscale-calc">'
        f'<form onsubmit="return false">{"".join(inputs)}</form>'
        '<div class="nnxscale-calc-out"></div>'
        f'<script type="application/json">{data}</script>'
        f"<style>{STYLE}</style><script>{script}</script></div>"
    )
    return Calculator(markup)


def _number(name: str, label: str, value: float, least: int = 1, step: float = 1) -> str:
    """A number field of the form."""
    return (
        f'<label>{label}<input name="{name}" type="number" min="{least}" step="{step}" '
        f'value="{value}"></label>'
    )


def _choice(name: str, label: str, options: list[str], chosen: str) -> str:
    """A drop-down of the form."""
    items = "".join(
        f"<option{' selected' if o == chosen else ''}>{html.escape(o)}</option>" for o in options
    )
    return f'<label>{label}<select name="{name}">{items}</select></label>'


STYLE = """
.nnxscale-calc form { display: grid; gap: 0.4rem 0.8rem;
  grid-template-columns: repeat(auto-fill, minmax(9.5rem, 1fr)); margin-bottom: 0.8rem; }
.nnxscale-calc label { display: flex; flex-direction: column; font-size: 0.85rem; }
.nnxscale-calc input[type=number], .nnxscale-calc select { width: 100%; box-sizing: border-box; }
.nnxscale-calc-bar { position: relative; display: flex; width: 100%; max-width: 100%;
  border: 1px solid #888; margin: 0.3rem 0; }
.nnxscale-calc-limit { position: absolute; top: -0.3rem; bottom: -0.3rem;
  border-left: 2px dashed currentColor; }
.nnxscale-calc-legend { display: flex; flex-wrap: wrap; gap: 0.2rem 1rem; font-size: 0.85rem; }
.nnxscale-calc-legend i { display: inline-block; width: 0.8rem; height: 0.8rem;
  margin-right: 0.3rem; vertical-align: middle; }
.nnxscale-calc-table th { text-align: left; font-weight: normal; padding-right: 1rem; }
.nnxscale-calc-table { max-width: 100%; }
"""
