"""Hand-written FSDP (shard_map) against the compiler's FSDP and DP, in one run, on one mesh.

Run from the repository root: python benchmarks/fsdp.py [--devices 8] [--steps 10]
The model is benchmarks/strategies.py's (3.7 M parameters) with its layers in a scan, and a
batch of 16 x 128 tokens. For each strategy: train-state bytes per device, collective bytes
sent per step (from the compiled step, loop trip counts included), XLA's temporary bytes and
the median step time, measured in the same process one strategy after the other and reported
as ratios to DP. Each row's bytes sit beside its formula, with P the parameters' bytes and N
the devices: DP's all-reduce 2(N-1)/N P; the compiler's FSDP in the all-reduce form the CPU
compiles (it has no reduce-scatter pass: chapter 6), gathers twice plus the all-reduce,
4(N-1)/N P; by hand, gathering again 3(N-1)/N P, keeping 2(N-1)/N P. On a CPU the emulated
devices share its cores: times show overheads, not interconnects.
"""

from __future__ import annotations

import argparse
import statistics

import jax

from nnxscale import Trainer, adamw, create, fsdp
from nnxscale.analysis.hlo import collectives
from nnxscale.core.memory import CompiledMemory
from nnxscale.placement.catalogue import DP, FSDP
from nnxscale.placement.rules import strategy_mesh
from nnxscale.runtime.devices import emulate_devices
from nnxscale.train.data import Batches, arithmetic_text, encode

from strategies import BATCH, LENGTH
from strategies import MODEL as UNSCANNED

MODEL = UNSCANNED.replace(scan_layers=True)  # the strategies benchmark's model, layers in a scan


def main() -> None:
    """Measure DP, the compiler's FSDP and hand-written FSDP (two modes); print a table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    emulate_devices(args.devices, optimize=True)  # timed: XLA's own compiler options
    batches = Batches(encode(arithmetic_text(20_000)), BATCH, LENGTH)
    mesh = strategy_mesh(FSDP)
    ring = (args.devices - 1) / args.devices  # (N-1)/N
    formula = {"DP (compiler)": 2 * ring, "FSDP (compiler)": 4 * ring,
               "FSDP by hand, gather again": 3 * ring, "FSDP by hand, keep": 2 * ring}  # fmt: skip
    runs = {
        "DP (compiler)": (DP, {}),
        "FSDP (compiler)": (FSDP, {}),
        "FSDP by hand, gather again": (FSDP, {"grads_fn": fsdp.grads_fn(mesh)}),
        "FSDP by hand, keep": (
            FSDP, {"grads_fn": fsdp.grads_fn(mesh, fsdp.Options(regather=False))}
        ),
    }  # fmt: skip
    rows = []
    for name, (rules, options) in runs.items():
        trainer = Trainer.create(create(MODEL), adamw(), rules, mesh, dropout=False, **options)
        compiled = trainer.compile(trainer.batch(batches))
        trainer.train(batches, 2)  # warm-up
        times = trainer.time_steps(batches, args.steps, first=100)
        report = collectives(compiled)
        params = sum(x.size for x in jax.tree.leaves(trainer.state["model"]))
        rows.append(
            [name, trainer.layout.bytes_per_device() / 2**20, report.count(),
             report.bytes() / 2**20, formula[name] * 4 * params / 2**20,
             report.bytes("all-to-all") / 2**20, CompiledMemory.of(compiled).temp / 2**20,
             statistics.median(times) * 1e3]
        )  # fmt: skip
    dp_ms = rows[0][-1]
    print(f"{params / 1e6:.1f} M parameters, batch {BATCH}x{LENGTH}, {args.devices} devices, "
          f"median of {args.steps} steps")  # fmt: skip
    header = ["strategy", "state MiB/dev", "collectives", "comm MiB/step", "formula MiB",
              "all-to-all MiB", "temp MiB", "step ms", "time / DP"]  # fmt: skip
    print(f"{header[0]:28}" + "".join(f"{h:>15}" for h in header[1:]))
    for name, state, count, comm, predicted, to_all, temp, ms in rows:
        print(f"{name:28}{state:15.2f}{count:15d}{comm:15.2f}{predicted:15.2f}{to_all:15.2f}"
              f"{temp:15.1f}{ms:15.1f}{ms / dp_ms:15.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
