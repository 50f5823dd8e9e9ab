"""Where the time goes, on whatever JAX finds: roofline, MFU, and predicted against measured.

Run from the repository root: NNXSCALE_DEVICES=native python benchmarks/profile.py
It profiles one training step of the book's Transformer at several sizes on the fastest
device (an accelerator if there is one: `nnxscale.profiles.fastest_device`), with the
device's peak FLOP/s and bandwidth measured between the steps (`nnxscale.machine.Probe`),
and prints per size: the step's time, its MFU, how many ops are compute- or memory-bound
and the share of time they take, and the time model's prediction against the measured
step at the efficiency that reproduces the first size's step (`costs.fitted_efficiency`).
Then the same comparison per strategy on the devices of a mesh (emulated CPU devices
when there is a single accelerator or none), at the efficiency that reproduces the step
on one of them. On a CPU it computes in float32, elsewhere in
bfloat16.
"""

from __future__ import annotations

import argparse
import os

CPU_SIZES = {
    "small": dict(vocab=1024, embed=256, heads=4, head_dim=64, mlp=1024, layers=4),
    "medium": dict(vocab=2048, embed=512, heads=8, head_dim=64, mlp=2048, layers=4),
}
ACCELERATOR_SIZES = {
    "medium": dict(vocab=2048, embed=512, heads=8, head_dim=64, mlp=2048, layers=4),
    "1B-wide": dict(vocab=32000, embed=2048, heads=16, head_dim=128, mlp=8192, layers=4),
}
"""Models of the book's architecture, by size: an accelerator needs larger products."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("NNXSCALE_DEVICES", "native")
    from nnxscale.runtime.devices import emulate_devices

    emulate_devices(optimize=True)  # timed: XLA's own compiler options
    import jax

    import nnxscale as nx
    from nnxscale import costs, machine, profiles
    from nnxscale.runtime.devices import OPTIMIZED

    device = profiles.fastest_device()
    cpu = device.platform == "cpu"
    dtype = "float32" if cpu else "bfloat16"
    length, batch = (128, 8) if cpu else (1024, 16)
    probe = machine.Probe(device, dtype)
    probe.sample()
    print(f"# {jax.devices()[0].platform} x {jax.device_count()} by default; profiled on "
          f"{device} ({device.device_kind}), {dtype}\n")  # fmt: skip
    options = {**OPTIMIZED, **profiles.OP_TRACING}
    columns = ("model", "tokens", "step (ms)", "MFU", "HFU", "compute-bound ops (time)",
               "memory-bound ops (time)", "TFLOP/s", "GB/s", "products' share of peak",
               "predicted / measured")  # fmt: skip
    print("| " + " | ".join(columns) + " |")
    print("|---" * len(columns) + "|")
    one = nx.make_mesh(nx.DP.mesh_shape(1), nx.DP.axes, devices=[device])
    fitted = 0.0  # the efficiency that reproduces the first size's step
    for name, sizes in (CPU_SIZES if cpu else ACCELERATOR_SIZES).items():
        cfg = nx.Config(**sizes, max_len=length, dropout=0.0, compute_dtype=dtype)
        trainer = nx.Trainer.create(
            lambda cfg=cfg: nx.create(cfg), nx.adamw(), nx.DP, one, dropout=False,
            compiler_options=options,
        )  # fmt: skip
        batches = nx.book_batches(batch, length)
        trainer.train(batches, 1)
        found = profiles.profile(trainer, batches, probe, args.steps)
        hw, seconds = found.hw, found.seconds
        model = costs.model_flops(cfg, batch, length)
        placed = profiles.roofline(found.rows, hw)
        busy = sum(r.seconds for r in found.rows) or 1.0
        names = {b: {p.name for p in placed if p.bound == b} for b in ("compute", "memory")}
        time_of = {b: sum(r.seconds for r in found.rows if r.name in names[b]) for b in names}
        count = {b: sum(p.bound == b for p in placed) for b in ("compute", "memory")}
        setup = costs.Setup.of(nx.DP, {"data": 1})
        share = profiles.reached(placed) / hw.flops  # the products' share of peak
        fitted = fitted or costs.fitted_efficiency(seconds, cfg, setup, hw, batch, length)
        predicted = costs.step_cost(cfg, setup, hw, batch, length, efficiency=fitted).step_time
        print(f"| {name} | {batch * length:,} | {1e3 * seconds:,.2f} | "
              f"{profiles.mfu(model, seconds, hw):.1%} | "
              f"{profiles.mfu(nx.hlo.dot_flops(trainer.compiled), seconds, hw):.1%} | "
              f"{count['compute']} ({time_of['compute'] / busy:.0%}) | "
              f"{count['memory']} ({time_of['memory'] / busy:.0%}) | "
              f"{hw.flops / 1e12:,.1f} | {hw.hbm / 1e9:,.0f} | {share:.0%} | "
              f"{predicted / seconds:.2f} |")  # fmt: skip
    for name in ("H100", "TPU v5p"):
        print(
            f"\n{name}: ridge {profiles.ridge(costs.hardware(name)):.0f} FLOPs/byte (datasheet)",
            end="",
        )
    print(f"; this device: ridge {profiles.ridge(probe.hardware()):.0f} FLOPs/byte (measured)\n")

    n = jax.device_count()
    many = jax.devices()
    if many[0].platform != "cpu":
        print("Strategies are compared on emulated CPU devices: run with NNXSCALE_DEVICES=8.")
        return
    many_probe = machine.Probe(many, clock=machine.cpu_seconds)  # all at once, CPU time
    cfg = nx.Config(**CPU_SIZES["small"], max_len=64, dropout=0.0)
    rows = n * max(1, 16 // n)
    first = nx.make_mesh((1, 1), nx.DP.axes, devices=many[:1])
    alone = nx.Trainer.create(
        lambda: nx.create(cfg), nx.adamw(), nx.DP, first, dropout=False,
        compiler_options=OPTIMIZED,
    )  # fmt: skip
    batches = nx.book_batches(rows, cfg.max_len)
    alone.train(batches, 1)
    one_probe = machine.Probe(many[0], clock=machine.cpu_seconds)
    seconds, hw = machine.time_step(alone, batches, one_probe, args.steps)
    setup = costs.Setup.of(nx.DP, {"data": 1})
    efficiency = costs.fitted_efficiency(seconds, cfg, setup, hw, rows, cfg.max_len)
    print(f"At {efficiency:.0%} of peak: the efficiency that reproduces the step on one device.\n")
    where = f"strategy on {n} {many[0].platform} device(s)"
    print(f"| {where} | predicted (ms) | measured (ms) | predicted / measured |")
    print("|---|--:|--:|--:|")
    low, high = costs.TIME_BAND
    ratios = []
    for rules in (nx.DP, nx.FSDP, nx.FSDP_TP):
        trainer = nx.Trainer.create(
            lambda: nx.create(cfg), nx.adamw(), rules, nx.strategy_mesh(rules), dropout=False,
            compiler_options=OPTIMIZED,
        )  # fmt: skip
        batches = nx.book_batches(rows, cfg.max_len)
        trainer.train(batches, 1)
        measured, here = machine.time_step(trainer, batches, many_probe, args.steps)
        each = machine.emulated(here, n)
        setup = costs.Setup.of(rules, dict(trainer.layout.mesh.shape))
        cost = costs.step_cost(cfg, setup, each, rows, cfg.max_len, efficiency=efficiency)
        ratios.append(cost.step_time / measured)
        print(f"| {rules.name} | {1e3 * cost.step_time:,.1f} | {1e3 * measured:,.1f} | "
              f"{ratios[-1]:.2f} |")  # fmt: skip
    worst = max(ratios, key=lambda r: max(r, 1 / r))
    verdict = "within" if low <= worst <= high else "OUTSIDE"
    print(f"\nworst predicted / measured: {worst:.2f}, {verdict} the stated band {low} to {high}")


if __name__ == "__main__":
    main()
