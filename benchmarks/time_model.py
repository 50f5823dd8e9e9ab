"""The time model against measured step times, on this machine.

Run from the repository root: python benchmarks/time_model.py [--steps 10]
It measures the fastest device's matrix-product FLOP/s and memory bandwidth
(`nnxscale.machine`), predicts one training step of the book's Transformer at several sizes
on that device with the cost model (`nnxscale.costs.step_cost`, efficiency 1: the measured
FLOP/s already is what a large product reaches), measures the same steps, and prints
predicted / measured per size. The last line states the worst ratio and whether it lies in
`TIME_BAND`. The same script runs unchanged on whatever JAX finds: with
NNXSCALE_DEVICES=native on a GPU or TPU it times larger models there, in bfloat16, and also
prints each step's predicted time at the device's datasheet peak and stated efficiency.
"""

from __future__ import annotations

import argparse
import os

CPU_SIZES = {
    "small": dict(vocab=1024, embed=256, heads=4, head_dim=64, mlp=1024, layers=4),
    "medium": dict(vocab=2048, embed=512, heads=8, head_dim=64, mlp=2048, layers=4),
    "large": dict(vocab=4096, embed=768, heads=12, head_dim=64, mlp=3072, layers=6),
    "long": dict(vocab=2048, embed=512, heads=8, head_dim=64, mlp=2048, layers=4, max_len=512),
}
"""Models of the book's architecture, by size; the last one with four times longer sequences."""


BATCH, LENGTH = 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("NNXSCALE_DEVICES", "1")
    from nnxscale.runtime.devices import emulate_devices

    emulate_devices(optimize=True)  # timed: XLA's own compiler options
    import optax

    from nnxscale import Config, Trainer, costs, create, machine
    from nnxscale.evidence import gpu
    from nnxscale.placement.catalogue import DP
    from nnxscale.placement.mesh import make_mesh
    from nnxscale.profiling.profiles import fastest_device
    from nnxscale.train.data import Batches, arithmetic_text, encode

    device = fastest_device()
    cpu = device.platform == "cpu"
    dtype = "float32" if cpu else "bfloat16"
    hw = machine.measure(dtype, device=device)
    print(f"{hw.name}: {hw.flops / 1e9:,.1f} GFLOP/s ({dtype} products), "
          f"{hw.hbm / 1e9:,.1f} GB/s memory bandwidth")  # fmt: skip
    corpus = encode(arithmetic_text(50_000))
    columns = ("model", "parameters", "tokens per step", "predicted (ms)", "measured (ms)",
               "predicted / measured")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---|--:|--:|--:|--:|--:|")
    ratios = []
    one = make_mesh(DP.mesh_shape(1), DP.axes, devices=[device])
    models = {
        name: (Config(**{"max_len": LENGTH, **sizes}, dropout=0.0, compute_dtype=dtype), BATCH)
        for name, sizes in CPU_SIZES.items()
    }
    if not cpu:  # products, not launches, must take the time: gpu.MEASURED's models
        models = {name: (cfg, batch) for name, (cfg, batch, _) in gpu.MEASURED.items()}
    for name, (cfg, batch) in models.items():
        length = cfg.max_len
        setup = costs.Setup.of(DP, {"data": 1})
        predicted = costs.step_cost(cfg, setup, hw, batch, length, efficiency=1.0).step_time
        trainer = Trainer.create(create(cfg), optax.adamw(1e-3), DP, one, dropout=False)
        batches = Batches(corpus, batch, length)
        trainer.train(batches, 2)  # compile and warm up
        measured = sorted(trainer.time_steps(batches, args.steps, first=100))[args.steps // 2]
        ratios.append(predicted / measured)
        params = costs.counts(cfg).total
        print(f"| {name} | {params:,} | {batch * length:,} | {1e3 * predicted:,.1f} | "
              f"{1e3 * measured:,.1f} | {predicted / measured:.2f} |")  # fmt: skip
        kind = next((k for k in costs.HARDWARE if k in device.device_kind), None)
        if kind is not None:
            sheet = costs.step_cost(cfg, setup, kind, batch, length).step_time
            print(f"  at the {kind} datasheet and its stated efficiency: {1e3 * sheet:,.1f} ms, "
                  f"{sheet / measured:.2f} of measured")  # fmt: skip
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    low, high = costs.TIME_BAND
    verdict = "within" if low <= worst <= high else "OUTSIDE"
    print(f"worst predicted / measured: {worst:.2f}, {verdict} the stated band {low} to {high}")


if __name__ == "__main__":
    main()
