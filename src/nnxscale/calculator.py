"""The cost model as a calculator in the page: plain JavaScript, no server, no network.

`widget()` returns an HTML output (Jupyter, Colab and the built book all show it) holding
a form, the constants of `nnxscale.costs` written out as JSON, and `calculator.js`, which
runs the same formulas as `nnxscale.costs.step_cost` on them in the browser.
"""

from __future__ import annotations

import dataclasses
import html
import json
from importlib import resources
from typing import Any

from nnxscale import costs
from nnxscale.model import Config
from nnxscale.rules import STRATEGIES


def spec() -> dict[str, Any]:
    """The constants the JavaScript computes with, all read from the library."""
    return {
        "hardware": [dataclasses.asdict(hw) for hw in costs.HARDWARE.values()],
        "splits": {name: list(splits) for name, splits in costs.SPLITS.items()},
        "strategies": {
            name: {"axes": list(STRATEGIES[name].axes), "sizes": list(STRATEGIES[name].sizes)}
            for name in costs.STRATEGY_NAMES
        },
        "constants": {
            name: getattr(costs, name)
            for name in ("STATE_BYTES", "OPTIMIZER_COPIES", "LOGIT_BYTES", "LATENCY", "EFFICIENCY")
        },
        "dtypes": costs.DTYPE_BYTES,
    }


FIELDS = (
    ("vocab", "vocabulary"),
    ("embed", "embed (E)"),
    ("heads", "heads (H)"),
    ("head_dim", "head dim (D)"),
    ("mlp", "MLP width (F)"),
    ("layers", "layers (L)"),
)


class Calculator:
    """An HTML output: the form, the constants and the script."""

    def __init__(self, markup: str) -> None:
        self.markup = markup

    def _repr_html_(self) -> str:
        return self.markup


def widget(
    cfg: Config = costs.SEVEN_B,
    *,
    strategy: str = "FSDP",
    hardware: str = "H100",
    devices: int = 8,
    sequences: int = 64,
    remat: bool = True,
) -> Calculator:
    """The in-page calculator, starting from `cfg` and a cluster; every input can be changed."""

    def number(name: str, label: str, value: int) -> str:
        return (
            f'<label>{label}<input name="{name}" type="number" min="1" step="1" '
            f'value="{value}"></label>'
        )

    def choice(name: str, label: str, options: list[str], chosen: str) -> str:
        items = "".join(
            f"<option{' selected' if o == chosen else ''}>{html.escape(o)}</option>"
            for o in options
        )
        return f'<label>{label}<select name="{name}">{items}</select></label>'

    inputs = [number(name, label, getattr(cfg, name)) for name, label in FIELDS]
    inputs += [
        number("seq", "sequence length (s)", cfg.max_len),
        number("batch", "global batch (sequences)", sequences),
        number("devices", "devices", devices),
        choice("dtype", "activations", ["bfloat16", "float32"], cfg.compute_dtype),
        choice("hardware", "hardware", list(costs.HARDWARE), hardware),
        choice("strategy", "strategy", list(costs.STRATEGY_NAMES), strategy),
        f'<label class="nnxscale-calc-check"><input name="remat" type="checkbox"'
        f"{' checked' if remat else ''}>remat</label>",
    ]
    script = resources.files("nnxscale").joinpath("calculator.js").read_text()
    data = json.dumps(spec()).replace("</", "<\\/")
    markup = (
        '<div class="nnxscale-calc">'
        f'<form onsubmit="return false">{"".join(inputs)}</form>'
        '<div class="nnxscale-calc-out"></div>'
        f'<script type="application/json">{data}</script>'
        f"<style>{STYLE}</style><script>{script}</script></div>"
    )
    return Calculator(markup)


STYLE = """
.nnxscale-calc form { display: grid; gap: 0.4rem 0.8rem;
  grid-template-columns: repeat(auto-fill, minmax(9.5rem, 1fr)); margin-bottom: 0.8rem; }
.nnxscale-calc label { display: flex; flex-direction: column; font-size: 0.85rem; }
.nnxscale-calc label.nnxscale-calc-check { flex-direction: row; align-items: center;
  gap: 0.4rem; }
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
