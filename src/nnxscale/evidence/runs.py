"""Training runs others published (and one measured for this book), each as the cost model
sees it: the model, the devices, the layout and the batch, the quantity measured, and the
model's prediction of it. `benchmarks/published.py` prints them; chapter 12 holds the table.

One run per device kind calibrates that device's `Hardware.efficiency` (`calibrate`: the
efficiency at which the model reproduces it exactly); every other row tests the rest of the
model: other sizes, layouts, slice counts and sequence lengths on the same device.
"""

from __future__ import annotations

import dataclasses
import math

from nnxscale.costs.counts import Setup, step_flops
from nnxscale.costs.derive import unsuitable
from nnxscale.costs.hardware import hardware
from nnxscale.costs.steps import efficiency_where, step_cost
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B
from nnxscale.model.transformer import Config
from nnxscale.placement.rules import STRATEGIES

QUANTITIES = (
    "TFLOP/s per device",
    "hardware TFLOP/s per device",
    "tokens/s per device",
    "MFU",
    "step time (s)",
)
"""What a run reports: model FLOPs per device per second (the step's products, no
recompute counted), the same with remat's recompute counted (Megatron-LM's 96 B s l h^2
in place of 72), tokens per device per second, model FLOPs utilisation, or step time."""

WORST = 1.5
"""The largest factor by which a prediction may miss a published number it can reproduce."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One published training run: `batch` sequences of `seq` tokens a step on `mesh` of
    `hardware` under rule set `rules` (None when the library cannot express its layout,
    and `why` says so), and the `published` value of `quantity`, from `source` (a key of
    the bibliography) at `where` in it."""

    name: str
    cfg: Config
    hardware: str
    rules: str | None
    mesh: dict[str, int]
    batch: int
    seq: int
    remat: bool | str
    quantity: str
    published: float
    source: str
    where: str
    why: str = ""
    calibrates: bool = False
    misses: str = ""
    """Why the model is known to miss this run by more than `WORST` (it is priced and shown,
    but not held to `WORST`), or ''."""
    slice: int = 0
    """Devices in one slice of a multislice run: its fast domain, beyond which the replicas
    talk over the data-centre network (0: the hardware's own domain)."""
    micro: int = 1
    """Micro-batches a step (a pipeline's, or gradient accumulation's)."""
    schedule: str = "lockstep"
    """A pipeline's schedule (`nnxscale.costs.SCHEDULES`) and its virtual stages."""
    virtual: int = 1

    @property
    def devices(self) -> int:
        """How many devices ran it."""
        return math.prod(self.mesh.values())

    def setup(self) -> Setup:
        """Its layout as the cost model takes it."""
        return Setup.of(
            STRATEGIES[str(self.rules)],
            self.mesh,
            self.micro,
            self.remat,
            schedule=self.schedule,
            virtual=self.virtual,
        )

    def predicted(self, efficiency: float | None = None) -> float | None:
        """The cost model's value of `quantity` (None when it cannot express the run)."""
        if self.rules is None:
            return None
        hw = hardware(self.hardware)
        if self.slice:
            hw = dataclasses.replace(hw, domain=self.slice)
        cost = step_cost(self.cfg, self.setup(), hw, self.batch, self.seq, efficiency=efficiency)
        flops = step_flops(self.cfg, self.batch, self.seq) / self.devices
        recomputed = step_flops(self.cfg, self.batch, self.seq, remat=self.remat) / self.devices
        return {
            "TFLOP/s per device": flops / cost.step_time / 1e12,
            "hardware TFLOP/s per device": recomputed / cost.step_time / 1e12,
            "tokens/s per device": self.batch * self.seq / self.devices / cost.step_time,
            "MFU": flops / cost.step_time / hw.flops,
            "step time (s)": cost.step_time,
        }[self.quantity]

    @property
    def ratio(self) -> float | None:
        """Predicted over published (None when the model cannot express the run)."""
        predicted = self.predicted()
        return None if predicted is None else predicted / self.published

    def problem(self) -> str:
        """Why the layout cannot run this model and batch, or ''."""
        return (
            why if (why := self.why) else unsuitable(self.cfg, self.setup(), self.batch, self.seq)
        )


def calibrate(run: Run) -> float:
    """The efficiency at which the cost model reproduces `run` exactly."""
    return efficiency_where(
        lambda e: run.predicted(e) > run.published,  # type: ignore[operator]
        rises=run.quantity != "step time (s)",
    )


def maxtext(scale: int, seq: int = 2048) -> Config:
    """MaxText's `global_parameter_scale` model (MaxText's base.yml scaled as its
    `get_individual_scales` does: heads and MLP, then width, then layers, each doubled in
    turn), a Llama-2-style decoder with 32,000 tokens."""
    steps, rest = divmod(int(math.log2(scale)), 3)
    heads, width = steps + (rest > 0), steps + (rest > 1)
    return Config(
        vocab=32_000,
        embed=2048 * 2**width,
        heads=16 * 2**heads,
        kv_heads=16 * 2**heads,
        head_dim=128,
        mlp=7168 * 2**heads,
        layers=16 * 2**steps,
        max_len=seq,
        dropout=0.0,
        scan_layers=True,
        compute_dtype="bfloat16",
    )


LLAMA2_70B = LLAMA3_70B.replace(vocab=32_000, max_len=4096)
"""Llama 2 70B: Llama 3 70B's layers with a 32,000-token vocabulary."""

PALM_540B = Config(
    vocab=256_000,
    embed=18_432,
    heads=48,
    kv_heads=1,
    head_dim=256,
    mlp=73_728,
    layers=118,
    max_len=2048,
    tie_embeddings=True,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)
"""PaLM 540B (Chowdhery et al. 2022, table 1): multi-query attention, SwiGLU, shared
input and output embeddings."""

_WIDE = Config(
    vocab=32_000,
    embed=2048,
    heads=16,
    head_dim=128,
    mlp=8192,
    layers=4,
    max_len=1024,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)

MEASURED = {
    "1B-wide": (_WIDE, 16, 0.0810),
    "1B-deep": (_WIDE.replace(layers=16, max_len=2048), 8, 0.3622),
    "8B-layers": (LLAMA3_8B.replace(layers=4, max_len=4096, dropout=0.0), 4, 0.3706),
    "1B-long": (_WIDE.replace(max_len=8192), 2, 0.2231),
}
"""The models `benchmarks/time_model.py` times on an accelerator: each `Config`, its
sequences per step (of `max_len` tokens), and the median step in seconds it measured on one
H200 (bfloat16, no remat, AdamW; 2026-11-27, jax 0.11.2 with CUDA 13)."""

_V5E = {
    16: (6, (120, 117, 117, 115, 111, 108)),
    32: (4, (132, 128, 126, 125, 123, 119)),
    64: (2, (118, 112, 110, 108, 105, 99)),
    128: (1, (110, 110, 108, 104, 100, 91)),
}
"""MaxText's v5e table: per model scale, the batch per chip and the TFLOP/s per chip on 1, 2,
4, 8, 16 and 32 slices of 256 chips. MaxText's README tables (v5e and v5p) predate its
counting attention under the causal mask (its PR #1988 halved attention's FLOPs): they count
12 L b s^2 H D where the book counts 7 L b H D (s^2 + s block). At 2,048 tokens that is at
most 2.7% of a step's FLOPs (`tests/test_runs.py`), which the v5e and v5p calibrations
absorb."""


def _v5e() -> list[Run]:
    """MaxText's runs on 1 to 32 TPU v5e-256 slices: FSDP inside a slice, DP across (128B:
    FSDP 16 x TP 16 inside), full remat."""
    runs = []
    for scale, (per_chip, tflops) in _V5E.items():
        for slices, value in zip((1, 2, 4, 8, 16, 32), tflops, strict=True):
            inside = {"data": 16, "model": 16} if scale == 128 else {"data": 256}
            rules = (
                ("HSDP+TP" if scale == 128 else "HSDP")
                if slices > 1
                else ("FSDP+TP" if scale == 128 else "FSDP")
            )
            mesh = {"replica": slices, **inside} if slices > 1 else inside
            runs.append(
                Run(
                    f"MaxText {scale}B, {slices} x v5e-256",
                    maxtext(scale),
                    "TPU v5e",
                    rules,
                    mesh,
                    per_chip * 256 * slices,
                    2048,
                    "full",
                    "TFLOP/s per device",
                    value,
                    "maxtext2025",
                    "configs/tpu/v5e/README.md",
                    slice=256,
                    calibrates=(scale, slices) == (16, 1),
                )
            )
    return runs


_V5P = {
    32: (6, 4, "dots", {64: (328, 319)}),
    64: (3, 4, "dots", {64: (323, 309)}),
    128: (1, 8, "dots", {128: (315, 305), 256: (316, 274)}),
    256: (1, 8, "dots", {512: (308, 289)}),
    512: (2, 8, "full", {512: (294, 282)}),
    1024: (2, 16, "full", {1024: (254, 237), 2048: (297, 279)}),
}
"""MaxText's v5p table: per model scale, the batch per chip, the tensor-parallel width, the
remat policy (MaxText's `minimal` saves the products' outputs, as `dots` does), and per
slice size in chips (a v5p-N slice has N / 2 chips) the TFLOP/s per chip on 1 and 2 slices."""


def _v5p() -> list[Run]:
    """MaxText's runs on one and two TPU v5p slices: FSDP x TP inside, DP across."""
    runs = []
    for scale, (per_chip, tp, remat, slices) in _V5P.items():
        for chips, values in slices.items():
            for count, value in zip((1, 2), values, strict=True):
                inside = {"data": chips // tp, "model": tp}
                mesh = {"replica": 2, **inside} if count == 2 else inside
                runs.append(
                    Run(
                        f"MaxText {scale}B, {count} x v5p-{2 * chips}",
                        maxtext(scale),
                        "TPU v5p",
                        "HSDP+TP" if count == 2 else "FSDP+TP",
                        mesh,
                        per_chip * chips * count,
                        2048,
                        remat,
                        "TFLOP/s per device",
                        value,
                        "maxtext2025",
                        "configs/tpu/v5p/README.md",
                        slice=chips,
                        calibrates=(scale, count) == (32, 1),
                    )
                )
    return runs


_V6E = "docs/reference/models/tiering.md and its recipes"
_OFFLOADED = (
    "; its remat policy ('custom') offloads the decoder's input and the attention projections "
    "to host memory and recomputes the rest, priced as dots (the v6e calibration absorbs it)"
)
_LLAMA2_70B = (
    "; benchmarks/maxtext_trillium_model_configs.py's llama2_70b_4096 (batch 4 a chip, full "
    "remat), priced; its optimized variant runs batch 2 with qkv_proj_offloaded"
)
_LLAMA3 = "table 4 (8k tokens: TP 8, CP 1, PP 16, DP 64 or 128; 131k tokens: CP 16)"
_TPU_V6E = {"hardware": "TPU v6e", "rules": "FSDP", "mesh": {"data": 256}, "source": "maxtext2025"}
_LLAMA3_405B = {
    "hardware": "H100",
    "rules": "PP+FSDP+TP",
    "seq": 8192,
    "remat": "full",
    "schedule": "1F1B",
    "virtual": 2,
    "source": "dubey2024llama",
}
"""Llama 3 405B: 16 stages of Megatron-style interleaved 1F1B (section 3.3.2; its virtual
stages and its recompute the paper does not give: 2, and full remat, the least memory, are
assumed), FSDP and TP 8 with sequence parallelism inside each stage (at 131k tokens
context parallelism of 16 as well, priced as the book's ring where Llama 3 all-gathers keys
and values), and one sequence per micro-batch."""
_TFLOPS = {"quantity": "TFLOP/s per device"}

MEGATRON_1T = Config(
    vocab=51_200,
    embed=25_600,
    heads=160,
    kv_heads=160,
    head_dim=160,
    mlp=68_264,
    layers=128,
    max_len=2048,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)
"""Megatron-LM's 1T GPT (Narayanan et al. 2021, table 1), in the book's architecture: a
SwiGLU MLP of 8h/3 units (rounded down to a multiple of TP's 8) holds the parameters of
GPT's 4h-unit MLP."""

OTHER_RUNS = (
    Run(
        name="Llama 3.1 8B, v6e-256",
        cfg=LLAMA3_8B,
        batch=4 * 256,
        seq=8192,
        remat="dots",
        quantity="tokens/s per device",
        published=7207,
        where=_V6E + _OFFLOADED,
        **_TPU_V6E,
    ),
    Run(
        name="Llama 3.1 70B, v6e-256",
        cfg=LLAMA3_70B,
        batch=5 * 256,
        seq=8192,
        remat="dots",
        quantity="tokens/s per device",
        published=960,
        where=_V6E + _OFFLOADED,
        calibrates=True,
        **_TPU_V6E,
    ),
    Run(
        name="Llama 2 70B, v6e-256",
        cfg=LLAMA2_70B,
        batch=4 * 256,
        seq=4096,
        remat="full",
        quantity="tokens/s per device",
        published=900,
        where=_V6E + _LLAMA2_70B,
        **_TPU_V6E,
    ),
    Run(
        name="PaLM 540B, 6,144 TPU v4",
        cfg=PALM_540B,
        hardware="TPU v4",
        rules="HSDP+TP",
        mesh={"replica": 2, "data": 256, "model": 12},
        batch=2048,
        seq=2048,
        remat="full",
        quantity="MFU",
        published=0.462,
        source="chowdhery2022palm",
        where="section 4 and table 3 (2 pods: TP 12 x FSDP 256 each)",
        why="multi-query attention under TP 12: its one key/value head is copied to every "
        "device of the model axis, and the rule sets split kv_heads over it",
    ),
    Run(
        name="Llama 3.1 405B, 8,192 H100s, 8k",
        cfg=LLAMA3_405B,
        mesh={"stage": 16, "fsdp": 64, "model": 8},
        batch=2048,
        micro=32,
        published=430,
        where=_LLAMA3,
        calibrates=True,
        **_LLAMA3_405B,
        **_TFLOPS,
    ),
    Run(
        name="Llama 3.1 405B, 16,384 H100s, 8k",
        cfg=LLAMA3_405B,
        mesh={"stage": 16, "fsdp": 128, "model": 8},
        batch=2048,
        micro=16,
        published=400,
        where=_LLAMA3,
        **_LLAMA3_405B,
        **_TFLOPS,
    ),
    Run(
        name="Llama 3.1 405B, 16,384 H100s, 131k",
        cfg=LLAMA3_405B.replace(max_len=131_072),
        mesh={"stage": 16, "fsdp": 8, "context": 16, "model": 8},
        batch=128,
        micro=16,
        published=380,
        where=_LLAMA3,
        **{**_LLAMA3_405B, "rules": "PP+FSDP+CP+TP", "seq": 131_072},
        **_TFLOPS,
    ),
    Run(
        name="Megatron-LM 1T, 3,072 A100s",
        cfg=MEGATRON_1T,
        hardware="A100",
        rules="PP+TP",
        mesh={"stage": 64, "data": 6, "model": 8},
        batch=3072,
        seq=2048,
        remat="full",
        micro=512,
        schedule="1F1B",
        published=163,
        quantity="hardware TFLOP/s per device",
        source="narayanan2021megatron",
        where="table 1 (TP 8, PP 64, DP 6; one sequence per micro-batch and 1F1B assumed)",
        calibrates=True,
    ),
)
"""Runs from other sources: MaxText's v6e recipes, PaLM on TPU v4, Llama 3 and Megatron-LM
on GPUs, and this book's own run on one H200."""


def _measured() -> list[Run]:
    """The book's own steps on one H200 (`MEASURED`): the first calibrates the H200's
    efficiency, the others test it at other depths, widths and sequence lengths."""
    slow_attention = (
        "attention at 8,192 tokens: the model prices its products at the products' "
        "efficiency, and the book's blockwise attention, plain JAX, reaches far less on a GPU"
    )
    return [
        Run(
            name=f"{name}, one H200 (this book)",
            cfg=cfg,
            hardware="H200",
            rules="DP",
            mesh={"data": 1},
            batch=batch,
            seq=cfg.max_len,
            remat=False,
            quantity="step time (s)",
            published=seconds,
            source="measured",
            where="benchmarks/time_model.py on one H200, 2026-11-27",
            calibrates=name == "1B-wide",
            misses=slow_attention if cfg.max_len > 4096 else "",
        )
        for name, (cfg, batch, seconds) in MEASURED.items()
    ]


def runs() -> list[Run]:
    """Every published run the book confronts the cost model with."""
    return _v5e() + _v5p() + list(OTHER_RUNS) + _measured()


COLUMNS = ("run", "device", "layout", "quantity", "published", "model", "ratio", "source", "note")
"""The columns of `rows`."""


def layout(run: Run) -> str:
    """The run's rule set and mesh in words, as `name on axis size x ...`."""
    mesh = " x ".join(f"{axis} {size}" for axis, size in run.mesh.items())
    return f"{run.rules or 'not expressible'}: {mesh}"


def rows(found: list[Run] | None = None) -> list[list[object]]:
    """One row per run (`COLUMNS`): the prediction and its ratio to the published value, or
    the reason the model cannot reproduce it, and its source."""
    table = []
    for run in runs() if found is None else found:
        problem = run.problem()
        predicted = None if problem else run.predicted()
        ratio = "" if predicted is None else f"{predicted / run.published:.2f}"
        mark = " (calibrates)" if run.calibrates else ""
        table.append(
            [
                run.name + mark,
                run.hardware,
                layout(run),
                run.quantity,
                f"{run.published:,.4g}",
                "" if predicted is None else f"{predicted:,.4g}",
                ratio,
                f"{run.source}, {run.where}",
                problem or (f"misses: {run.misses}" if run.misses else ""),
            ]
        )
    return table


def worst(found: list[Run] | None = None) -> tuple[float, Run]:
    """The run the model misses by the largest factor (either way) among those it can
    reproduce and is not known to miss (`Run.misses`), and that factor."""
    priced = [r for r in (runs() if found is None else found) if not r.problem() and not r.misses]
    factor = {id(r): max(r.ratio, 1 / r.ratio) for r in priced}  # type: ignore[arg-type, operator]
    run = max(priced, key=lambda r: factor[id(r)])
    return factor[id(run)], run


def spread(found: list[Run] | None = None) -> tuple[float, Run, Run]:
    """The largest factor between the model's ratios to published (`Run.ratio`) of two runs
    of one model on one kind of device, from one source, in two layouts, and the two runs:
    how far apart two plans' predictions may lie before the model's own error stops ranking
    them (`nnxscale.planner.TIE`). Runs across slices are left out: their decline with the
    slice count is a miss of the model's own (chapter 12), not noise between layouts."""
    priced = [
        r
        for r in (runs() if found is None else found)
        if not r.problem() and not r.misses and not (r.slice and r.devices > r.slice)
    ]
    ratios: dict[int, float] = {id(r): r.ratio for r in priced}  # type: ignore[misc]

    def apart(a: Run, b: Run) -> float:
        low, high = sorted((ratios[id(a)], ratios[id(b)]))
        return high / low

    pairs = [
        (apart(a, b), a, b)
        for i, a in enumerate(priced)
        for b in priced[i + 1 :]
        if (a.hardware, a.source, a.cfg) == (b.hardware, b.source, b.cfg)
        and (a.rules, a.mesh) != (b.rules, b.mesh)
    ]
    if not pairs:
        raise ValueError("no two runs of one model in two layouts to measure the spread on")
    return max(pairs, key=lambda pair: pair[0])
