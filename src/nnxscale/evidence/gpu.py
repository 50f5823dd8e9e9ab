"""Published training runs on GPUs, and this book's own on an H200.

Calibrators, one per kind of GPU: on the H100 and the A100, llm-foundry's 13B trained with
FSDP on one host (`nnxscale.evidence.foundry`); on the H200, the book's own step measured on
one device. The B200 has no calibrator: it takes the H100's efficiency. Every other run
tests: Llama 3 405B on 8,192 and 16,384 H100s; Megatron-Core's weak-scaling table
(H100, 1.7B to 462B); torchtitan's Llama 3.1 benchmarks (a 500 W H100 of 96 GB); NeMo
Automodel's Llama 3 70B; MaxText's Llama 2 7B on 1 to 16 A3 hosts. A source's TFLOP/s is
converted to tokens per second with the source's own FLOP count (each function below says
which), and whatever a source does not state is assumed and said so in the run's `where`.
"""

from __future__ import annotations

from nnxscale.costs.counts import PLANNING, Precision, counts
from nnxscale.evidence.foundry import FSDP_MIXED, gpt
from nnxscale.evidence.runs import Run, fastest_fitting
from nnxscale.model.config import Config
from nnxscale.model.configs import LLAMA3_8B, LLAMA3_70B, LLAMA3_405B

MEGATRON = PLANNING
"""What Megatron-LM holds per parameter by default: 16-bit parameters and gradients (its
`grad_reduce_in_fp32` is off unless asked), a float32 master copy and AdamW's moments: 16
bytes."""

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

_LLAMA3 = (
    "table 4 (8k tokens: TP 8, CP 1, PP 16, DP 64 or 128; 131k tokens: CP 16); section 3.3.2 "
    "says the 8k run trained without activation checkpointing on an interleaved schedule "
    "whose virtual stages it does not give: one is priced (with two, the fused ledger's "
    "first stage holds 109 GB, past the H100's 80)"
)
_LLAMA3_405B = {
    "hardware": "H100",
    "rules": "PP+FSDP+TP",
    "seq": 8192,
    "remat": False,
    "schedule": "1F1B",
    "quantity": "TFLOP/s per device",
    "source": "dubey2024llama",
    "where": _LLAMA3,
    "flat": True,
    "misses": (
        "predicted 0.45 to 0.57 of the published: Llama 3 ran an interleaved schedule whose "
        "bubble is a fraction of the one-virtual-stage bubble priced here (32 to 48% of the "
        "step), and its 16,384-wide products run faster than those of the 5,120-wide model "
        "that calibrates the H100"
    ),
}


def _llama3() -> list[Run]:
    """Llama 3 405B: 16 stages of 1F1B, FSDP and TP 8 with sequence parallelism inside each
    stage (at 131k tokens context parallelism of 16 as well, priced as the book's ring where
    Llama 3 all-gathers keys and values, and the least remat that fits, which the paper
    does not give), one sequence per micro-batch. Its TFLOP/s are taken as the field's model
    FLOPs (`nnxscale.costs.model_flops`): the paper does not give its count."""
    long = {**_LLAMA3_405B, "rules": "PP+FSDP+CP+TP", "seq": 131_072, "where": _LLAMA3}
    return [
        Run(
            name="Llama 3.1 405B, 8,192 H100s, 8k",
            cfg=LLAMA3_405B,
            mesh={"stage": 16, "fsdp": 64, "model": 8},
            batch=2048,
            micro=32,
            published=430,
            **_LLAMA3_405B,
        ),
        Run(
            name="Llama 3.1 405B, 16,384 H100s, 8k",
            cfg=LLAMA3_405B,
            mesh={"stage": 16, "fsdp": 128, "model": 8},
            batch=2048,
            micro=16,
            published=400,
            **_LLAMA3_405B,
        ),
        fastest_fitting(
            name="Llama 3.1 405B, 16,384 H100s, 131k",
            cfg=LLAMA3_405B.replace(max_len=131_072),
            mesh={"stage": 16, "fsdp": 8, "context": 16, "model": 8},
            batch=128,
            micro=16,
            published=380,
            **{k: v for k, v in long.items() if k != "remat"},
        ),
    ]


_WEAK_SCALING = (
    # size, heads, hidden, layers, TP, PP, DP, global batch, TFLOP/s per GPU
    ("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    ("7.1B", 32, 4096, 30, 2, 1, 48, 192, 465.9),
    ("16B", 48, 6144, 32, 4, 1, 48, 192, 489.1),
    ("32B", 56, 7168, 48, 8, 1, 48, 192, 459.6),
    ("70B", 64, 8192, 84, 8, 2, 48, 384, 419.7),
    ("119B", 80, 10240, 92, 8, 4, 48, 768, 420.5),
    ("177B", 96, 12288, 96, 8, 6, 48, 1152, 432.8),
    ("314B", 128, 16384, 96, 8, 8, 48, 1536, 474.4),
    ("462B", 144, 18432, 112, 8, 16, 48, 3072, 459.9),
)
"""Megatron-Core's weak-scaling table (README, `images/model_table.png`, r0.8.0, July 2024):
GPT models of 131,072 tokens at 4,096 tokens a sequence on H100s."""


def megatron_flops(embed: int, layers: int, vocab: int, seq: int) -> float:
    """FLOPs per token as Megatron-LM counted them for a GPT in 2024 (`training.py`'s
    `num_floating_point_operations`, and Narayanan et al. 2021): 72 L h^2 (1 + s / 6h +
    V / 12 h L), attention's s^2 products whole (no causal mask)."""
    return 72 * layers * embed**2 * (1 + seq / (6 * embed) + vocab / (12 * embed * layers))


def _weak_scaling() -> list[Run]:
    """Megatron-Core's weak scaling on H100s: ZeRO-1 (the distributed optimizer, which
    `--overlap-param-gather` needs) with TP and sequence parallelism (`--tp-comm-overlap`
    needs it), PP stages on 1F1B, and the two overlaps the README states. It does not give
    the micro-batch, the recompute or the virtual stages: one sequence a micro-batch, one
    virtual stage and the least recompute that fits 80 GB are priced."""
    found = []
    for size, heads, embed, layers, tp, pp, dp, batch, tflops in _WEAK_SCALING:
        cfg = gpt(embed, heads, layers, 131_072, 4096, tied=False, tp=tp)
        tokens = tflops * 1e12 / megatron_flops(embed, layers, 131_072, 4096)
        if pp > 1:
            rules, mesh, schedule = "PP+ZeRO-1+TP", {"stage": pp, "fsdp": dp, "model": tp}, "1F1B"
        else:
            rules = "ZeRO-1+TP" if tp > 1 else "ZeRO-1"
            mesh = {"data": dp, "model": tp} if tp > 1 else {"data": dp}
            schedule = "lockstep"
        found.append(
            fastest_fitting(
                name=f"Megatron-Core GPT {size}, {tp * pp * dp:,} H100s",
                cfg=cfg,
                hardware="H100",
                rules=rules,
                mesh=mesh,
                batch=batch,
                seq=4096,
                quantity="tokens/s per device",
                published=tokens,
                source="megatroncore2024",
                where=f"README weak scaling ({tflops} TFLOP/s per GPU by its count, "
                "`megatron_flops`)",
                micro=batch // dp,
                schedule=schedule,
                reduce_once=pp == 1 and batch > dp,
                precision=MEGATRON,
                overlaps=("collective matmul", "parameter prefetch"),
                flat=True,
            )
        )
    return found


_TITAN = (
    "benchmarks/llama3_h100_202412_torchtitan.md: a 500 W H100 of 96 GB HBM2e, whose peak "
    "lies between the SXM's and the NVL's (its footnote), priced as an H100 SXM with 96 GB"
)
_ASYNC_TP = (
    "benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (the same 500 W H100s of 96 GB), "
    "bfloat16, without async TP"
)


def _torchtitan() -> list[Run]:
    """torchtitan's BF16 Llama 3.1 runs: FSDP on 8 and 128 GPUs (per-op selective
    checkpointing, priced as the dots policy), and FSDP x TP 8 with sequence parallelism
    (full checkpointing for 70B), the sequence 8,192 tokens (its configs' default), without
    torch.compile."""
    common = {
        "hardware": "H100",
        "seq": 8192,
        "quantity": "tokens/s per device",
        "source": "liang2025torchtitan",
        "precision": FSDP_MIXED,
        "memory": 96e9,
        "flat": True,
    }
    return [
        Run(
            name="Llama 3.1 8B, 8 H100s (torchtitan)",
            cfg=LLAMA3_8B,
            rules="FSDP",
            mesh={"data": 8},
            batch=16,
            remat="dots",
            published=5762,
            where=_TITAN + ", line 27",
            **common,
        ),
        Run(
            name="Llama 3.1 8B, 128 H100s (torchtitan)",
            cfg=LLAMA3_8B,
            rules="FSDP",
            mesh={"data": 128},
            batch=256,
            remat="dots",
            published=5605,
            where=_TITAN + ", line 44",
            **common,
        ),
        Run(
            name="Llama 3.1 70B, 256 H100s, TP 8 (torchtitan)",
            cfg=LLAMA3_70B,
            rules="FSDP+TP+SP",
            mesh={"data": 32, "model": 8},
            batch=512,
            remat="full",
            published=597.3,
            where=_ASYNC_TP + ", line 24",
            **common,
        ),
        Run(
            name="Llama 3.1 8B, 64 H100s, TP 8 (torchtitan)",
            cfg=LLAMA3_8B,
            rules="FSDP+TP+SP",
            mesh={"data": 8, "model": 8},
            batch=96,
            remat="dots",
            published=4378,
            where=_ASYNC_TP + ", line 32",
            **common,
        ),
    ]


LLAMA2_7B = Config(
    vocab=32_000,
    embed=4096,
    heads=32,
    kv_heads=32,
    head_dim=128,
    mlp=11_008,
    layers=32,
    max_len=4096,
    dropout=0.0,
    scan_layers=True,
    compute_dtype="bfloat16",
)
"""Llama 2 7B: 6,738,415,616 parameters."""

_MAXTEXT_A3 = (492, 422, 407, 409, 375)
"""MaxText's Llama 2 7B on 1, 2, 4, 8 and 16 A3 hosts (8 H100s each): TFLOP/s per chip
(`MaxText/configs/a3/llama_2_7b/README.md`, April 2024)."""


def maxtext_flops(cfg: Config, seq: int) -> float:
    """FLOPs per token as MaxText counted them in April 2024: 6 per parameter (its total,
    the embedding's included) and token, and causal attention's products, 6 L H D s."""
    return 6 * counts(cfg).total + 6 * cfg.layers * cfg.heads * cfg.head_dim * seq


def _maxtext_gpu() -> list[Run]:
    """MaxText's Llama 2 7B on A3 hosts: FSDP over a host's eight GPUs, data parallelism
    across hosts, 4 sequences of 4,096 tokens a GPU, the `minimal_flash` remat policy (the
    products' outputs kept: priced as dots), float32 weights."""
    found = []
    for hosts, tflops in zip((1, 2, 4, 8, 16), _MAXTEXT_A3, strict=True):
        mesh = {"replica": hosts, "data": 8} if hosts > 1 else {"data": 8}
        found.append(
            Run(
                name=f"Llama 2 7B, {hosts} x 8 H100s (MaxText)",
                cfg=LLAMA2_7B,
                hardware="H100",
                rules="HSDP" if hosts > 1 else "FSDP",
                mesh=mesh,
                batch=4 * 8 * hosts,
                seq=4096,
                remat="dots",
                quantity="tokens/s per device",
                published=tflops * 1e12 / maxtext_flops(LLAMA2_7B, 4096),
                source="maxtext2025",
                where=f"MaxText/configs/a3/llama_2_7b/README.md ({tflops} TFLOP/s per chip by "
                "its count, `maxtext_flops`)",
                precision=Precision(4, 0, 8, 0, 4),
            )
        )
    return found


def _automodel() -> list[Run]:
    """NeMo Automodel's Llama 3.1 70B on 64 H100s: FSDP 32 x CP 2, one sequence of 8,192
    tokens a micro-batch and four a step, full activation checkpointing."""
    return [
        Run(
            name="Llama 3.1 70B, 64 H100s, CP 2 (NeMo Automodel)",
            cfg=LLAMA3_70B,
            hardware="H100",
            rules="FSDP+CP",
            mesh={"data": 32, "context": 2},
            batch=128,
            seq=8192,
            remat="full",
            quantity="tokens/s per device",
            published=866.77,
            source="nvidia2025automodel",
            where="docs/performance-summary.mdx",
            micro=4,
            precision=FSDP_MIXED,
            flat=True,
        )
    ]


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


def _measured() -> list[Run]:
    """The book's own steps on one H200 (`MEASURED`), priced with this library's program
    ledger and precision: the first calibrates the H200's efficiency, the others test it
    at other depths, widths and sequence lengths."""
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
            precision=Precision(),
            ledger="program",
        )
        for name, (cfg, batch, seconds) in MEASURED.items()
    ]


def _megatron_1t() -> list[Run]:
    """Megatron-LM's 1T GPT on 3,072 A100s (Narayanan et al. 2021, table 1): TP 8 x PP 64 x
    DP 6, full recompute; its micro-batch and schedule not given."""
    return [
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
            precision=MEGATRON,
            flat=True,
        )
    ]


def runs() -> list[Run]:
    """Every GPU run but llm-foundry's (`nnxscale.evidence.foundry`): Llama 3, Megatron-LM
    and Megatron-Core, torchtitan, NeMo Automodel, MaxText on A3, and this book's own on
    one H200."""
    return (
        _llama3()
        + _megatron_1t()
        + _weak_scaling()
        + _torchtitan()
        + _automodel()
        + _maxtext_gpu()
        + _measured()
    )
