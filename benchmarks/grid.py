"""The cost model against the Ultra-Scale Playbook's grid of measured nanotron runs.

Run from the repository root: python benchmarks/grid.py [--fit]
Prints, per model and node count, the runs priced, Spearman's rank correlation between
predicted and measured tokens per second per GPU, the regret (the measured best over what
the model's first pick measured), the share of runs predicted within 1.5 times, the share
whose peak memory is predicted within 1.3 times, and whether the group is fitted on (1 to 8
nodes) or tests (16 to 64); then each split's summary against the issue's targets. With
--fit, fits the GPU's launch, sync and far-hop costs on the fit split again
(`nnxscale.evidence.grid.fit`, about 30 s on two cores) and prints them beside the library's.
Nothing runs on a device: the model is arithmetic.
"""

from __future__ import annotations

import sys

from nnxscale.core.show import table
from nnxscale.evidence import grid


def main(refit: bool = False) -> None:
    found = grid.runs()
    aside = grid.anomalies(found)
    priced = grid.priced()
    print(
        f"{len(found)} configurations, {sum(r.ok for r in found)} measured, {len(aside)} set "
        f"aside before pricing (`anomalies`), {len(priced)} priced"
    )
    groups = grid.rank(priced)
    rows = [
        [g.model, g.nodes, g.runs, f"{g.rank:+.2f}", f"{g.regret:.2f}", f"{g.within:.0%}",
         f"{g.memory:.0%}", "fit" if g.nodes in grid.FIT_NODES else "test", g.pick.label]
        for g in groups
    ]  # fmt: skip
    headers = ["model", "nodes", "runs", "rank", "regret", "within 1.5x", "memory 1.3x", "split"]
    print(table([*headers, "first pick"], rows))
    for name, fitted in (("fit", True), ("test", False)):
        found_split = grid.split(groups, fitted)
        print(
            f"{name}: median rank {found_split['median rank']:.2f} (target >= 0.7), worst "
            f"regret {found_split['worst regret']:.2f} (<= 1.3), within 1.5x "
            f"{found_split['within 1.5x']:.0%} (>= 60%), memory within 1.3x "
            f"{found_split['memory within 1.3x']:.0%} (>= 80%)"
        )
    if refit:
        hw, miss = grid.fit()
        for name in grid.FITTED:
            print(f"{name}: fitted {getattr(hw, name):.4g} s (median miss {miss:.4f})")


if __name__ == "__main__":
    main("--fit" in sys.argv[1:])
