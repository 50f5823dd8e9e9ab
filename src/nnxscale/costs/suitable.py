"""Whether a setup can run a model and batch as the cost model prices it, and if not why:
each refusal names the problem (an axis that does not divide a size, a batch that does not
split, a schedule that needs more micro-batches) and what would fix it."""

from __future__ import annotations

import math

from nnxscale.costs.activations import mixture
from nnxscale.costs.counts import Setup, mixture_problem, sizes_of
from nnxscale.costs.coverage import unpriced
from nnxscale.costs.derive import Costs, derive, unledgered
from nnxscale.model.config import Config, remat_policy


def derive_for(cfg: Config, setup: Setup) -> Costs:
    """`derive` for the model `cfg` under `setup`: its rule set, compute dtype, remat
    policy, kind of MLP, schedule, reductions and ledger."""
    return derive(
        setup.rules,
        cfg.compute_dtype,
        setup.remat,
        mixture(cfg),
        setup.schedule,
        setup.reduce_once,
        setup.ledger,
        setup.loss,
        setup.regather,
    )


def unsuitable(cfg: Config, setup: Setup, batch: int, seq: int) -> str:
    """Why `setup` cannot run this model and batch as the cost model prices it, or ""."""
    why = mixture_problem(cfg) or unpriced(setup.rules, mixture(cfg), setup.schedule)
    why = why or unledgered(setup.rules, setup.schedule, setup.ledger)
    if why:
        return why
    costs = derive_for(cfg, setup)
    sizes = sizes_of(cfg, setup, batch, seq)
    flat = set(costs.batch_axes) if setup.flat else set()
    for size, axes in costs.splits:
        n = math.prod(setup.sizes[a] for a in axes)
        if set(axes) <= flat:  # flat, padded buffers over the batch's axes (`Setup.flat`)
            continue
        if sizes[size] % n and size != "layers":  # a pipeline's stages are padded
            name = "x".join(axes)
            return f"the {name} axis ({n}) does not divide {size} ({sizes[size]})"
    split = math.prod(setup.sizes[a] for a in costs.batch_axes)
    if batch % (split * setup.micro_batches):
        parts = f"{setup.micro_batches} micro-batches x {split} devices"
        return f"the batch of {batch} sequences does not split into {parts}"
    ring = setup.sizes.get(costs.ring_axis, 1) if costs.ring_axis else 1
    if costs.ring_axis and ring < 2:
        return f"a context ring needs 2 or more devices on {costs.ring_axis!r}, not {ring}"
    if seq % (2 * ring):
        return f"{seq} tokens do not cut into 2 x {ring} chunks for the zig-zag ring"
    if seq > cfg.max_len:
        return f"sequences of {seq} tokens exceed the model's max_len ({cfg.max_len})"
    stages = setup.sizes.get(costs.stage_axis, 1) if costs.stage_axis else 1
    if setup.micro_batches < stages and setup.schedule != "1F1B":
        return (
            f"{stages} stages need at least {stages} micro-batches on the {setup.schedule} "
            "schedule (1F1B runs fewer, idling (p - 1) / (m + p - 1) of its step)"
        )
    if setup.schedule.startswith("ZB") and remat_policy(setup.remat) == "full":
        return (
            f"{setup.schedule} defers each W, which reads its products' inputs kept from B; "
            "full remat rebuilds them inside B and would hold them until W: use remat='dots' "
            "or none"
        )
    if setup.schedule == "ZB-V" and setup.micro_batches < 2 * stages - 1:
        return (
            f"ZB-V on {stages} stages fills its V with 2p - 1 = {2 * stages - 1} micro-batches, "
            f"not {setup.micro_batches}: use more, or 1F1B or ZB-H1"
        )
    if setup.schedule == "1F1B" and setup.virtual > 1 and setup.micro_batches % stages:
        return (
            f"interleaved 1F1B needs micro-batches ({setup.micro_batches}) a multiple of the "
            f"stages ({stages})"
        )
    if cfg.layers < stages * setup.virtual:
        return f"{cfg.layers} layers do not fill {stages} stages x {setup.virtual} virtual stages"
    return ""
