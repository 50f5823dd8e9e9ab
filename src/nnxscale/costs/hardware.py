"""Accelerators as their datasheets give them: peak FLOP/s, memory, bandwidth, the links
between them; and the share of peak a step reaches."""

from __future__ import annotations

import dataclasses

EFFICIENCY = 0.5
"""The fraction of peak matmul FLOP/s a step's products reach: an assumed model FLOPs
utilisation (MFU) for accelerators; `benchmarks/time_model.py` measures this machine's."""


MARGIN = 0.1
"""The share of a device's memory the planner leaves free: the runtime, the allocator's
fragmentation and buffers the compiler adds beyond the ledger."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, its memory and its links, as the time model sees them.

    `flops` is peak dense bfloat16 FLOP/s, `hbm` the bytes per second its memory delivers.
    `fast` is the bytes per second one device sends around a ring inside its fast domain of
    `domain` devices (TPU ICI along one axis, GPU NVLink within a host), `slow` to devices in
    other domains (data-centre network, InfiniBand); `ring` says whether the fast links form
    a ring or torus (TPU ICI, where an all-to-all travels part-way around it) rather than a
    switch (NVLink). `hop` and `far_hop` are the seconds each step of a collective costs
    before any byte moves, on each kind of link. `source` is a key of the bibliography.
    """

    name: str
    flops: float
    memory: float
    hbm: float
    fast: float
    slow: float
    domain: int
    ring: bool
    hop: float
    far_hop: float
    source: str


_DATASHEETS = (
    # name, bf16 FLOP/s, memory, HBM B/s, fast B/s, slow B/s, fast domain, ring, hop s, far hop s
    ("TPU v5e", 1.97e14, 16e9, 8.1e11, 9.0e10, 3.125e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v5p", 4.59e14, 96e9, 2.8e12, 1.8e11, 6.25e9, 8960, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v6e", 9.2e14, 32e9, 1.6e12, 1.8e11, 12.5e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
    ("H100", 9.89e14, 80e9, 3.35e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2023h100"),
    ("H200", 9.89e14, 141e9, 4.8e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024h200"),
    ("B200", 2.25e15, 180e9, 8.0e12, 9.0e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024dgxb200"),
)


HARDWARE = {row[0]: Hardware(*row) for row in _DATASHEETS}
"""Datasheet numbers per device (links: TPU ICI bidirectional bandwidth of one axis and DCN
per chip; GPU NVLink one way per GPU and one 400 Gb/s network adapter per GPU). The hop
latencies are assumed orders of magnitude: about 1 µs per ICI hop (the scaling book), a few
µs per NVLink step, ten per step across the network."""


def hardware(name: str | Hardware) -> Hardware:
    """The hardware of that name (`HARDWARE`), or the description itself."""
    if isinstance(name, Hardware):
        return name
    if name not in HARDWARE:
        raise ValueError(
            f"no hardware named {name!r}: use one of {', '.join(HARDWARE)}, or describe yours "
            "with nnxscale.costs.Hardware(...)"
        )
    return HARDWARE[name]
