"""This machine, measured: the numbers the time model needs, for whatever device JAX finds.

`measure()` times a large matrix product and a large elementwise pass on the first device
and returns them as a `nnxscale.costs.Hardware`, so that the cost model predicts this
machine's step times with the same functions it uses for datasheet accelerators.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from nnxscale.costs.hardware import Hardware


def optimized(fn: Callable[..., jax.Array], *args: jax.Array) -> Callable[[], jax.Array]:
    """`fn` on `args` compiled with XLA's own optimisations (`nnxscale.devices.OPTIMIZED`),
    whatever the process's defaults: emulated devices compile without them, and a measured
    peak must be the backend's best."""
    from nnxscale.runtime.devices import OPTIMIZED

    compiled = jax.jit(fn).lower(*args).compile(compiler_options=OPTIMIZED)
    return lambda: compiled(*args)


def cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says, else all)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else os.cpu_count() or 1


def cpu_seconds() -> float:
    """This process's CPU seconds, all its threads together, over its `cores()`: a clock for
    work on emulated CPU devices that other programs on the machine do not slow (they take
    the cores away for a while, which wall time counts and CPU time does not). When the
    process has the machine to itself and keeps every core busy, it runs at wall speed."""
    return time.process_time() / cores()


def _seconds(fn: Callable[[], jax.Array], clock: Callable[[], float]) -> float:
    """Seconds on `clock` of one call of `fn`, its result ready."""
    start = clock()
    jax.block_until_ready(fn())
    return clock() - start


@dataclasses.dataclass
class Probe:
    """Yardsticks of a device, or of several at once, compiled once: on each, a `size` x
    `size` matrix product in `dtype` and an elementwise pass over a float32 array of
    `megabytes` (by default 2,048 and 64 MB on a CPU, 8,192 and 2 GB on an accelerator, the
    work split between several devices, at least 32 MB on each: far beyond the caches, and a
    product about as long as a small training step, so that both see the same share of a
    busy machine). On
    several devices they all run at once and the probe measures what they reach together:
    emulated CPU devices share one machine's cores
    and memory. Each `sample()` times both once more and keeps the fastest so far: a peak is
    what the devices can do, and a run that shared the cores with other work (another
    program) is only ever slower. Timed on `clock`: wall seconds by default; `cpu_seconds`
    on CPU devices, for a peak that other programs do not lower."""

    device: jax.Device | Sequence[jax.Device]
    dtype: str = "float32"
    size: int = 0
    megabytes: int = 0
    flops: float = 0.0
    hbm: float = 0.0
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        devices = [self.device] if isinstance(self.device, jax.Device) else list(self.device)
        self.platform = devices[0].platform
        check_clock(self.clock, self.platform)
        cpu = self.platform == "cpu"  # an accelerator needs far larger work to fill
        n = len(devices)  # by default the same work in all, split between the devices
        self.size = self.size or 64 * round((2048 if cpu else 8192) / n ** (1 / 3) / 64)
        self.megabytes = self.megabytes or max(32, (64 if cpu else 2048) // n)  # > caches
        split = NamedSharding(Mesh(np.array(devices), ("d",)), PartitionSpec("d"))
        elements = self.megabytes * 2**20 // 4
        a = jax.device_put(jnp.ones((n, self.size, self.size), self.dtype), split)
        x = jax.device_put(jnp.ones((n * elements,), jnp.float32), split)
        self._product = optimized(jnp.matmul, a, a)  # one product on each device
        self._stream = optimized(lambda v: v * 1.5 + 0.5, x)
        self._flops = n * 2 * self.size**3
        self._moved = 2 * x.nbytes  # read once, written once
        self._kind = f"{devices[0].platform}: {devices[0].device_kind}" + (
            f", {n} at once" if n > 1 else ""
        )
        jax.block_until_ready((self._product(), self._stream()))  # warm up

    def sample(self) -> None:
        """Time the product and the pass once each; keep the best FLOP/s and bytes/s seen."""
        self.flops = max(self.flops, self._flops / _seconds(self._product, self.clock))
        self.hbm = max(self.hbm, self._moved / _seconds(self._stream, self.clock))

    def hardware(self, memory: float = 0.0) -> Hardware:
        """The devices as the time model sees one device (its links: copies through its
        memory); `memory` bytes if given (the cost model's fit checks need it, the time model
        does not)."""
        name = f"this machine ({self._kind})"
        return Hardware(
            name,
            self.flops,
            memory,
            self.hbm,
            self.hbm,
            self.hbm,
            1,
            False,
            0.0,
            0.0,
            "measured",
            1.0,
            "measured: the FLOP/s of a large product",
        )


def check_clock(clock: Callable[[], float], platform: str) -> None:
    """Refuse CPU time for an accelerator's work, which the host only waits for."""
    if clock is cpu_seconds and platform != "cpu":
        raise ValueError(
            f"cpu_seconds times work on CPU devices, and these are {platform} devices, whose "
            "work this process's CPU only waits for: time them on the wall clock (the default)"
        )


def measure(
    dtype: str = "float32",
    memory: float = 0.0,
    device: jax.Device | None = None,
    repeats: int = 5,
) -> Hardware:
    """This machine's `device` (default: the first) as the time model sees it: its matmul
    FLOP/s in `dtype` and its memory bandwidth, the fastest of `repeats` samples (`Probe`)."""
    probe = Probe(device or jax.devices()[0], dtype)
    for _ in range(repeats):
        probe.sample()
    return probe.hardware(memory)


def alongside(timed: Callable[[], float], probe: Probe, repeats: int = 3) -> tuple[float, Hardware]:
    """The fastest of `repeats` calls of `timed` (each returns the seconds it measured), and
    the device `probe` measures between them. A time and a peak measured minutes apart on a
    machine that other work shares at times can disagree by a factor of two; measured in
    turn, the fastest of each saw the same machine. The probe starts afresh and keeps the
    best of these samples."""
    probe.flops = probe.hbm = 0.0
    best = float("inf")
    for _ in range(repeats):
        best = min(best, timed())
        probe.sample()
    return best, probe.hardware()


def emulated(hw: Hardware, devices: int) -> Hardware:
    """One of `devices` emulated devices that share the machine `hw` describes (measured
    with all of them at once: `Probe(jax.devices())`): each gets a `devices`-th of its
    FLOP/s and memory bandwidth, and its collectives are copies through that memory (no
    link is faster), so the time model can predict emulated steps."""
    share = hw.hbm / devices
    return dataclasses.replace(
        hw,
        name=f"{hw.name}, 1/{devices} of it",
        flops=hw.flops / devices,
        hbm=share,
        fast=share,
        slow=share,
        domain=devices,
    )


def time_step(
    trainer: Any, batches: Callable[..., Any], probe: Probe, repeats: int = 3
) -> tuple[float, Hardware]:
    """The fastest of `repeats` steps of `trainer` (a `nnxscale.Trainer`, compiled) on
    `batches`, and the devices `probe` measures between them (`alongside`), both on the
    probe's clock. On emulated CPU devices give it `clock=cpu_seconds`: on a machine that
    other programs share, the step and the probe measured in turn on the wall clock can
    still see different loads and disagree by a factor of two; CPU time counts the work,
    whoever else runs."""
    platform = trainer.layout.mesh.devices.flat[0].platform
    if platform != probe.platform:
        raise ValueError(
            f"the trainer runs on {platform} devices and the probe measures {probe.platform} "
            "devices: probe the devices the step runs on"
        )

    def timed() -> float:
        return trainer.time_steps(batches, 1, first=10, clock=probe.clock)[0]

    return alongside(timed, probe, repeats)
