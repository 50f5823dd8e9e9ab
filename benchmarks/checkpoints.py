"""Checkpoint sizes, and save and restore times, for the chapters' model and a 33.7 M one.

Run from the repository root: python benchmarks/checkpoints.py [--devices 8] [--repeats 3]
Each model trains 2 steps under FSDP (so AdamW's moments are not zeros, which compress to
nothing), then is saved `repeats` times, one step apart, and restored `repeats` times: onto
the same layout, under TP on a 2-D mesh, and in another process on half the devices. Times
are medians. Sizes are exact: the state's bytes, the compressed chunks, the step directory.

Every save computes each array's checksum (`nnxscale.integrity`) before it hands back to
training, and every restore verifies them: `checksums s` is that computation alone on the
same state (its program compiled by the save), and the overheads are its share of a save
(blocked + written) and of an FSDP restore, each without it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
from jax.sharding import Mesh

from nnxscale import TINY, Checkpoints, Config, Trainer, Transformer, adamw, cli, create
from nnxscale.checkpoint.integrity import checksums
from nnxscale.model import BENCH
from nnxscale.placement.catalogue import FSDP, TP
from nnxscale.placement.rules import Rules, strategy_mesh
from nnxscale.runtime.devices import emulate_devices
from nnxscale.train.data import book_batches


def median_seconds(action: Callable[[], object], repeats: int) -> float:
    """Median wall time of `action()` over `repeats` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(name: str, cfg: Config, repeats: int, workdir: Path) -> dict[str, object]:
    """Sizes and times of one model's checkpoints."""
    n = jax.device_count()
    batches = book_batches(batch_size=n, length=min(32, cfg.max_len))
    trainer = Trainer.create(create(cfg), adamw(), FSDP, strategy_mesh(FSDP))
    trainer.train(batches, 2)
    directory = workdir / name
    blocked, written = [], []
    with Checkpoints(directory, keep=1) as checkpoints:
        for _ in range(repeats):
            trainer.train(batches, 1)
            jax.block_until_ready(trainer.state)
            blocked.append(checkpoints.save(trainer, batches))
            written.append(checkpoints.wait())
        files = checkpoints.files()
        values = checkpoints.stored_values()

        def restore(rules: Rules, mesh: Mesh) -> Callable[[], object]:
            return lambda: jax.block_until_ready(
                checkpoints.restore(Transformer.from_config, adamw(), rules, mesh).state
            )

        same = median_seconds(restore(FSDP, strategy_mesh(FSDP)), repeats)
        tp = median_seconds(restore(TP, strategy_mesh(TP)), repeats)
    summing = median_seconds(lambda: checksums(trainer.state), repeats)
    saving = statistics.median(blocked) + statistics.median(written)
    report = workdir / f"{name}.json"
    start = time.perf_counter()
    cli.run("restore", str(directory), "--rules", "FSDP", "--report", str(report),
            devices=max(1, n // 2))  # fmt: skip
    other_wall = time.perf_counter() - start
    chunks = sum(size for key, size in values.items() if not key.endswith("/.zarray"))
    return {
        "model": name,
        "params": sum(x.size for x in jax.tree.leaves(trainer.state["model"])),
        "state MB": trainer.layout.total_bytes() / 1e6,
        "chunks MB": chunks / 1e6,
        "on disk MB": sum(size for _, size, _ in files) / 1e6,
        "files": len(files),
        "save blocks s": statistics.median(blocked),
        "then writes s": statistics.median(written),
        "checksums s": summing,
        "save overhead %": 100 * summing / (saving - summing),
        "restore FSDP s": same,
        "restore overhead %": 100 * summing / (same - summing),
        "restore TP 2-D s": tp,
        f"restore on {max(1, n // 2)} dev. s": json.loads(report.read_text())["seconds"],
        "(process wall s)": other_wall,
    }


def main() -> None:
    """Measure TINY and BENCH and print one table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    emulate_devices(args.devices, optimize=True)  # timed: XLA's own compiler options

    workdir = Path(tempfile.mkdtemp(prefix="nnxscale-bench-checkpoints-"))
    try:
        rows = [measure(name, cfg, args.repeats, workdir)
                for name, cfg in [("TINY", TINY), ("BENCH", BENCH)]]  # fmt: skip
    finally:
        shutil.rmtree(workdir)
    headers = list(rows[0])
    print(f"{args.devices} emulated devices, FSDP, medians of {args.repeats}")
    print(" ".join(f"{h:>{max(len(h), 9)}}" for h in headers))
    for row in rows:
        cells = [
            f"{v:,.3f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)
            for v in row.values()
        ]
        print(" ".join(f"{c:>{max(len(h), 9)}}" for c, h in zip(cells, headers, strict=True)))


if __name__ == "__main__":
    main()
