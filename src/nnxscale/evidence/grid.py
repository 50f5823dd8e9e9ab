"""The Ultra-Scale Playbook's benchmark grid: 1,265 measured nanotron runs on 1 to 64 nodes of
eight H100s, each priced by the cost model in its own layout.

Hugging Face trained three Llama-shaped models (the grid's "1B", "3B" and "80B") on 4,096-token
sequences, 256 a step, in every layout nanotron runs: data parallelism of `dp`, tensor
parallelism (with sequence parallelism) of `tp`, `pp` pipeline stages on 1F1B, ZeRO stage 0 or
1, `mbs` sequences a micro-batch and `gradacc` micro-batches a step. Each run reports tokens
per second per GPU and its peak memory, measured on one step (`data/usp_grid.json`, from the
playbook's interactive figure; the 8B runs of the same grid are held out for an independent
check and are not in the file).

The protocol (`FIT_NODES`): what the time model fits on this grid (`fit`) it fits on the runs
of 1 to 8 nodes, and it is tested on those of 16 to 64 nodes, which it never saw;
within each model and node count, `rank` says how well its predictions order the measured
runs (Spearman's rank correlation), how much slower than the measured best its first pick
among the runs it predicts to fit ran (the regret), and how many it predicts within a factor.
Before any prediction, two model-free checks set runs aside (`anomalies`): a run whose recorded
batch is not the grid's, and a run whose twin (the same layout and batch, the other ZeRO stage,
or a repeat) ran more than `TWIN` times as fast, which no cost of its layout can explain.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from importlib import resources

from nnxscale.costs.counts import Precision, Setup, counts
from nnxscale.costs.hardware import Hardware, hardware, shared
from nnxscale.costs.planner import HEADROOM
from nnxscale.costs.steps import step_cost
from nnxscale.costs.suitable import unsuitable
from nnxscale.model.config import Config
from nnxscale.placement.catalogue import STRATEGIES

SEQ, BATCH, GPUS_PER_NODE = 4096, 256, 8
"""The grid's sequence length and batch (sequences a step), and its nodes' GPUs."""


def _llama(layers: int, embed: int, heads: int, mlp: int, tied: bool) -> Config:
    """A model of the grid as nanotron's `scripts/scaling_benchmarks.py` builds it: full
    multi-head attention (`NUM_KEY_VALUE_HEADS = None`), a 131,072-token vocabulary, SwiGLU,
    the embeddings tied below an MLP of 10,000 units."""
    return Config(
        vocab=131_072,
        embed=embed,
        heads=heads,
        kv_heads=heads,
        head_dim=embed // heads,
        mlp=mlp,
        layers=layers,
        max_len=SEQ,
        tie_embeddings=tied,
        dropout=0.0,
        scan_layers=True,
        compute_dtype="bfloat16",
    )


MODELS = {
    "1B": _llama(16, 2048, 32, 8192, True),
    "3B": _llama(28, 3072, 32, 8192, True),
    "80B": _llama(80, 8192, 64, 28672, False),
}
"""The grid's models (`scaling_benchmarks.py`'s `model_configs`): their FLOPs per token under
nanotron's count (`nanotron_flops`) reproduce the MFU the source reports from each run's
tokens per second, for 97% of the runs."""


def nanotron_flops(cfg: Config, seq: int = SEQ, tied_twice: bool = True) -> float:
    """FLOPs per token as nanotron counts them for the grid's MFU: 6 per parameter, a tied
    embedding counted as two matrices (the input's and the head's) or, in some of the
    grid's runs, as one (`tied_twice=False`), and attention's products over every pair of
    tokens, unmasked, 12 L H D s."""
    counted = counts(cfg).total + tied_twice * cfg.tie_embeddings * cfg.vocab * cfg.embed
    return 6 * counted + 12 * cfg.layers * cfg.heads * cfg.head_dim * seq


NANOTRON = Precision(parameters=2, master=4, moments=8, ema=0, gradients=4)
"""What nanotron holds per parameter in the grid's runs: bfloat16 parameters, a float32
master copy and AdamW's two float32 moments (ZeRO-1 splits these over `dp`), and float32
gradients (`ACCUMULATE_GRAD_IN_FP32 = True`)."""

FIT_NODES = (1, 2, 4, 8)
"""The node counts whose runs the time model may be fitted on; 16, 32 and 64 test it."""

TWIN = 1.5
"""A run whose twin ran more than this many times as fast is set aside (`anomalies`)."""

WITHIN = 1.5
"""The factor within which a prediction counts as close (`rank`)."""


@dataclasses.dataclass(frozen=True)
class GridRun:
    """One run of the grid: its model and layout, what it measured (tokens per second per
    GPU, peak memory in GiB), or that it failed (crashed or out of memory)."""

    model: str
    nodes: int
    dp: int
    tp: int
    pp: int
    zero: int
    mbs: int
    gradacc: int
    gbs: int
    tokens: float
    """Tokens per second per GPU (NaN for a failed run)."""
    memory: float
    """Peak memory, GiB (NaN for a failed run)."""
    mfu: float
    """The MFU the source reports, by its count (`nanotron_flops`; NaN for a failed run)."""
    ok: bool

    @property
    def label(self) -> str:
        """The layout in the grid's words, e.g. `dp 8 tp 2 pp 4 zero 1 mbs 2 x 16`."""
        return (
            f"dp {self.dp} tp {self.tp} pp {self.pp} zero {self.zero} "
            f"mbs {self.mbs} x {self.gradacc}"
        )

    @property
    def sequences(self) -> int:
        """Sequences a step, as the layout runs them (`dp` x `mbs` x `gradacc`)."""
        return self.dp * self.mbs * self.gradacc

    @property
    def fit(self) -> bool:
        """Whether the run may be fitted on (`FIT_NODES`); the others test."""
        return self.nodes in FIT_NODES

    def setup(self) -> Setup:
        """The run's layout as the cost model takes it: DP, ZeRO-1, TP with sequence
        parallelism, or pipeline stages on 1F1B around them; gradients reduced once a step
        (nanotron accumulates micro-batches without reducing); the fused ledger, with the
        loss on float32 logits (nanotron's `sharded_cross_entropy(logits.float())`) and the
        products' gathered inputs kept whole: the fit split's memory grows with its
        sequences at TP 8 to 32 as keeping them predicts (nanotron's
        `tp_recompute_allgather`, off in these runs)."""
        z = self.zero == 1
        if self.pp > 1:
            rules = STRATEGIES["PP+ZeRO-1+TP" if z else "PP+TP"]
            batch = "fsdp" if z else "data"
            mesh = {"stage": self.pp, batch: self.dp, "model": self.tp}
            schedule = "1F1B"
        else:
            name = {(False, False): "DP", (True, False): "ZeRO-1"}.get(
                (z, self.tp > 1), "ZeRO-1+TP" if z else "TP+SP"
            )
            rules, schedule = STRATEGIES[name], "lockstep"
            mesh = {"data": self.dp, "model": self.tp} if self.tp > 1 else {"data": self.dp}
        once = self.pp == 1 and self.gradacc > 1
        return Setup.of(
            rules,
            mesh,
            self.gradacc,
            False,
            NANOTRON,
            schedule,
            reduce_once=once,
            ledger="fused",
            loss="float32",
            regather=False,
            flat=True,
        )


@functools.cache
def runs() -> tuple[GridRun, ...]:
    """Every run of the grid (`data/usp_grid.json`), failed ones included."""
    text = resources.files("nnxscale.evidence").joinpath("data/usp_grid.json").read_text()
    found = []
    for r in json.loads(text)["runs"]:
        ok = r["status"] == "ok"
        found.append(
            GridRun(
                r["model"],
                r["nodes"],
                r["dp"],
                r["tp"],
                r["pp"],
                r["zero"],
                r["mbs"],
                r["gradacc"],
                r["gbs"],
                r["tok_s_gpu"] if ok else math.nan,
                r["memory_gb"] if ok else math.nan,
                r["mfu"] if ok else math.nan,
                ok,
            )
        )
    return tuple(found)


def anomalies(found: Iterable[GridRun]) -> dict[GridRun, str]:
    """The measured runs no cost of their layout can explain, each with why: its batch is not
    the grid's (the layout recorded is not the one that ran), or its twin (the same model,
    nodes, layout and batch; the other ZeRO stage, which changes only the optimizer's
    memory and one gather a step, or a repeat) ran more than `TWIN` times as fast."""
    why = {}
    for group in twins(found):
        best = max(group, key=lambda t: t.tokens)
        for r in group:
            if r.sequences != r.gbs:
                why[r] = f"ran {r.sequences} sequences a step, not the grid's {r.gbs}"
            elif best.tokens > TWIN * r.tokens:
                why[r] = f"its twin ({best.label}) ran {best.tokens / r.tokens:.1f} x as fast"
    return why


def twins(found: Iterable[GridRun]) -> list[list[GridRun]]:
    """The measured runs in groups of twins: the same model, nodes, layout and batch, which
    differ only in their ZeRO stage, or are repeats."""
    groups: dict[tuple, list[GridRun]] = defaultdict(list)
    for r in (r for r in found if r.ok):
        groups[(r.model, r.nodes, r.dp, r.tp, r.pp, r.mbs, r.gradacc)].append(r)
    return list(groups.values())


@dataclasses.dataclass(frozen=True)
class Priced:
    """A measured run and the cost model's prediction of it."""

    run: GridRun
    tokens: float
    """Predicted tokens per second per GPU."""
    peak: float
    """Predicted peak bytes per device."""

    @property
    def ratio(self) -> float:
        """Predicted over measured tokens per second."""
        return self.tokens / self.run.tokens

    @property
    def memory_ratio(self) -> float:
        """Predicted over measured peak memory (the grid's GiB)."""
        return self.peak / 2**30 / self.run.memory


def problem(run: GridRun) -> str:
    """Why the cost model cannot price `run`'s layout, or "" (a pipeline of more stages
    than the model has layers, which nanotron runs with stages left empty)."""
    return unsuitable(MODELS[run.model], run.setup(), run.sequences, SEQ)


def price(run: GridRun, hw: Hardware | str = "H100") -> Priced:
    """The cost model's tokens per second per GPU and peak memory for `run`."""
    if why := problem(run):
        raise ValueError(f"{run.model} {run.label}: {why}")
    return _priced(run, hardware(hw))


def _priced(run: GridRun, hw: Hardware) -> Priced:
    """`price` for a run the cost model can express."""
    cost = step_cost(MODELS[run.model], run.setup(), hw, run.sequences, SEQ)
    tokens = run.sequences * SEQ / (run.nodes * GPUS_PER_NODE) / cost.step_time
    return Priced(run, tokens, cost.peak)


def priced(hw: Hardware | str = "H100", clean: bool = True) -> list[Priced]:
    """Every measured run the cost model can express, priced on `hw`; with `clean`, less
    the `anomalies`."""
    found, hw = runs(), hardware(hw)
    set_aside = anomalies(found) if clean else {}
    kept = (r for r in found if r.ok and r not in set_aside)
    return [_priced(r, hw) for r in kept if not problem(r)]


@dataclasses.dataclass(frozen=True)
class Group:
    """How well the predictions of one model's runs on one node count rank and match them."""

    model: str
    nodes: int
    runs: int
    rank: float
    """Spearman's rank correlation of predicted with measured tokens per second."""
    regret: float
    """The measured best over what the first pick measured: the run predicted fastest
    among those the planner would accept (`rank`)."""
    pick: GridRun
    best: float
    """The best tokens per second per GPU measured."""
    within: float
    """The share of runs predicted within `WITHIN`."""
    memory: float
    """The share of runs whose peak memory is predicted within `MEMORY`."""


MEMORY = 1.3
"""The factor within which a predicted peak memory counts as close."""


MIN_RUNS = 8
"""Groups with fewer runs are not ranked."""


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation of `a` and `b` (ties share their mean rank)."""

    def ranks(x: Sequence[float]) -> list[float]:
        order = sorted(range(len(x)), key=lambda i: x[i])
        found = [0.0] * len(x)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and x[order[j + 1]] == x[order[i]]:
                j += 1
            for k in range(i, j + 1):
                found[order[k]] = (i + j) / 2
            i = j + 1
        return found

    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb, strict=True))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den if den else 0.0


def rank(
    found: Iterable[Priced],
    memory: float | None = None,
    select: Callable[[GridRun], bool] | None = None,
) -> list[Group]:
    """Per model and node count with at least `MIN_RUNS` runs (of those `select` keeps):
    how the predictions rank and match the measured runs (`Group`), the first pick among
    the runs the planner would accept (a predicted peak that fits `memory` with the
    planner's `HEADROOM`; `memory` defaults to the H100's share for the fused ledger)."""
    if memory is None:
        h100 = hardware("H100")
        memory = h100.memory * shared(h100, "fused")
    groups: dict[tuple[str, int], list[Priced]] = defaultdict(list)
    for p in found:
        if select is None or select(p.run):
            groups[(p.run.model, p.run.nodes)].append(p)
    order = {name: i for i, name in enumerate(MODELS)}
    out = []
    for (model, nodes), members in sorted(groups.items(), key=lambda g: (order[g[0][0]], g[0][1])):
        if len(members) < MIN_RUNS:
            continue
        measured = [p.run.tokens for p in members]
        fitting = [p for p in members if p.peak * HEADROOM <= memory] or members
        pick = max(fitting, key=lambda p: p.tokens).run
        close = sum(1 / WITHIN <= p.ratio <= WITHIN for p in members) / len(members)
        held = sum(1 / MEMORY <= p.memory_ratio <= MEMORY for p in members) / len(members)
        out.append(
            Group(
                model,
                nodes,
                len(members),
                spearman([p.tokens for p in members], measured),
                max(measured) / pick.tokens,
                pick,
                max(measured),
                close,
                held,
            )
        )
    return out


SPLIT = ("median rank", "worst regret", "within 1.5x", "memory within 1.3x")
"""What `split` reports of a split's groups."""


def split(groups: Sequence[Group], fitted: bool) -> dict[str, float]:
    """Over the groups of the fit split (`fitted`) or of the test split: the median rank
    correlation, the worst regret, and the shares of runs within `WITHIN` and of memory
    within `MEMORY` (`SPLIT`)."""
    members = [g for g in groups if (g.nodes in FIT_NODES) == fitted]
    runs = sum(g.runs for g in members)
    values = (
        statistics.median(g.rank for g in members),
        max(g.regret for g in members),
        sum(g.within * g.runs for g in members) / runs,
        sum(g.memory * g.runs for g in members) / runs,
    )
    return dict(zip(SPLIT, values, strict=True))


FITTED = ("launch", "sync", "far_hop")
"""The `Hardware` fields the grid fits (`fit`)."""


def miss(hw: Hardware, found: Sequence[GridRun]) -> float:
    """The median factor (as its natural log) by which `hw`'s predictions miss `found`."""
    return statistics.median(abs(math.log(price(r, hw).ratio)) for r in found)


LATTICE = {
    "launch": (1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3),
    "sync": (3e-5, 1e-4, 2e-4, 3e-4, 4e-4, 6e-4, 1e-3),
    "far_hop": (1e-5, 2e-5, 4e-5, 8e-5, 1.6e-4),
}
"""Where `fit` starts: every combination of these values, in seconds."""


def fit(hw: Hardware | str = "H100") -> tuple[Hardware, float]:
    """`hw` with the `FITTED` fields that price the grid's fit runs best (the clean runs of
    `FIT_NODES`, by the median of how far each prediction misses, in log), its efficiency as
    it is (calibrated elsewhere: `nnxscale.evidence.gpu`), and that median miss. The search
    tries every point of `LATTICE`, then each field in turn at nine values over a factor of
    4, 2 and 1.4 around the best: deterministic, and under a minute on two cores."""
    hw = hardware(hw)
    set_aside = anomalies(runs())
    found = [r for r in runs() if r.ok and r.fit and not problem(r) and r not in set_aside]

    def tried(**values: float) -> tuple[float, Hardware]:
        trial = hw.replace(**values)
        return miss(trial, found), trial

    best, hw = min(
        (tried(**dict(zip(FITTED, point, strict=True))) for point in _points()),
        key=lambda pair: pair[0],
    )
    for span in (4.0, 2.0, 2.0**0.5):
        for name in FITTED:
            centre = getattr(hw, name)
            for k in range(-4, 5):
                value, trial = tried(**{name: centre * span ** (k / 4)})
                if value < best:
                    best, hw = value, trial
    return hw, best


def _points() -> list[tuple[float, ...]]:
    """Every combination of `LATTICE`'s values, in `FITTED`'s order."""
    points: list[tuple[float, ...]] = [()]
    for name in FITTED:
        points = [(*p, v) for p in points for v in LATTICE[name]]
    return points
