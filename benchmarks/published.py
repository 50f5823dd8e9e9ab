"""The cost model against published training runs: predicted over published, per run.

Run from the repository root: python benchmarks/published.py
Prints every run of `nnxscale.evidence.table` (MaxText's TPU tables, PaLM, llm-foundry's MPT
tables, Llama 3, Megatron-LM and Megatron-Core, torchtitan, NeMo Automodel, MaxText on A3,
and one H200 measured for this book) with its layout, the quantity, the published value, the
model's, their ratio, its role (calibrates, test or known miss) and its source; a run the
model cannot express names why. Then the tests per device and per layout family, the worst
test against `runs.WORST`, the known misses against `runs.MISSES`, and each device's
efficiency as its calibrating run gives it. Nothing runs on a device: the model is arithmetic.
"""

from __future__ import annotations

from nnxscale.core.show import table
from nnxscale.costs import HARDWARE
from nnxscale.evidence import runs
from nnxscale.evidence import table as evidence


def main() -> None:
    found = evidence.runs()
    print(table(list(runs.COLUMNS), runs.rows(found)))
    for by in ("hardware", "family"):
        rows = [
            [t.group, t.runs, t.calibrators, t.tests, t.misses, f"{t.median:.2f}", f"{t.worst:.2f}"]
            for t in runs.summary(found, by=by)
        ]
        headers = [by, "runs", "calibrate", "tests", "known misses", "median ratio", "worst"]
        print("\n" + str(table(headers, rows)))
    factor, run = runs.worst(found)
    misses = sum(bool(r.misses) for r in found)
    sources = len({r.source for r in found})
    verdict = "within" if factor <= runs.WORST else "OUTSIDE"
    print(
        f"\n{len(found)} runs from {sources} sources, {len(runs.tests(found))} tests; worst "
        f"{factor:.2f} ({run.name}), {verdict} {runs.WORST}; {misses} known misses "
        f"({misses / len(found):.1%}, at most {runs.MISSES:.0%})"
    )
    for r in found:
        if r.calibrates:
            hw = HARDWARE[r.hardware]
            print(f"{hw.name}: efficiency {runs.calibrate(r):.4f} from {r.name} "
                  f"(the library states {hw.efficiency})")  # fmt: skip


if __name__ == "__main__":
    main()
