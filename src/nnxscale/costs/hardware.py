"""Accelerators as their datasheets give them: peak FLOP/s, memory, bandwidth, the links
between them; and the share of peak a step reaches."""

from __future__ import annotations

import dataclasses
import math

EFFICIENCY = 0.5
"""The fraction of peak matmul FLOP/s a step's products, recompute included, reach on
hardware described without one (`Hardware.efficiency`): assumed."""


MARGIN = 0.1
"""The share of a device's memory the planner leaves free: the runtime, the allocator's
fragmentation and buffers the compiler adds beyond the ledger."""


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator, its memory and its links, as the time model sees them.

    `flops` is peak dense bfloat16 FLOP/s, `hbm` the bytes per second its memory delivers,
    `memory` the datasheet's capacity in units of 10^9 bytes (the cards count it in GiB, a
    little more, so a fit check errs on the safe side).
    `fast` is the bytes per second one device sends around a ring inside its fast domain of
    `domain` devices (TPU ICI along one axis, GPU NVLink within a host), `slow` to devices in
    other domains (data-centre network, InfiniBand); `ring` says whether the fast links form
    a ring or torus (TPU ICI, where an all-to-all travels part-way around it) rather than a
    switch (NVLink). Links are priced at these datasheet rates, while compute is derated by
    `efficiency`: a collective that reaches less of its link than the products reach of
    theirs is priced optimistically. `hop` and `far_hop` are the seconds each step of a
    collective costs before any byte moves, on each kind of link. `source` is a key of the
    bibliography.
    `efficiency` is the fraction of peak FLOP/s the step's products (recompute included)
    reach on it (a hardware FLOPs utilisation, HFU): fitted to a published run where the
    cost model expresses one (`nnxscale.costs.runs`; the fit also absorbs what the model
    leaves out of that run, so it can exceed the run's own MFU), else the HFU a large run
    published, a lower bound (the HFU counts the whole step's time, which the model prices
    apart); `efficiency_source` says which. `wrap` is, on a TPU torus, the shortest
    axis whose ends are joined (wraparound): a shorter one, or one it does not divide, is a
    line, and a ring collective along it gets half the bandwidth (0: every axis is a ring).
    `usable` is the share of `memory` the runtime gives arrays by default (`RUNTIME_SHARE`).
    `dimensions` is, on a torus, how many it has (`TORUS`): at most that many mesh axes can
    each lie along torus dimensions of their own, with links no other axis uses (0: any
    number).
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
    efficiency: float = EFFICIENCY
    efficiency_source: str = "assumed"
    wrap: int = 0
    usable: float = 1.0
    dimensions: int = 0

    def replace(self, **changes: object) -> Hardware:
        """This hardware with some numbers changed (checked as a new description is)."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        """Refuse a description the time model would turn into nonsense: every rate a
        positive finite number, memory and latencies finite and not negative (memory 0: not
        known, so a fit check needs it given), an efficiency and a usable share in (0, 1], a
        torus's dimensions a whole number."""
        rates = ("flops", "hbm", "fast", "slow", "domain")
        bad = [f"{k}={getattr(self, k)!r}" for k in rates if not 0 < getattr(self, k) < math.inf]
        bad += [
            f"{k}={getattr(self, k)!r}"
            for k in ("memory", "hop", "far_hop")
            if not 0 <= getattr(self, k) < math.inf
        ]
        bad += [
            f"{k}={getattr(self, k)!r}"
            for k in ("efficiency", "usable")
            if not 0 < getattr(self, k) <= 1
        ]
        if not (isinstance(self.dimensions, int) and self.dimensions >= 0):
            bad.append(f"dimensions={self.dimensions!r}")
        if bad:
            raise ValueError(
                f"hardware {self.name!r} has {', '.join(bad)}: rates, sizes and latencies must "
                "be positive finite numbers (bytes, bytes per second, FLOP/s, seconds), and the "
                "efficiency and the usable share fractions in (0, 1], such as 0.4, and a torus's "
                "dimensions a whole number (0: any number)"
            )


_DATASHEETS = (
    # name, bf16 FLOP/s, memory, HBM B/s, fast B/s, slow B/s, fast domain, ring, hop s, far hop s
    ("A100", 3.12e14, 80e9, 2.039e12, 3.0e11, 2.5e10, 8, False, 3e-6, 1e-5, "nvidia2020a100"),
    ("H100", 9.89e14, 80e9, 3.35e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2023h100"),
    ("H200", 9.89e14, 141e9, 4.8e12, 4.5e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024h200"),
    ("B200", 2.25e15, 180e9, 8.0e12, 9.0e11, 5.0e10, 8, False, 3e-6, 1e-5, "nvidia2024dgxb200"),
    ("TPU v4", 2.75e14, 32e9, 1.2e12, 9.0e10, 6.25e9, 4096, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v5e", 1.97e14, 16e9, 8.1e11, 9.0e10, 3.125e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v5p", 4.59e14, 96e9, 2.8e12, 1.8e11, 6.25e9, 6144, True, 1e-6, 1e-5, "austin2025scaling"),
    ("TPU v6e", 9.2e14, 32e9, 1.6e12, 1.8e11, 12.5e9, 256, True, 1e-6, 1e-5, "austin2025scaling"),
)

EFFICIENCIES = {
    "A100": (0.62, "calibrated: Megatron-LM's 1T model on 3,072 A100s (recompute counted)"),
    "H100": (0.80, "calibrated: Llama 3 405B on 8,192 H100s (full remat assumed)"),
    "H200": (0.45, "calibrated: benchmarks/time_model.py's 1B-wide model on one H200"),
    "B200": (0.80, "assumed: the H100's (no published utilisation of a large run found)"),
    "TPU v4": (0.578, "published HFU: chowdhery2022palm, PaLM 540B on 6,144 TPU v4 (MFU 0.462)"),
    "TPU v5e": (0.77, "calibrated: MaxText 16B on one v5e-256"),
    "TPU v5p": (0.83, "calibrated: MaxText 32B on one v5p-128"),
    "TPU v6e": (0.50, "calibrated: MaxText's Llama 3.1 70B on one v6e-256"),
}
"""Per device, the efficiency the time model computes at and where it comes from: calibrated
on a run of `nnxscale.costs.runs`, or a published HFU (recompute counted, a lower bound)
where the model cannot express a run."""

GPU_PREALLOCATION = 0.75
"""The share of a GPU's memory JAX preallocates for arrays by default; the environment
variable XLA_CLIENT_MEM_FRACTION changes it (in jaxlib 0.12; XLA_PYTHON_CLIENT_MEM_FRACTION is
its deprecated name), and NVIDIA's guide suggests 0.8 to 0.9."""

RUNTIME_SHARE = {
    "A100": GPU_PREALLOCATION,
    "H100": GPU_PREALLOCATION,
    "H200": GPU_PREALLOCATION,
    "B200": GPU_PREALLOCATION,
}
"""Per device, the share of its memory the runtime gives arrays by default: on GPUs what JAX
preallocates, on TPUs all of it."""

WRAPAROUND = {"TPU v4": 4, "TPU v5e": 16, "TPU v5p": 4, "TPU v6e": 16}
"""Per TPU, the shortest axis whose ends its ICI joins: a v4 or v5p cube's side, the whole
side of a v5e or v6e pod (the scaling book)."""

TORUS = {"TPU v4": 3, "TPU v5e": 2, "TPU v5p": 3, "TPU v6e": 2}
"""Per TPU, the dimensions of its ICI torus: 3D on v4 and v5p, 2D on v5e and v6e (the
scaling book)."""


HARDWARE = {
    row[0]: Hardware(
        *row,
        *EFFICIENCIES[row[0]],
        WRAPAROUND.get(row[0], 0),
        RUNTIME_SHARE.get(row[0], 1.0),
        TORUS.get(row[0], 0),
    )
    for row in _DATASHEETS
}
"""Datasheet numbers per device (links: TPU ICI bidirectional bandwidth of one axis and DCN
per chip; GPU NVLink one way per GPU, and one network adapter per GPU on its own rail:
200 Gb/s on an A100 host, 400 Gb/s on the others). A fast domain is a host of eight GPUs,
or the largest TPU slice (a v5p pod has 8,960 chips, its largest slice 6,144; beyond a
slice, jobs cross the data-centre network, as multislice runs do). The hop latencies are
assumed orders of magnitude: about 1 µs per ICI hop (the scaling book), a few µs per NVLink
step, ten per step across the network."""


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
