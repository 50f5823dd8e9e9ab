"""The four pipeline schedules executed: ticks, bubbles, temporaries and step times, one run.

Run from the repository root: python benchmarks/pipeline.py [--devices 8] [--steps 10]
Chapter 7's model (TINY with 8 layers, layers in a scan) on 4 stages (fewer if there are
fewer devices), micro-batches of 2 rows of 32 tokens. For each schedule and m: the executor's
clock ticks, the idle share of its tick table against the unit-cost simulation and the
schedule's formula, the buffer slots the table keeps (stage inputs, output gradients), XLA's
temporary bytes of the compiled loss-and-gradients program, and the median wall time of that
program, also as a ratio to 1F1B's with the same m, measured in the same process one after
the other. On a CPU the emulated devices share its cores, so a lockstep tick costs its
devices' work added up: times show the work each schedule does, not a pipeline's speed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax

from nnxscale import TINY, create, pipeline
from nnxscale.core.memory import CompiledMemory
from nnxscale.parallelism.schedules import (
    bubble_formula,
    gpipe,
    interleaved,
    one_f_one_b,
    simulate,
    zero_bubble,
    zero_bubble_formula,
)
from nnxscale.runtime.devices import emulate_devices
from nnxscale.train.data import book_batches

MODEL = TINY.replace(layers=8, scan_layers=True)
ROWS = 2  # rows per micro-batch


def main() -> None:
    """Compile and time each schedule at m = 8 and 16; print a table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    emulate_devices(args.devices, optimize=True)  # timed: XLA's own compiler options
    p = max(s for s in (1, 2, 4) if s <= args.devices)
    mesh = pipeline.pipeline_mesh(p)
    rows = []
    for m in (8, 16):
        for schedule in (gpipe(p, m), one_f_one_b(p, m), interleaved(p, m, 2), zero_bubble(p, m)):
            model = pipeline.placed(create(MODEL), mesh, schedule.virtual)
            tokens = book_batches(batch_size=ROWS * m).rows(0)
            step = jax.jit(lambda mdl, t, s=schedule: pipeline.loss_and_grads(mdl, t, s, mesh))
            compiled = step.lower(model, tokens).compile()
            jax.block_until_ready(compiled(model, tokens))  # warm-up
            times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                jax.block_until_ready(compiled(model, tokens))
                times.append(time.perf_counter() - start)
            ticks = pipeline.tick_table(schedule)
            formula = (
                zero_bubble_formula(p, m)
                if schedule.split
                else bubble_formula(p, m, schedule.virtual)
            )
            unit = simulate(schedule, lambda task: 1.0).bubble()
            rows.append(
                [schedule.name, m, ticks.count, ticks.idle_share(), unit, formula,
                 ticks.x_slots, ticks.g_slots, CompiledMemory.of(compiled).temp,
                 statistics.median(times) * 1e3]
            )  # fmt: skip
    print(f"{p} stages, {MODEL.layers} layers, micro-batches of {ROWS}x32 tokens, "
          f"{args.devices} devices, median of {args.steps} runs")  # fmt: skip
    header = ["schedule", "m", "ticks", "idle (executed)", "idle (simulated)", "formula",
              "input slots", "grad slots", "temp bytes", "step ms", "time / 1F1B"]  # fmt: skip
    print(f"{header[0]:24}" + "".join(f"{h:>17}" for h in header[1:]))
    ms_1f1b = {r[1]: r[-1] for r in rows if r[0] == "1F1B"}
    for name, m, count, idle, unit, formula, xs, gs, temp, ms in rows:
        print(f"{name:24}{m:17d}{count:17d}{idle:17.4f}{unit:17.4f}{formula:17.4f}{xs:17d}"
              f"{gs:17d}{temp:17,d}{ms:17.1f}{ms / ms_1f1b[m]:17.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
