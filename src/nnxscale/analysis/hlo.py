"""Analyses of a compiled program: its collectives (kinds, executions per call, bytes sent),
matrix-product FLOPs, the work of each branch of a conditional, its largest array.

Each reads the program through `nnxscale.program.Program` (XLA's own module and instruction
graph); what is parsed here is what an instruction's text alone holds: shapes, replica
groups, source-target pairs and contracting dimensions."""

from __future__ import annotations

import itertools
import math
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from jax.sharding import Mesh

from nnxscale.analysis.comm import KINDS, ring_bytes
from nnxscale.analysis.program import Instruction, Program
from nnxscale.core.show import table
from nnxscale.runtime.launch import run

SPECIAL_BITS = {"pred": 8, "token": 0}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([^\]]*)\]")
_IOTA = r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?"
_IOTA_GROUPS = re.compile(r"replica_groups=" + _IOTA)
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]([^{]*)\{([^}]*)\}")
_MESH_DEVICES = re.compile(r"device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\)")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape such as `f32[8,4]{1,0}` or a tuple `(f32[8], bf16[2,2])`."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d.strip()]
        total += math.prod(sizes) * dtype_bits(dtype) // 8
    return total


def dtype_bits(dtype: str) -> int:
    """Bits of an HLO element type: f32 -> 32, bf16 -> 16, f8e4m3fn -> 8, s4 -> 4, pred -> 8."""
    if dtype in SPECIAL_BITS:
        return SPECIAL_BITS[dtype]
    width = re.match(r"[a-z]+?(\d+)", dtype)
    if width is None:
        raise ValueError(f"unknown HLO element type {dtype!r}")
    return int(width.group(1))


def _ints(text: str | None) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()] if text else []


def _iota(dims: list[int], perm: list[int]) -> np.ndarray:
    """XLA's iota tile assignment: arange reshaped to `dims`, transposed by `perm` if given."""
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def _along(ids: np.ndarray, names: list[str], axes: list[str]) -> list[list[int]]:
    """Groups of the ids (an array shaped like a mesh) that differ only along `axes`."""
    chosen = [names.index(a) for a in axes]
    rest = [i for i in range(len(names)) if i not in chosen]
    size = math.prod(ids.shape[i] for i in chosen)
    return ids.transpose(rest + chosen).reshape(-1, size).tolist()


def _replica_groups(attributes: str, default: int) -> tuple[tuple[int, ...], ...]:
    """The device groups of a collective, from any of XLA's three spellings of replica_groups:
    explicit lists `{{0,2},{1,3}}`, iota `[2,2]<=[4]` (optionally transposed, `T(1,0)`), and
    mesh axes `mesh['x'=2,'y'=2] {'y'}`; one group of every device when there are none."""
    if mesh := _MESH_GROUPS.search(attributes):
        axes = re.findall(r"'([^']+)'=(\d+)", mesh.group(1))
        names, shape = [a for a, _ in axes], [int(s) for _, s in axes]
        order = _MESH_DEVICES.search(mesh.group(2))
        ids = _iota(_ints(order[1]), _ints(order[2])) if order else np.arange(math.prod(shape))
        axes = re.findall(r"'([^']+)'", mesh.group(3))
        return tuple(map(tuple, _along(ids.reshape(shape), names, axes)))
    if iota := _IOTA_GROUPS.search(attributes):
        groups = _iota(_ints(iota[2]), _ints(iota[3])).reshape(_ints(iota[1]))
        return tuple(map(tuple, groups.tolist()))
    if listed := _LIST_GROUPS.search(attributes):
        groups = tuple(tuple(_ints(g)) for g in re.findall(r"\{([\d,]*)\}", listed[1]))
        if groups and groups[0]:
            return groups
    return (tuple(range(default)),)


def axis_groups(mesh: Mesh, axes: tuple[str, ...]) -> set[frozenset[int]]:
    """The groups of devices (as positions in the mesh, XLA's partition ids) along `axes`."""
    ids = np.arange(mesh.size).reshape(tuple(mesh.shape.values()))
    return {frozenset(g) for g in _along(ids, list(mesh.axis_names), list(axes))}


def _sends(kind: str, attributes: str) -> bool:
    """Whether any device sends to another: a permute whose pairs all read {i,i} moves nothing."""
    pairs = _PAIRS.search(attributes) if kind == "collective-permute" else None
    return pairs is None or any(a != b for a, b in re.findall(r"\{(\d+),(\d+)\}", pairs[1]))


def largest_array(program: object) -> tuple[int, str]:
    """Bytes and name of the largest array any instruction of a compiled program produces.

    In an SPMD-partitioned program every shape is per device, so this bounds what one device
    ever holds in a single buffer: evidence that no device materialises an unsharded array.
    """
    sizes = [
        (max(shape_bytes(f"{d}[{dims}]") for d, dims in arrays), f"{name}: {ins.name}")
        for name, ins in Program.of(program).instructions()
        if (arrays := _ARRAY.findall(ins.shape))
    ]
    return max(sizes) if sizes else (0, "")


def result_types(program: object) -> dict[str, int]:
    """How many instructions of a compiled program produce each element type (f32, bf16, ...).

    Evidence of the precision a program computes in: a bfloat16 model shows bf16 results.
    """
    found: dict[str, int] = {}
    for _, ins in Program.of(program).instructions():
        for dtype in {d for d, _ in _ARRAY.findall(ins.shape)}:
            found[dtype] = found.get(dtype, 0) + 1
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program and how often one call runs it."""

    kind: str
    name: str
    computation: str
    result_bytes: int
    groups: tuple[tuple[int, ...], ...]
    executions: int
    sends: bool = True
    shape: str = ""
    """The HLO shape of its result, e.g. `f32[16,32,64]{2,1,0}` (what the array is)."""
    readers: tuple[str, ...] = ()
    """The result shapes of the instructions that read its result: an all-reduce read only
    into this device's slice is a reduce-scatter in all-reduce form."""

    @property
    def group_size(self) -> int:
        """Devices in each of its groups (the N of the ring formulas)."""
        return len(self.groups[0])

    def mesh_axes(self, mesh: Mesh) -> tuple[str, ...] | None:
        """The mesh axes the collective runs over (its groups are the devices along them):
        the fewest axes that match, in mesh order; None if no set of axes does."""
        found = {frozenset(g) for g in self.groups}
        names = mesh.axis_names
        for count in range(1, len(names) + 1):
            for axes in itertools.combinations(names, count):
                if axis_groups(mesh, axes) == found:
                    return axes
        return None

    @property
    def arrays(self) -> tuple[tuple[int, ...], ...]:
        """The dimensions of each array in its result (several when it works on a tuple): what
        a chapter matches against the arrays it expects, e.g. a weight's shard."""
        return tuple(tuple(_ints(dims)) for _, dims in _ARRAY.findall(self.shape))

    @property
    def dtypes(self) -> tuple[str, ...]:
        """The element type of each array in its result: `f32`, `bf16`, `s32`, ..."""
        return tuple(dtype for dtype, _ in _ARRAY.findall(self.shape))

    @property
    def signature(self) -> str:
        """Its arrays as HLO writes their types, without layouts: `f32[16,32,64]`."""
        return ", ".join(f"{dtype}[{dims}]" for dtype, dims in _ARRAY.findall(self.shape))

    @property
    def reader_arrays(self) -> tuple[tuple[int, ...], ...]:
        """The dimensions of every array the instructions that read its result produce: an
        all-reduce read only into this device's slice is a reduce-scatter in all-reduce form."""
        return tuple(tuple(_ints(dims)) for r in self.readers for _, dims in _ARRAY.findall(r))

    @property
    def array_bytes(self) -> int:
        """Bytes of the full array the ring formula takes (a reduce-scatter's input)."""
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def sent_bytes(self) -> float:
        """Bytes each device sends per call of the program, loop trip counts included."""
        if not self.sends:  # a permute from every device to itself
            return 0.0
        return self.executions * ring_bytes(self.kind, self.array_bytes, self.group_size)


def arrays_moved(found: Iterable[Collective]) -> Counter[tuple[int, ...]]:
    """How often one call moves an array of each shape through `found`, loops included: what
    a chapter matches against the arrays a formula names."""
    return Counter(a for c in found for a in c.arrays * c.executions)


def _flags(collective: Collective) -> bool:
    """Whether `collective` moves booleans alone."""
    return set(collective.dtypes) == {"pred"}


class CollectiveReport:
    """The collectives of one compiled program: counts and bytes per kind."""

    def __init__(self, collectives: list[Collective], num_partitions: int) -> None:
        self.collectives = collectives
        self.num_partitions = num_partitions

    def _select(self, kind: str | None) -> Iterator[Collective]:
        if kind is not None and kind not in KINDS:
            raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(KINDS)}")
        return (c for c in self.collectives if kind is None or c.kind == kind)

    def count(self, kind: str | None = None) -> int:
        """How many collectives (of `kind`) one call of the program executes."""
        return sum(c.executions for c in self._select(kind))

    def array_bytes(self, kind: str | None = None) -> int:
        """Bytes of the arrays the collectives (of `kind`) work on per call: the P of the ring
        formulas, read off the program's shapes (an exact integer, unlike `bytes`)."""
        return sum(c.executions * c.array_bytes for c in self._select(kind))

    def bytes(self, kind: str | None = None) -> float:
        """Bytes each device sends in collectives (of `kind`) per call, by the ring formulas."""
        return sum(c.sent_bytes for c in self._select(kind))

    def along(self, mesh: Mesh, kind: str, axes: tuple[str, ...]) -> list[Collective]:
        """The collectives of `kind` whose groups run along exactly the mesh `axes`."""
        return [c for c in self._select(kind) if c.mesh_axes(mesh) == axes]

    def by_axes(self, mesh: Mesh) -> dict[tuple[str, tuple[str, ...] | None], int]:
        """Array bytes per call for each (kind, mesh axes it runs over): where the bytes go."""
        groups: dict[tuple[str, tuple[str, ...] | None], int] = {}
        for c in self.collectives:
            key = (c.kind, c.mesh_axes(mesh))
            groups[key] = groups.get(key, 0) + c.executions * c.array_bytes
        return groups

    def across_processes(self, mesh: Mesh) -> CollectiveReport:
        """The collectives some group of which holds devices of more than one process: those
        that cross the slow network between hosts."""
        owner = [d.process_index for d in mesh.devices.flat]  # by position: partition ids
        kept = [
            c for c in self.collectives if any(len({owner[i] for i in g}) > 1 for g in c.groups)
        ]
        return CollectiveReport(kept, self.num_partitions)

    def flags(self) -> CollectiveReport:
        """The collectives that move booleans (`pred`) alone: the training step's guard, in
        which the devices agree whether every gradient is finite (a flag for each gradient
        array split over them; `nnxscale.train.train_step`)."""
        return CollectiveReport([c for c in self.collectives if _flags(c)], self.num_partitions)

    def without_flags(self) -> CollectiveReport:
        """The collectives that move the model's numbers: all but `flags`."""
        kept = [c for c in self.collectives if not _flags(c)]
        return CollectiveReport(kept, self.num_partitions)

    def summary(self) -> dict[str, tuple[int, float]]:
        """(executions, bytes sent per device) for each kind that occurs."""
        return {k: (self.count(k), self.bytes(k)) for k in KINDS if self.count(k)}

    def _repr_markdown_(self) -> str:
        if not self.collectives:
            return "no collectives"
        rows = [[k, n, b] for k, (n, b) in self.summary().items()]
        return str(table(["collective", "executions per call", "bytes sent per device"], rows))

    def __repr__(self) -> str:
        parts = ", ".join(f"{k}: {n} x, {b:,.0f} B" for k, (n, b) in self.summary().items())
        return f"CollectiveReport({parts or 'no collectives'})"


def collectives(program: object) -> CollectiveReport:
    """Collectives of a compiled program (a `jax.stages.Compiled` or HLO text).

    A collective inside a while loop (a scan) counts once per iteration, using the trip count
    XLA records on the loop (a loop without one counts once); an async start/done pair counts
    once, with the done's result; a collective in a branch of a conditional counts as if its
    branch ran.
    """
    read = Program.of(program)
    found: dict[tuple[str, str], Collective] = {}
    for name, ins, executions in read.walk():
        kind = ins.opcode.removesuffix("-start")
        if kind not in KINDS or ins.opcode.endswith("-done"):
            continue
        computation = read.computations[name]
        done = next(
            (computation[u] for u in ins.users if computation[u].opcode.endswith("-done")), ins
        )
        key = (name, ins.name)
        previous = found.get(key)
        found[key] = Collective(
            kind=kind,
            name=ins.name,
            computation=name,
            result_bytes=shape_bytes(done.shape),
            groups=_replica_groups(ins.attributes, read.partitions),
            executions=executions + (previous.executions if previous else 0),
            sends=_sends(kind, ins.attributes),
            shape=done.shape,
            readers=tuple(computation[u].shape for u in done.users),
        )
    return CollectiveReport(list(found.values()), read.partitions)


_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_GEMM_CONTRACTING = re.compile(r'"lhs_contracting_dimensions"\s*:\s*\[([^\]]*)\]')


def gemm_flops(ins: Instruction, computation: Mapping[str, Instruction]) -> int:
    """2 x the output's elements x the contracted size of one dot, or of a library call that
    is one (a GPU's `__cublas$gemm` custom call, its dimensions in its backend config); 0
    for any other instruction."""
    if ins.opcode == "dot":
        found, shape = _CONTRACTING.search(ins.attributes), ins.shape
    elif ins.opcode == "custom-call":
        found, shape = _GEMM_CONTRACTING.search(ins.attributes), ins.shape.lstrip("(")
    else:
        return 0
    if found is None or ins.operands[0] not in computation:
        return 0
    dims = _ints(_ARRAY.findall(computation[ins.operands[0]].shape)[0][1])
    contracted = math.prod(dims[i] for i in _ints(found[1].replace('"', "")))
    return 2 * math.prod(_ints(_ARRAY.findall(shape)[0][1])) * contracted


def _dots(read: Program, start: str | None = None) -> Iterator[tuple[int, int]]:
    """(executions, FLOPs) of every matrix product a call of the program (or of `start`)
    runs: each dot, and each library call that is one."""
    for name, ins, executions in read.walk(start):
        flops = gemm_flops(ins, read.computations[name])
        if flops:
            yield executions, flops


def dot_flops(program: object) -> int:
    """FLOPs of the matrix products a compiled program runs per call: 2 x the output's
    elements x the contracted size, for every dot, loop trip counts included.

    Elementwise work is left out, which is what the 6 N T formula counts; XLA's own
    `cost_analysis()` adds it, and counts a loop's body once whatever its trip count.
    """
    return sum(executions * flops for executions, flops in _dots(Program.of(program)))


@dataclass(frozen=True)
class BranchWork:
    """What one branch of a conditional runs each time it is taken."""

    flops: int  # of its matrix products, as `dot_flops` counts them
    opcodes: Counter[str]  # how often each HLO opcode runs, loops included


def branch_work(program: object) -> list[BranchWork]:
    """The work of each branch of the program's conditional with the most branches (a
    `lax.switch`), in branch order: which branch computes what, read off the compiled code."""
    read = Program.of(program)
    conditionals = [
        [callee for role, callee in ins.callees() if role == "branch"]
        for _, ins, _ in read.walk()
        if ins.opcode == "conditional"
    ]
    if not conditionals:
        raise ValueError("the program has no conditional (no lax.switch or lax.cond)")
    work = []
    for branch in max(conditionals, key=len):
        opcodes = Counter()
        for _, ins, executions in read.walk(branch):
            opcodes[ins.opcode] += executions
        work.append(BranchWork(sum(e * f for e, f in _dots(read, branch)), opcodes))
    return work


_PASS_PROGRAM = """
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
n = jax.device_count()
mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
def summed(a):
    return a.sum(0)
rows = jax.device_put(jnp.ones((n, 4 * n)), NamedSharding(mesh, P("x")))
jax.jit(summed, out_shardings=NamedSharding(mesh, P("x"))).lower(rows).compile()
"""
_STEP = re.compile(r"^module_\d+\.jit_summed\.(\d+)\.[^.]+\.after_([\w\-]+)")


@dataclass(frozen=True)
class PassDump:
    """What one XLA backend's compiler did to a program, from XLA's own dump: every pass that
    changed it, in order, with the module it left, and the program it made."""

    platform: str
    steps: tuple[tuple[str, str], ...]
    """(pass, the module's HLO text after it), for each pass that changed the module."""
    program: str

    @property
    def passes(self) -> tuple[str, ...]:
        """The passes that changed the program, in the order they ran (once each)."""
        return tuple(dict.fromkeys(name for name, _ in self.steps))


def compiler_passes(platform: str = "cpu", devices: int = 4) -> PassDump:
    """The passes XLA's `platform` compiler runs on a sum over devices that each device keeps
    a slice of (an all-reduce then a slice: the pattern a reduce-scatter creator rewrites),
    with the module after each that changed it, read from XLA's dump (`--xla_dump_to`,
    `--xla_dump_hlo_pass_re`) of a fresh process, so this one's JAX is untouched, and which
    compiles even where a persistent compilation cache holds the program."""
    with tempfile.TemporaryDirectory(prefix="nnxscale-passes-") as where:
        flags = (
            f"--xla_force_host_platform_device_count={devices} --xla_dump_to={where} "
            "--xla_dump_hlo_pass_re=.* --xla_dump_hlo_module_re=summed"
        )
        # a persistent compilation cache would hand the program back uncompiled: no dump
        env = {"JAX_PLATFORMS": platform, "XLA_FLAGS": flags, "JAX_ENABLE_COMPILATION_CACHE": "0"}
        done = run([sys.executable, "-c", _PASS_PROGRAM], env=env, check=False)
        if done.returncodes != [0]:
            raise RuntimeError(f"compiling on {platform} failed:\n{done.text[-2000:]}")
        files = {path.name: path for path in Path(where).iterdir()}
        steps = sorted(
            (int(found[1]), found[2], path.read_text())
            for name, path in files.items()
            if (found := _STEP.match(name)) and found[2] != "pipeline-start"
        )
        final = [path for name, path in files.items() if name.endswith("_after_optimizations.txt")]
        if not steps or len(final) != 1:
            raise RuntimeError(f"XLA dumped no passes for the program: {sorted(files)[:10]}")
        return PassDump(platform, tuple((p, text) for _, p, text in steps), final[0].read_text())
