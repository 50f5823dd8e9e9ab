"""This machine, measured: the numbers the time model needs, for whatever device JAX finds.

`measure()` times a large matrix product and a large elementwise pass on the first device
and returns them as a `nnxscale.costs.Hardware`, so that the cost model predicts this
machine's step times with the same functions it uses for datasheet accelerators.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from nnxscale.costs import Hardware


def _median_seconds(fn: Callable[[], jax.Array], repeats: int) -> float:
    """The median wall time of `fn()` over `repeats` calls after one warm-up, results ready."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_flops(size: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
    """FLOP/s of one `size` x `size` matrix product in `dtype` on the first device."""
    device = jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    b = jax.device_put(jnp.ones((size, size), dtype), device)
    product = jax.jit(jnp.matmul)
    return 2 * size**3 / _median_seconds(lambda: product(a, b), repeats)


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes per second an elementwise pass over a float32 array of `megabytes` reads and
    writes on the first device."""
    device = jax.devices()[0]
    x = jax.device_put(jnp.ones((megabytes * 2**20 // 4,), jnp.float32), device)
    scale = jax.jit(lambda v: v * 1.5 + 0.5)
    return 2 * x.nbytes / _median_seconds(lambda: scale(x), repeats)


def measure(dtype: str = "float32", memory: float = 0.0) -> Hardware:
    """This machine's first device as the time model sees it: measured matmul FLOP/s in
    `dtype` and memory bandwidth; `memory` bytes if given (the cost model's fit checks need
    it, the time model does not). One device: no links."""
    device = jax.devices()[0]
    name = f"this machine ({device.platform}: {device.device_kind})"
    flops, bandwidth = matmul_flops(dtype=dtype), memory_bandwidth()
    return Hardware(name, flops, memory, bandwidth, 0.0, 0.0, 1, False, 0.0, 0.0, "measured")
