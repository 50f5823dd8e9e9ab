"""Memory, communication and step time of every strategy on 1, 2, 4 and 8 emulated devices.

Run from the repository root: python benchmarks/strategies.py [--devices 1 2 4 8] [--steps 10]
Each device count runs in its own process (the count is fixed when JAX starts). The model is
larger than the chapters' (about 3.7 M parameters). On a CPU the emulated devices share its
cores, so step times show overheads, not speed-ups; bytes are what the strategies change.
Each step time is also given as a ratio to DP's with the same device count, in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from nnxscale import Config, create, launch

MODEL = Config(vocab=1024, embed=256, heads=8, head_dim=32, mlp=1024, layers=4, max_len=128)
BATCH, LENGTH = 16, 128


def worker(steps: int) -> None:
    """Measure every strategy on this process's devices; print one JSON line per strategy."""
    from nnxscale.runtime.devices import emulate_devices

    emulate_devices(optimize=True)  # timed: XLA's own compiler options
    import jax
    import optax

    from nnxscale import Trainer
    from nnxscale.analysis.hlo import collectives
    from nnxscale.core.memory import CompiledMemory
    from nnxscale.placement.catalogue import RULE_SETS
    from nnxscale.placement.rules import strategy_mesh
    from nnxscale.train.data import Batches, arithmetic_text, encode

    n = jax.device_count()
    batches = Batches(encode(arithmetic_text(20_000)), BATCH, LENGTH)
    for name, rules in RULE_SETS.items():
        if n == 1 and "model" in rules.mesh_axes():
            continue  # TP needs 2 devices on `model`
        mesh = strategy_mesh(rules)
        trainer = Trainer.create(create(MODEL), optax.adamw(1e-3), rules, mesh)
        start = time.perf_counter()
        compiled = trainer.compile(trainer.batch(batches))
        compile_s = time.perf_counter() - start
        trainer.train(batches, 2)  # warm-up
        times = trainer.time_steps(batches, steps, first=100)
        memory = CompiledMemory.of(compiled)
        report = collectives(compiled)
        print(json.dumps({
            "devices": n, "strategy": name, "mesh": str(dict(mesh.shape)),
            "state_bytes": trainer.layout.bytes_per_device(),
            "total_state_bytes": trainer.layout.total_bytes(), "temp_bytes": memory.temp,
            "comm_bytes": report.bytes(), "collectives": report.count(),
            "step_ms": 1000 * statistics.median(times), "compile_s": compile_s,
        }), flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per strategy")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.steps)
        return
    rows = []
    for n in args.devices:
        command = [sys.executable, __file__, "--worker", "--steps", str(args.steps)]
        out = launch.run(command, n, timeout=3600)
        rows += [json.loads(line) for line in out.output if line.startswith("{")]
    params = rows[0]["total_state_bytes"]
    print(f"model: {MODEL}\nbatch {BATCH} x {LENGTH} tokens; train state {params / 2**20:.1f} MiB")
    print(f"cores: {os.cpu_count()}; median of {args.steps} steps\n")
    header = (
        f"{'N':>2} {'strategy':8} {'mesh':26} {'state MiB/dev':>13} {'share':>6} "
        f"{'temp MiB':>9} {'comm MiB/step':>13} {'collectives':>11} {'step ms':>8} "
        f"{'time / DP':>9} {'compile s':>9}"
    )
    dp_ms = {r["devices"]: r["step_ms"] for r in rows if r["strategy"] == "DP"}
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['devices']:>2} {r['strategy']:8} {r['mesh']:26} {r['state_bytes'] / 2**20:13.2f} "
            f"{r['state_bytes'] / r['total_state_bytes']:6.3f} {r['temp_bytes'] / 2**20:9.1f} "
            f"{r['comm_bytes'] / 2**20:13.2f} {r['collectives']:11} {r['step_ms']:8.1f} "
            f"{r['step_ms'] / dp_ms[r['devices']]:9.2f} {r['compile_s']:9.1f}"
        )


if __name__ == "__main__":
    main()
