"""Times a cold build of the whole book and a no-change rebuild, with each chapter's execution time.

Run from the repository root: python benchmarks/build_time.py [--devices N]
Machines differ (the same chapter took 33 s alone on one 2-core machine and 64 s on another),
so the times are also given in the machine's unit: the seconds XLA:CPU takes to compile one
fixed, small train step written in plain JAX and optax (`UNIT_PROGRAM`: no nnxscale code, so
the unit cannot move with the library), the median of 3 fresh processes. The book's budgets
are in units (`CEILING`, benchmarks/ceiling.json): no chapter alone, and no cold build,
slower than at the start of issue 73, measured on one machine.

The build executes a chapter per core (book/_ext/nnxscale_book.py), so a chapter's time in
the build (jupyter-cache records it) is its wall time while another chapter runs beside it,
and those times add up to more than the build; afterwards each chapter is executed again
alone, in a fresh kernel, which is the time a reader's "Run all" takes and the one the ceiling
is for: once with the allocator the build gives its kernels (jemalloc where installed), once
with glibc's, which is what a kernel that Jupyter or Colab starts has. It measures; it asserts
nothing. With --record it writes the chapters' times in the build where the build reads them,
to start the longest chapter first; with --ceiling, this run's units as the new ceiling.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jupytext
from jupyter_cache import get_cache
from nbclient import NotebookClient

from nnxscale import launch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))
from nnxscale_book import faster_malloc  # noqa: E402  (the book's extension, not a package)

SECONDS = ROOT / "book" / "_ext" / "chapter_seconds.json"
CEILING = json.loads((ROOT / "benchmarks" / "ceiling.json").read_text())
"""Units each chapter alone (the build's allocator) and the cold build took at the start of
issue 73: the ceiling no change may cross (`--ceiling` writes it again, from this run)."""

UNIT_PROGRAM = """
import time
import jax, jax.numpy as jnp, optax

def block(p, x):
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    q, k, v = (h @ p[n] for n in ("q", "k", "v"))
    s = jnp.einsum("btd,bsd->bts", q, k) / 8.0
    s = jnp.where(jnp.tril(jnp.ones((x.shape[1],) * 2, bool)), s, -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s), v) @ p["o"]
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)
    return x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]

def loss(params, tokens):
    x = params["embed"][tokens[:, :-1]]
    for p in params["blocks"]:
        x = block(p, x)
    logits = x @ params["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

keys = iter(jax.random.split(jax.random.key(0), 64))
def w(*shape):
    return jax.random.normal(next(keys), shape) * 0.02
shapes = dict(q=(64, 64), k=(64, 64), v=(64, 64), o=(64, 64), gate=(64, 256), up=(64, 256),
              down=(256, 64))
params = {"embed": w(256, 64), "blocks": [{n: w(*s) for n, s in shapes.items()} for _ in range(8)]}
tx = optax.adamw(1e-3)

def step(params, state, tokens):
    value, grads = jax.value_and_grad(loss)(params, tokens)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

tokens = jnp.zeros((8, 129), jnp.int32)
lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), tokens)
start = time.perf_counter()
lowered.compile()
print(time.perf_counter() - start)
"""
"""The machine's unit: an eight-block Transformer's train step (RMSNorm, causal attention,
SwiGLU, AdamW) in plain JAX and optax, lowered and then compiled, the compile alone timed."""


def unit_seconds() -> float:
    """Seconds one fresh process takes to compile `UNIT_PROGRAM` on one CPU device, with XLA's
    own flags (none of the library's, nor an emulated device count)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "LD_PRELOAD")}
    env["JAX_PLATFORMS"] = "cpu"
    done = launch.run([sys.executable, "-c", UNIT_PROGRAM], env=env, timeout=600)
    if done.returncodes != [0]:
        raise RuntimeError(f"the unit program failed: {done.text[-2000:]}")
    return float(done.output[-1])


def machine_unit(runs: int = 3) -> float:
    """The machine's unit: the median of `runs` fresh processes' `unit_seconds`."""
    return statistics.median(unit_seconds() for _ in range(runs))


def build(*args: str, env: dict[str, str]) -> tuple[float, str]:
    """Seconds taken by `jupyter-book <args>` and its output; stops on failure."""
    command = [str(Path(sys.executable).with_name("jupyter-book")), *args]
    start = time.perf_counter()
    done = launch.run(command, cwd=ROOT, env=env, timeout=3600)
    return time.perf_counter() - start, done.text


def executed_in_the_build() -> list[tuple[str, float]]:
    """(chapter, seconds) of each chapter's execution in the last build, as jupyter-cache
    recorded them, in chapter order."""
    cache = get_cache(str(ROOT / "_build" / ".jupyter_cache"))
    times = {Path(r.uri).stem: r.data["execution_seconds"] for r in cache.list_cache_records()}
    return sorted(times.items())


def alone(chapter: str) -> float:
    """Seconds one chapter takes to execute by itself in a fresh kernel (this environment's)."""
    source = ROOT / "chapters" / f"{chapter}.md"
    notebook = jupytext.read(source)
    client = NotebookClient(
        notebook, timeout=600, resources={"metadata": {"path": str(source.parent)}}
    )
    start = time.perf_counter()
    client.execute(stderr=subprocess.DEVNULL)  # the kernel's start-up notices; errors still raise
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, help="emulated devices (default: NNXSCALE_DEVICES or 8)"
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help=f"write each chapter's time in this build to {SECONDS.relative_to(ROOT)}, the "
        "order in which later builds start the chapters (the longest first)",
    )
    parser.add_argument(
        "--ceiling",
        action="store_true",
        help="write this run's units to benchmarks/ceiling.json: the new ceiling (only when a "
        "change is meant to cost time, and the note says why)",
    )
    args = parser.parse_args()
    env = dict(os.environ)
    if args.devices:
        env["NNXSCALE_DEVICES"] = str(args.devices)
    unit = machine_unit()  # before the build, on an idle machine
    build("clean", "--all", ".", env=env)
    cold, _ = build("build", ".", env=env)
    chapters = executed_in_the_build()
    warm, warm_log = build("build", ".", env=env)
    executed = sum(seconds for _, seconds in chapters)
    if args.record:
        SECONDS.write_text(json.dumps({n: round(s, 1) for n, s in chapters}, indent=1) + "\n")

    os.environ.update(env)  # the kernels below inherit the device count
    preload = faster_malloc(os.environ)
    os.environ.update(preload)
    by_itself = [alone(name) for name, _ in chapters]
    os.environ["LD_PRELOAD"] = ""
    with_glibc = [alone(name) for name, _ in chapters]

    allocator = preload.get("LD_PRELOAD", "glibc")
    ceiling = CEILING["chapters"]
    print(f"devices: {env.get('NNXSCALE_DEVICES', '8')}   cores: {os.cpu_count()}")
    print(f"unit: {unit:.3f} s (UNIT_PROGRAM compiled; median of 3 fresh processes)")
    print(f"alone: with the build's allocator ({allocator}), and with glibc's")
    print(
        f"{'chapter':36} {'build s':>8} {'alone s':>8} {'units':>7} {'ceiling':>8} "
        f"{'glibc s':>8} {'units':>7}"
    )
    for (name, seconds), single, plain in zip(chapters, by_itself, with_glibc, strict=True):
        most = ceiling.get(name, float("nan"))
        print(
            f"{name:36} {seconds:8.1f} {single:8.1f} {single / unit:7.1f} {most:8.1f} "
            f"{plain:8.1f} {plain / unit:7.1f}"
        )
    total, total_glibc = sum(by_itself), sum(with_glibc)
    print(
        f"{'all chapters':36} {executed:8.1f} {total:8.1f} {total / unit:7.1f} {'':8} "
        f"{total_glibc:8.1f} {total_glibc / unit:7.1f}"
    )
    print(
        f"{'cold build (clean + build)':36} {cold:8.1f} s = {cold / unit:.1f} units "
        f"(ceiling {CEILING['cold build']:.1f})"
    )
    reran = re.search(r"executing (\d+) chapter", warm_log)
    reran = int(reran[1]) if reran else 0
    print(f"{'no-change rebuild':36} {warm:8.1f} s ({reran} chapters re-executed)")
    over = [
        f"{name} ({single / unit:.1f} > {ceiling[name]:.1f})"
        for (name, _), single in zip(chapters, by_itself, strict=True)
        if single / unit > ceiling.get(name, float("inf"))
    ]
    if cold / unit > CEILING["cold build"]:
        over.append(f"cold build ({cold / unit:.1f} > {CEILING['cold build']:.1f})")
    print(f"over the ceiling in units: {', '.join(over) or 'none'}")
    if args.ceiling:
        measured = {
            "unit seconds": round(unit, 3),
            "cold build": round(cold / unit, 1),
            "chapters": {
                n: round(s / unit, 1) for (n, _), s in zip(chapters, by_itself, strict=True)
            },
        }
        (ROOT / "benchmarks" / "ceiling.json").write_text(json.dumps(measured, indent=1) + "\n")


if __name__ == "__main__":
    main()
