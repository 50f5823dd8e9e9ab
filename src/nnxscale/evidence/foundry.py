"""llm-foundry's MPT throughput tables (Mosaic ML): 131 runs on H100s and A100s of 80 GB, with
FSDP over every GPU, each stated in full by its README; one on each GPU calibrates its
efficiency (`CALIBRATORS`)."""

from __future__ import annotations

from nnxscale.costs.counts import PRECISIONS, Precision
from nnxscale.evidence.runs import Run
from nnxscale.model.config import Config

FSDP_MIXED = Precision(parameters=4, master=0, moments=8, ema=0, gradients=4)
"""What PyTorch FSDP's mixed precision holds per parameter (llm-foundry's `amp_bf16`,
torchtitan, NeMo Automodel): float32 parameters, cast to bfloat16 for compute, AdamW's
float32 moments and float32 gradients."""


def gpt(
    embed: int, heads: int, layers: int, vocab: int, seq: int, tied: bool, tp: int = 1
) -> Config:
    """A GPT of width `embed` in the book's architecture: its 4 `embed`-unit GELU MLP as a
    SwiGLU MLP of the same parameters and FLOPs, 8 `embed` / 3 units (rounded to a multiple of
    64 `tp`, which the rule sets need to split it)."""
    step = 64 * tp
    return Config(
        vocab=vocab,
        embed=embed,
        heads=heads,
        kv_heads=heads,
        head_dim=embed // heads,
        mlp=round(8 * embed / 3 / step) * step,
        layers=layers,
        max_len=seq,
        tie_embeddings=tied,
        dropout=0.0,
        scan_layers=True,
        compute_dtype="bfloat16",
    )


_MPT = {
    "125m": (768, 12, 12),
    "350m": (1024, 16, 24),
    "760m": (1536, 12, 24),
    "1b": (2048, 16, 24),
    "3b": (2560, 20, 32),
    "7b": (4096, 32, 32),
    "13b": (5120, 40, 40),
    "30b": (7168, 56, 48),
    "70b": (8192, 64, 80),
}
"""llm-foundry's MPT models (`scripts/train/yamls/pretrain/mpt-*.yaml`): width, heads and
layers; every one a GPT with a 4-width GELU MLP, learned positions and tied embeddings of
50,368 tokens."""

_FOUNDRY = {
    "H100": (
        (75, "70b", 2048, 512, 8, 1, 1007, "FA"),
        (76, "70b", 2048, 256, 8, 1, 1035, "FA"),
        (77, "70b", 2048, 128, 8, 1, 1058, "FA"),
        (78, "30b", 2048, 512, 8, 1, 2115, "FA"),
        (79, "30b", 2048, 256, 8, 1, 2148, "FA"),
        (80, "30b", 2048, 128, 8, 1, 2199, "FA"),
        (81, "13b", 2048, 512, 16, 1, 4952, "FA"),
        (82, "13b", 2048, 256, 16, 1, 4989, "FA"),
        (83, "13b", 2048, 128, 16, 1, 5080, "FA"),
        (84, "7b", 2048, 512, 6, 1, 9670, "F"),
        (85, "7b", 2048, 256, 6, 1, 10119, "F"),
        (86, "7b", 2048, 128, 6, 1, 10475, "F"),
        (87, "3b", 2048, 512, 8, 1, 21664, "G"),
        (88, "3b", 2048, 256, 8, 1, 22772, "G"),
        (89, "3b", 2048, 128, 8, 1, 23422, "G"),
        (90, "1b", 2048, 512, 12, 1, 39837, "G"),
        (91, "1b", 2048, 256, 12, 1, 42555, "G"),
        (92, "1b", 2048, 128, 12, 1, 44123, "G"),
        (98, "70b", 2048, 64, 8, 4, 1039, "FA"),
        (99, "70b", 2048, 32, 2, 16, 882, "FA"),
        (100, "30b", 8192, 8, 1, 21, 1384, "FA"),
        (101, "30b", 4096, 8, 1, 21, 1802, "FA"),
        (102, "30b", 2048, 32, 14, 3, 2308, "FA"),
        (103, "30b", 2048, 16, 10, 3, 2263, "FA"),
        (104, "30b", 2048, 8, 3, 21, 2002, "FA"),
        (105, "30b", 1024, 8, 6, 21, 2084, "FA"),
        (106, "13b", 32768, 8, 1, 3, 1976, "FA"),
        (107, "13b", 16384, 8, 3, 3, 2985, "FA"),
        (108, "13b", 4096, 8, 10, 3, 4717, "FA"),
        (109, "13b", 2048, 64, 2, 1, 4800, "F"),
        (110, "13b", 2048, 32, 2, 1, 4811, "F"),
        (111, "13b", 2048, 16, 2, 1, 4767, "F"),
        (112, "13b", 2048, 8, 2, 1, 4792, "F"),
        (113, "13b", 1024, 8, 40, 3, 5502, "FA"),
        (114, "7b", 65536, 8, 1, 2, 1956, "FA"),
        (115, "7b", 32768, 8, 2, 2, 3318, "FA"),
        (116, "7b", 8192, 8, 8, 2, 6935, "FA"),
        (117, "7b", 4096, 8, 16, 2, 8611, "FA"),
        (118, "7b", 2048, 8, 6, 1, 10643, "F"),
        (119, "7b", 1024, 8, 64, 2, 10203, "FA"),
        (120, "3b", 65536, 8, 1, 2, 3262, "FA"),
        (121, "3b", 32768, 8, 3, 6, 5873, "FA"),
        (122, "3b", 16384, 8, 1, 6, 11152, "F"),
        (123, "3b", 8192, 8, 3, 6, 16578, "F"),
        (124, "3b", 4096, 8, 5, 6, 20964, "F"),
        (125, "3b", 2048, 64, 6, 3, 22525, "F"),
        (126, "3b", 2048, 32, 6, 3, 23021, "F"),
        (127, "3b", 2048, 16, 10, 3, 24142, "F"),
        (128, "3b", 1024, 8, 20, 6, 27046, "F"),
        (129, "3b", 512, 8, 40, 6, 27965, "F"),
        (130, "1b", 65536, 8, 1, 2, 5506, "FA"),
        (131, "1b", 32768, 8, 1, 4, 12025, "F"),
        (132, "1b", 16384, 8, 2, 4, 19649, "F"),
        (133, "1b", 8192, 8, 3, 4, 29157, "F"),
        (134, "1b", 4096, 8, 7, 4, 38535, "F"),
        (135, "1b", 2048, 64, 20, 1, 44402, "F"),
        (136, "1b", 2048, 32, 20, 1, 45130, "F"),
        (137, "1b", 2048, 16, 20, 1, 46037, "F"),
        (138, "1b", 2048, 8, 14, 1, 45455, "F"),
        (139, "1b", 1024, 8, 18, 4, 48910, "F"),
        (140, "1b", 512, 8, 56, 4, 52275, "F"),
        (141, "760m", 32768, 8, 1, 2, 16291, "F"),
        (142, "760m", 16384, 8, 3, 2, 27815, "F"),
        (143, "760m", 8192, 8, 6, 2, 41825, "F"),
        (144, "760m", 4096, 8, 12, 2, 55459, "F"),
        (145, "760m", 2048, 32, 24, 1, 67971, "F"),
        (146, "760m", 2048, 16, 24, 1, 68551, "F"),
        (147, "760m", 2048, 8, 24, 2, 63147, "F"),
        (148, "760m", 1024, 8, 48, 2, 78581, "F"),
        (149, "760m", 512, 8, 96, 2, 83749, "F"),
    ),
    "A100": (
        (166, "70b", 2048, 64, 8, 4, 410, "FA"),
        (167, "70b", 2048, 32, 2, 16, 373, "FA"),
        (168, "30b", 8192, 8, 1, 21, 574, "FA"),
        (169, "30b", 4096, 8, 1, 21, 814, "FA"),
        (170, "30b", 2048, 8, 3, 21, 916, "FA"),
        (171, "30b", 1024, 8, 6, 21, 946, "FA"),
        (172, "30b", 512, 8, 12, 21, 967, "FA"),
        (173, "13b", 32768, 8, 1, 3, 1016, "FA"),
        (174, "13b", 16384, 8, 3, 3, 1431, "FA"),
        (175, "13b", 8192, 8, 5, 3, 1795, "FA"),
        (176, "13b", 4096, 8, 10, 3, 2060, "FA"),
        (177, "13b", 2048, 8, 2, 3, 2262, "F"),
        (178, "13b", 1024, 8, 40, 3, 2330, "FA"),
        (179, "7b", 65536, 8, 1, 2, 1013, "FA"),
        (180, "7b", 32768, 8, 2, 2, 1672, "FA"),
        (181, "7b", 16384, 8, 4, 2, 2453, "FA"),
        (182, "7b", 8192, 8, 8, 2, 3206, "FA"),
        (183, "7b", 4096, 8, 16, 2, 3684, "FA"),
        (184, "7b", 2048, 8, 6, 2, 4641, "F"),
        (185, "7b", 1024, 8, 64, 2, 4357, "FA"),
        (186, "3b", 65536, 8, 1, 2, 1767, "FA"),
        (187, "3b", 32768, 8, 3, 6, 3029, "FA"),
        (188, "3b", 16384, 8, 1, 6, 5529, "F"),
        (189, "3b", 8192, 8, 3, 6, 7695, "F"),
        (190, "3b", 4096, 8, 5, 6, 9457, "F"),
        (191, "3b", 2048, 8, 10, 2, 10811, "F"),
        (192, "3b", 1024, 8, 20, 6, 11580, "F"),
        (193, "3b", 512, 8, 40, 6, 12127, "F"),
        (194, "1b", 65536, 8, 1, 2, 3044, "FA"),
        (195, "1b", 32768, 8, 1, 4, 6275, "F"),
        (196, "1b", 16384, 8, 2, 4, 9956, "F"),
        (197, "1b", 8192, 8, 3, 4, 13814, "F"),
        (198, "1b", 4096, 8, 7, 4, 17807, "F"),
        (199, "1b", 2048, 8, 14, 4, 20513, "F"),
        (200, "1b", 1024, 8, 18, 4, 22112, "F"),
        (201, "1b", 512, 8, 56, 4, 23148, "F"),
        (202, "760m", 65536, 8, 1, 2, 4143, "FA"),
        (203, "760m", 32768, 8, 1, 2, 8802, "F"),
        (204, "760m", 16384, 8, 3, 2, 14274, "F"),
        (205, "760m", 8192, 8, 6, 2, 20933, "F"),
        (206, "760m", 4096, 8, 12, 2, 27351, "F"),
        (207, "760m", 2048, 8, 24, 2, 32434, "F"),
        (208, "760m", 1024, 8, 48, 2, 29765, "F"),
        (209, "760m", 512, 8, 96, 2, 29446, "F"),
        (210, "350m", 65536, 8, 1, 2, 7524, "F"),
        (211, "350m", 32768, 8, 2, 2, 13652, "F"),
        (212, "350m", 16384, 8, 4, 2, 23559, "F"),
        (213, "350m", 8192, 8, 8, 2, 36569, "F"),
        (214, "350m", 4096, 8, 16, 2, 49555, "F"),
        (215, "350m", 2048, 8, 32, 2, 58782, "F"),
        (216, "350m", 1024, 8, 64, 2, 64813, "F"),
        (217, "350m", 512, 8, 128, 2, 69330, "F"),
        (218, "125m", 65536, 8, 1, 2, 20368, "F"),
        (219, "125m", 32768, 8, 2, 2, 36407, "F"),
        (220, "125m", 16384, 8, 4, 2, 60040, "F"),
        (221, "125m", 8192, 8, 8, 2, 90392, "F"),
        (222, "125m", 4096, 8, 16, 2, 118396, "F"),
        (223, "125m", 2048, 8, 40, 2, 142830, "F"),
        (224, "125m", 2048, 8, 32, 2, 141737, "F"),
        (225, "125m", 1024, 8, 64, 2, 156468, "F"),
        (226, "125m", 512, 8, 128, 2, 165681, "F"),
    ),
}
"""llm-foundry's MPT throughput tables (`scripts/train/benchmarking/README.md`, at commit
8c8dd48, unchanged since January 2024): per row its line, the model, the sequence length, the
GPUs, the micro-batch, the micro-batches a step, the tokens per second per GPU, and its
sharding (`F`: FSDP's FULL_SHARD, `G`: SHARD_GRAD_OP, that is ZeRO-2), `A` where it
checkpoints every layer's activations. The H100 rows are its two BF16 tables; the A100
rows its 80 GB table (RoCE at 1,600 Gb/s a node)."""


CALIBRATORS = {"H100": 112, "A100": 177}
"""The llm-foundry lines that calibrate the H100's and the A100's efficiency: on each, the
largest model its table trains on one host (FSDP over eight GPUs) without activation
checkpointing, at the table's most common 2,048 tokens: its 13B. The source states every
setting of them, and nothing crosses a network or is recomputed."""


TRITON = (
    "attention is most of the step at 16k to 65k tokens, and the scripts that ran these rows "
    "chose llm-foundry's Triton attention kernel (`--attn_impl triton`, their default until "
    "March 2024), which runs slower than the FlashAttention-2 the model prices "
    "(`nnxscale.costs.ATTENTION`)"
)
KNOWN_MISSES = (120, 130, 131, 141, 210, 211, 218, 219)
"""The lines the model predicts more than `nnxscale.evidence.runs.WORST` times too fast,
each for the reason `TRITON` gives: 8 of the tables' 32 rows of 16,384 tokens or more."""


def runs() -> list[Run]:
    """llm-foundry's MPT runs: FSDP over every GPU, the batch a multiple of the micro-batch,
    BF16 in PyTorch's FSDP mixed precision (the A100's 70B rows in its `PURE` bfloat16); one
    per GPU calibrates (`CALIBRATORS`)."""
    found = []
    for device, rows in _FOUNDRY.items():
        for line, model, seq, gpus, micro, steps, tokens, how in rows:
            embed, heads, layers = _MPT[model]
            pure = device == "A100" and model == "70b"
            found.append(
                Run(
                    name=f"MPT-{model}, {gpus} {device}s, {seq:,} tokens (line {line})",
                    cfg=gpt(embed, heads, layers, 50_368, seq, tied=True),
                    hardware=device,
                    rules="ZeRO-2" if how.startswith("G") else "FSDP",
                    mesh={"data": gpus},
                    batch=gpus * micro * steps,
                    seq=seq,
                    remat="full" if how.endswith("A") else False,
                    quantity="tokens/s per device",
                    published=tokens,
                    source="mosaicml2024foundry",
                    where=f"scripts/train/benchmarking/README.md line {line}",
                    micro=steps,
                    precision=PRECISIONS["bfloat16, AdamW in bfloat16"] if pure else FSDP_MIXED,
                    calibrates=CALIBRATORS[device] == line,
                    flat=True,
                    misses=TRITON if line in KNOWN_MISSES else "",
                )
            )
    return found
