"""The cost model against published training runs: predicted over published, per run.

Run from the repository root: python benchmarks/published.py
Prints every run of `nnxscale.costs.runs` (MaxText's TPU tables, PaLM, Llama 3, Megatron-LM
and one H200 measured for this book) with the configuration, the quantity, the published
value, the model's, their ratio and the source; a run the model cannot express names why.
The last lines give the worst ratio against `runs.WORST` and each device's efficiency as
its calibrating run gives it. Nothing runs on a device: the model is arithmetic.
"""

from __future__ import annotations

from nnxscale.core.show import table
from nnxscale.costs import HARDWARE, runs


def main() -> None:
    found = runs.runs()
    print(table(list(runs.COLUMNS), runs.rows(found)))
    factor, run = runs.worst(found)
    priced = sum(not r.problem() and not r.misses for r in found)
    sources = len({r.source for r in found})
    verdict = "within" if factor <= runs.WORST else "OUTSIDE"
    print(
        f"\n{len(found)} runs from {sources} sources, {priced} held to the factor; worst "
        f"{factor:.2f} ({run.name}), {verdict} {runs.WORST}"
    )
    for r in found:
        if r.calibrates:
            hw = HARDWARE[r.hardware]
            print(f"{hw.name}: efficiency {runs.calibrate(r):.3f} from {r.name} "
                  f"(the library states {hw.efficiency})")  # fmt: skip


if __name__ == "__main__":
    main()
