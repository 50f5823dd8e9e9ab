"""FSDP by hand with `jax.shard_map`: every collective explicit, one layer gathered at a time.

Chapter 4 let the compiler turn an FSDP layout into collectives. Here the program each device
runs is written out. A device holds 1/N of every parameter (split along the dimension the FSDP
rule set picks); it all-gathers a layer's weights just before the layer runs, inside a scan
over the stacked layers, and drops them after. Its gradients arrive as 1/N shards by
reduce-scatter, which nobody writes: the transpose of `all_gather` is `psum_scatter`, so
differentiating through the gathers produces it. The backward pass either gathers the weights
again (a remat policy that saves everything except them) or keeps them (the scan saves them:
less communication, every layer's weights in memory at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import print_saved_residuals
from jax.extend.core import Primitive
from jax.sharding import Mesh, PartitionSpec

from nnxscale.analysis.comm import GATHERED, gather_tree
from nnxscale.model.config import Config
from nnxscale.model.losses import GradsFn
from nnxscale.model.transformer import Transformer, create
from nnxscale.placement.catalogue import FSDP
from nnxscale.placement.init import abstract
from nnxscale.placement.layout import resolve
from nnxscale.placement.rules import Rules


@dataclasses.dataclass(frozen=True)
class Options:
    """How to gather: per layer or all up front; again in the backward pass or kept; prefetched."""

    per_layer: bool = True
    regather: bool = True
    prefetch: bool = False
    axis: str = "data"

    def __post_init__(self) -> None:
        if self.prefetch and (self.regather or not self.per_layer):
            raise ValueError(
                "prefetch carries the next layer's gathered weights from one scan iteration to "
                "the next, and a scan saves its carries for the backward pass, so it keeps the "
                "weights: use Options(prefetch=True, regather=False)."
            )


def save_all_but_gathered(primitive: Primitive, *_: object, **params: object) -> bool:
    """Remat policy: save every value the backward pass needs except the gathered weights.

    Both the all-gather's output and its named alias must be refused, or the backward pass
    reads a saved copy instead of gathering again. (In JAX 0.10.2 to 0.12,
    `save_anything_except_these_names` returns True for every value, named ones included.)
    """
    return primitive.name != "all_gather" and params.get("name") != GATHERED


def saved_for_backward(f: Callable[..., jax.Array], *args: object) -> list[str]:
    """What the backward pass of scalar `f` reads from memory: one line per saved value."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(f, *args)
    return out.getvalue().splitlines()


def run_layers(
    blocks: nnx.Module, specs: nnx.State, x: jax.Array, keys: jax.Array | None, options: Options
) -> jax.Array:
    """The stacked blocks applied to `x`, this device's rows, gathering as `options` say."""
    graphdef, shards, rest = nnx.split(blocks, nnx.Param, ...)
    layer_specs = jax.tree.map(lambda s: PartitionSpec(*tuple(s)[1:]), specs)  # minus `layers`
    layers = jax.tree.leaves(shards)[0].shape[0]
    keys = jnp.arange(layers) if keys is None else keys  # scanned over; unused without dropout
    drop = jnp.issubdtype(keys.dtype, jax.dtypes.prng_key)

    def apply(weights: nnx.State, h: jax.Array, key: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, weights, rest)(h, key if drop else None)

    def gather_and_apply(h: jax.Array, layer_shards: nnx.State, key: jax.Array) -> jax.Array:
        return apply(gather_tree(layer_shards, layer_specs, options.axis), h, key)

    if not options.per_layer:  # for comparison: every layer gathered before the first runs
        weights = gather_tree(shards, specs, options.axis)
        return jax.lax.scan(lambda h, xs: (apply(xs[0], h, xs[1]), None), x, (weights, keys))[0]
    if options.prefetch:  # gather layer i + 1 while layer i runs
        first = gather_tree(jax.tree.map(lambda a: a[0], shards), layer_specs, options.axis)

        def ahead(carry: tuple[jax.Array, nnx.State], xs: tuple[nnx.State, jax.Array]):
            h, current = carry
            upcoming = gather_tree(xs[0], layer_specs, options.axis)
            return (apply(current, h, xs[1]), upcoming), None

        following = jax.tree.map(lambda a: a[1:], shards)
        (h, last), _ = jax.lax.scan(ahead, (x, first), (following, keys[:-1]))
        return apply(last, h, keys[-1])
    if options.regather:  # the backward pass runs the gathers again instead of keeping them
        gather_and_apply = jax.checkpoint(gather_and_apply, policy=save_all_but_gathered)
    return jax.lax.scan(lambda h, xs: (gather_and_apply(h, *xs), None), x, (shards, keys))[0]


def local_loss(
    params: nnx.State,
    graphdef: nnx.GraphDef,
    rest: nnx.State,
    specs: nnx.State,
    tokens: jax.Array,
    key: jax.Array | None,
    options: Options,
) -> jax.Array:
    """This device's share of the batch's mean loss: the mean over its rows, over N devices."""
    outer = nnx.State({k: v for k, v in params.items() if k != "blocks"})
    outer = gather_tree(
        outer, nnx.State({k: v for k, v in specs.items() if k != "blocks"}), options.axis
    )
    weights = nnx.State({**outer, "blocks": params["blocks"]})  # blocks are gathered per layer
    model: Transformer = nnx.merge(graphdef, weights, rest)
    keys = None
    if key is not None:  # each device draws the dropout masks of its own rows
        keys = model.layer_keys(jax.random.fold_in(key, jax.lax.axis_index(options.axis)))

    def gathering(model: Transformer, x: jax.Array, keys: jax.Array | None) -> tuple:
        return run_layers(model.blocks, specs["blocks"], x, keys, options), None

    return model.loss(tokens, keys, gathering) / jax.lax.axis_size(options.axis)


def loss_and_grads(
    model: Transformer,
    batch: jax.Array,
    key: jax.Array | None,
    micro_batches: int = 1,
    *,
    mesh: Mesh,
    rules: Rules = FSDP,
    options: Options = Options(),
) -> tuple[jax.Array, nnx.State]:
    """Loss and gradients of `model` on `batch` by hand-written FSDP over `options.axis`.

    The parameters are laid out by `rules` (FSDP) and the model scans its layers; the
    gradients come back in the parameters' layout. With dropout, each device draws its own
    rows' masks, so losses differ from `train.loss_and_grads` by the masks, not the method.
    """
    if not model.cfg.scan_layers:
        raise ValueError("hand-written FSDP gathers inside a scan: use Config(scan_layers=True)")
    if micro_batches != 1:
        raise ValueError("hand-written FSDP takes the whole batch: use micro_batches=1")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    specs = resolve(params, rules, mesh).specs

    def per_device(params: nnx.State, tokens: jax.Array, key: jax.Array | None):
        loss, grads = jax.value_and_grad(local_loss)(
            params, graphdef, rest, specs, tokens, key, options
        )
        return jax.lax.psum(loss, options.axis), grads

    in_specs = (specs, PartitionSpec(options.axis, None), None if key is None else PartitionSpec())
    return jax.shard_map(
        per_device, mesh=mesh, in_specs=in_specs, out_specs=(PartitionSpec(), specs)
    )(params, batch, key)


def grads_fn(mesh: Mesh, options: Options = Options(), rules: Rules = FSDP) -> GradsFn:
    """`loss_and_grads` bound to a mesh and options, for `Trainer.create(grads_fn=...)`."""
    return partial(loss_and_grads, mesh=mesh, rules=rules, options=options)


def layer_bytes(cfg: Config) -> list[int]:
    """Bytes of each layer's weights, whole: what FSDP gathers before the layer runs (read off
    the abstract model, no memory), the sizes a per-layer FSDP timeline is drawn with."""
    model = abstract(lambda: create(cfg))
    sizes = [0] * cfg.layers
    for path, variable in nnx.to_flat_state(nnx.state(model.blocks, nnx.Param)):
        value = variable.get_value()  # a shape and dtype: the model is abstract
        nbytes = math.prod(value.shape) * jnp.dtype(value.dtype).itemsize
        if cfg.scan_layers:  # one array per weight, its first dimension the layers
            sizes = [size + nbytes // cfg.layers for size in sizes]
        else:
            sizes[int(path[0])] += nbytes
    return sizes


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """How many of a scan's inputs are constants, and how many the carry that follows them:
    since JAX 0.12 a scan's equation holds the three groups (constants, carry, stacked inputs)
    as one tree, `ft_in`, where earlier releases gave the counts (`num_consts`, `num_carry`)."""
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts)), len(list(carry))


def loop_carries(f: Callable[..., Any], *args: Any) -> list[int]:
    """Bytes each scan of `f`'s program carries from one iteration to the next, in program
    order (scans nested in `jit`, `shard_map` or another scan included): what a loop holds
    across its iterations besides what it reads and writes of its stacked inputs and outputs."""
    carried: list[int] = []

    def visit(jaxpr: Any) -> None:
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "scan":
                first, count = scan_counts(eqn.params)
                avals = eqn.params["jaxpr"].in_avals[first : first + count]
                carried.append(sum(math.prod(a.shape) * a.dtype.itemsize for a in avals))
            for param in eqn.params.values():
                for inner in param if isinstance(param, list | tuple) else [param]:
                    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's own
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(jax.make_jaxpr(f)(*args).jaxpr)
    return carried
