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
    cost model expresses one (`nnxscale.evidence.runs`; the fit also absorbs what the model
    leaves out of that run, so it can exceed the run's own MFU), else the HFU a large run
    published, a lower bound (the HFU counts the whole step's time, which the model prices
    apart); `efficiency_source` says which. `wrap` is, on a TPU torus, the shortest
    axis whose ends are joined (wraparound): a shorter one, or one it does not divide, is a
    line, and a ring collective along it gets half the bandwidth (0: every axis is a ring).
    `usable` is the share of `memory` the runtime gives arrays by default (`RUNTIME_SHARE`).
    `dimensions` is, on a torus, how many it has (`TORUS`): at most that many mesh axes can
    each lie along torus dimensions of their own, with links no other axis uses (0: any
    number).
    `launch` is the seconds the host needs to launch one layer's forward and backward pass
    for one micro-batch: a step computes no faster than its host launches its layers
    (`nnxscale.costs.launched`). `sync` is the seconds each collective on the critical path
    (tensor parallelism's, a pipeline's hand-overs) waits beyond its transfer: its launch
    and the wait for the group's last device. Both are fitted where `fit_source` says (0:
    not known, left out). `attention` is the fraction of peak FLOP/s the attention kernel
    reaches (flash attention's products run at it, the rest at `efficiency`), from the
    kernel's published measurement where `attention_source` says (0: `efficiency`).
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
    launch: float = 0.0
    sync: float = 0.0
    fit_source: str = ""
    attention: float = 0.0
    attention_source: str = ""

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
            for k in ("memory", "hop", "far_hop", "launch", "sync")
            if not 0 <= getattr(self, k) < math.inf
        ]
        bad += [
            f"{k}={getattr(self, k)!r}"
            for k in ("efficiency", "usable")
            if not 0 < getattr(self, k) <= 1
        ]
        bad += [] if 0 <= self.attention <= 1 else [f"attention={self.attention!r}"]
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
    "A100": (0.5981, "calibrated: llm-foundry's MPT-13B, FSDP on one host of 8 A100s"),
    "H100": (0.4127, "calibrated: llm-foundry's MPT-13B, FSDP on one host of 8 H100s"),
    "H200": (0.4515, "calibrated: benchmarks/time_model.py's 1B-wide model on one H200"),
    "B200": (0.4127, "assumed: the H100's (no published BF16 run of a large model found)"),
    "TPU v4": (0.578, "published HFU: chowdhery2022palm, PaLM 540B on 6,144 TPU v4 (MFU 0.462)"),
    "TPU v5e": (0.7792, "calibrated: MaxText 16B on one v5e-256"),
    "TPU v5p": (0.8395, "calibrated: MaxText 32B on one v5p-128"),
    "TPU v6e": (0.4977, "calibrated: MaxText's Llama 3.1 70B on one v6e-256"),
}
"""Per device, the efficiency the time model computes at and where it comes from: calibrated
on a run of `nnxscale.evidence.runs`, or a published HFU (recompute counted, a lower bound)
where the model cannot express a run."""

GPU_PREALLOCATION = 0.75
"""The share of a GPU's memory JAX preallocates for arrays by default; the environment
variable XLA_CLIENT_MEM_FRACTION changes it (in jaxlib 0.12; XLA_PYTHON_CLIENT_MEM_FRACTION is
its deprecated name), and NVIDIA's guide suggests 0.8 to 0.9."""

TUNED_SHARE = 0.9
"""The share of a GPU's memory a tuned trainer gives arrays: NVIDIA's guide suggests raising
JAX's to 0.8 to 0.9, and PyTorch's allocator leaves a trainer about as much once its CUDA
context and communication buffers are made. The fused ledger plans with it
(`shared`)."""


def shared(hw: Hardware, ledger: str) -> float:
    """The share of `hw`'s memory a plan under `ledger` may fill: JAX's default for this
    library's program (`Hardware.usable`), a tuned trainer's (`TUNED_SHARE`) for the fused
    ledger, all of it where the runtime gives all."""
    return hw.usable if ledger == "program" else max(hw.usable, TUNED_SHARE)


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


GPU_FIT = {"launch": 2.181e-3, "sync": 3.668e-4, "far_hop": 4.0e-5}
"""The host's seconds to launch a layer's forward and backward pass for a micro-batch, the
seconds each blocking collective waits beyond its transfer, and the seconds a step of a
collective across hosts costs before any byte moves: fitted on the Ultra-Scale Playbook
grid's runs on 1 to 8 nodes of H100s (`nnxscale.evidence.grid.fit`, the median miss), and
taken for every GPU (the same software launches the work). TPUs run a compiled step whose
loops and collectives no host launches: none."""

GPU_FIT_SOURCE = "fitted: the Ultra-Scale Playbook grid's runs on 1 to 8 nodes of H100s"

ATTENTION = {
    "A100": (0.50, "dao2024flashattention2: FlashAttention-2 reaches 50 to 73% of an A100's peak"),
    "H100": (0.35, "shah2024flashattention3: FlashAttention-2 reaches 35% of an H100's peak"),
    "H200": (0.35, "shah2024flashattention3: the H100's (the same chip and kernel)"),
    "B200": (0.35, "assumed: the H100's"),
}
"""Per GPU, the share of peak FLOP/s flash attention reaches, and where it is published: its
products are not the large matrix products the efficiency is calibrated on."""


def _gpu(name: str) -> dict[str, object]:
    """What a GPU's description adds to its datasheet: the fitted host and synchronisation
    costs and the attention kernel's efficiency."""
    share, source = ATTENTION[name]
    return {**GPU_FIT, "fit_source": GPU_FIT_SOURCE, "attention": share, "attention_source": source}


HARDWARE = {
    row[0]: Hardware(
        *row,
        *EFFICIENCIES[row[0]],
        WRAPAROUND.get(row[0], 0),
        RUNTIME_SHARE.get(row[0], 1.0),
        TORUS.get(row[0], 0),
    ).replace(**(_gpu(row[0]) if row[0] in RUNTIME_SHARE else {}))
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
