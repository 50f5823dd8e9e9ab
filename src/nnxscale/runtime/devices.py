"""Emulated devices: ask for N CPU devices before JAX's backend starts."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

DEVICES_ENV = "NNXSCALE_DEVICES"
DEFAULT_DEVICES = 8
NATIVE = "native"
MINIMUM_NATIVE = 2
"""Fewer native devices than this and nothing is distributed: `native` then emulates instead."""


FAST_COMPILE = {"xla_backend_optimization_level": 0}
"""Compiler options for programs compiled to be read more than run: the backend's (LLVM's)
optimisations off, which shortens compiling. The program's HLO, collectives
and products are as they are; its temporaries differ by a few hundred bytes (at most 1 KiB
either way, a test compares both ways). Emulated CPU devices compile every program this way
unless asked not to (`emulate_devices`)."""

OPTIMIZED = {"xla_backend_optimization_level": 3}
"""XLA's own default for the option `FAST_COMPILE` sets: for a program that is timed, on
emulated devices that compile fast by default."""


class EmulationTooLateError(RuntimeError):
    """JAX's backend started before the devices could be emulated."""


MAX_EMULATED = 256
"""The most CPU devices `emulate_devices` makes: 1024 took over a minute for one sum here."""


def requested_devices(value: int | str | None = None) -> int | None:
    """Emulated device count asked for: argument, else $NNXSCALE_DEVICES, else 8; None if native."""
    raw = os.environ.get(DEVICES_ENV, str(DEFAULT_DEVICES)) if value is None else value
    if isinstance(raw, str) and raw.strip().lower() == NATIVE:
        return None
    try:  # a whole number, as an int or a string; never a float, which int() would cut
        count = int(raw) if isinstance(raw, str | int) and not isinstance(raw, bool) else 0
    except ValueError:
        count = 0
    if count < 1:
        where = f"{DEVICES_ENV}={raw!r}" if value is None else f"device count {raw!r}"
        raise ValueError(
            f"{where} is not a device count: use a positive integer such as 8 "
            f"(emulated CPU devices) or {NATIVE!r} (the accelerators JAX finds, no emulation)."
        )
    if count > MAX_EMULATED:
        where = f"{DEVICES_ENV}={raw!r}" if value is None else f"device count {raw!r}"
        raise ValueError(
            f"{where}: at most {MAX_EMULATED} devices are emulated. Each is a set of threads "
            "and buffers on this machine's CPU cores, so thousands take minutes to start and "
            "can exhaust memory. To plan a mesh of that size without devices, use "
            "jax.sharding.AbstractMesh, or the planner (nnxscale.plan)."
        )
    return count


def _backend_started() -> bool:
    """Whether JAX has created its backends (after which the device count is fixed)."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def native_devices() -> tuple[int, str, str]:
    """How many devices JAX finds on its own, their platform (`gpu`) and the name its backend
    is registered under (`cuda`, what `jax_platforms` takes), asked of a fresh process (so
    that this one can still choose to emulate)."""
    probe = (
        "import jax; from jax._src import xla_bridge as xb; d = jax.devices(); "
        "name = next((k for k, b in xb.backends().items() if b is d[0].client), d[0].platform); "
        "print('found', len(d), d[0].platform, name)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=600, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(
            f"JAX could not start on its own devices ({DEVICES_ENV}={NATIVE}):\n"
            f"{(done.stdout + done.stderr)[-2000:]}\nSet {DEVICES_ENV} to a count, such as 8, "
            "to emulate CPU devices instead."
        )
    found = next(line for line in done.stdout.splitlines() if line.startswith("found "))
    _, count, platform, name = found.split()
    return int(count), platform, name


def fast_compile_flags(flags: str) -> str:
    """`flags` (an `XLA_FLAGS` value) with the options of `FAST_COMPILE` added
    as the process's defaults, except those `flags` already sets (the reader's choice wins)."""
    given = {word.split("=", 1)[0].lstrip("-") for word in flags.split()}
    added = [
        f"--{name}={str(value).lower()}"
        for name, value in FAST_COMPILE.items()
        if name not in given
    ]
    return " ".join([*flags.split(), *added])


def emulate_devices(count: int | str | None = None, *, optimize: bool = False) -> int | None:
    """Make JAX see `count` CPU devices (default $NNXSCALE_DEVICES or 8); call before any JAX work.

    Forces the CPU platform, so that a Colab GPU runtime also gets the emulated devices.
    With `native`, JAX uses the accelerators it finds, unless there are fewer than two (a
    one-GPU runtime): with one device nothing is distributed, so it emulates 8 CPU devices
    instead and says so, and keeps the accelerator beside them (`jax.devices("gpu")`, not
    the default) for what runs on one device, such as a profile. Calling it again with the
    same count is harmless; asking for another count after JAX started raises
    EmulationTooLateError, which says to restart the runtime.
    Returns the emulated count, or None when JAX uses the devices it found.

    Emulated devices compile every program with `FAST_COMPILE` (`XLA_FLAGS`,
    which the processes this one starts inherit): the book's programs are small, so compiling
    them takes longer than running them, and the backend's optimisations off compile each
    2 to 3 times faster. `optimize=True` keeps XLA's defaults, for programs that are timed;
    a program can also ask for them (`compiler_options=nnxscale.devices.OPTIMIZED`). Python's
    garbage collector is told to scan less (`collect_less`), which speeds up tracing.
    """
    wanted, beside = requested_devices(count), None
    if wanted is None:
        if _backend_started():
            import jax

            emulated = jax.config.jax_num_cpu_devices
            return emulated if jax.devices()[0].platform == "cpu" and emulated > 0 else None
        found, platform, backend = native_devices()
        if found >= MINIMUM_NATIVE:
            return None
        wanted = DEFAULT_DEVICES
        beside = backend if platform != "cpu" else None
        print(
            f"JAX finds {found} {platform} device(s) here, and with one device nothing is "
            f"distributed: this notebook runs on {wanted} emulated CPU devices instead"
            + (f", with the {platform} beside them as jax.devices({platform!r})" if beside else "")
            + f". For another count set {DEVICES_ENV} (1 to 16) and restart."
        )
    import jax

    if _backend_started():
        have = jax.devices()
        if len(have) == wanted and have[0].platform == "cpu":
            return wanted
        raise EmulationTooLateError(
            f"JAX already started with {len(have)} {have[0].platform} device(s), so {wanted} "
            "emulated CPU devices can no longer be created: the device count is fixed when JAX "
            "first touches a device. Restart the runtime (Colab: Runtime > Restart session; "
            "Jupyter: Kernel > Restart) and run the setup cell before anything else."
        )
    if not optimize:
        os.environ["XLA_FLAGS"] = fast_compile_flags(os.environ.get("XLA_FLAGS", ""))
    if beside:  # the CPU devices first, so they are the default; the accelerator idles
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax.config.update("jax_platforms", f"cpu,{beside}" if beside else "cpu")
    jax.config.update("jax_num_cpu_devices", wanted)
    collect_less()
    return wanted


GC_THRESHOLD = (20_000, 10, 10)
"""Python's garbage collector's thresholds while tracing: a collection after 20,000 new
objects rather than 700, and the older generations as rarely."""


def collect_less() -> None:
    """Spare the garbage collector the work that slows JAX's tracing: the objects imported
    so far (JAX's, Flax's, ...) live as long as the process, so no collection scans them again
    (`gc.freeze`), and collections come after `GC_THRESHOLD` allocations. Tracing a train step
    allocates millions of short-lived objects; with Python's defaults a tenth or more of a
    chapter's compile time went to full collections that freed almost nothing."""
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
