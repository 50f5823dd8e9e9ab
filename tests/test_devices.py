"""Device emulation: before JAX starts, after it starts, from the environment, on a GPU runtime."""

from __future__ import annotations

import pytest

from nnxscale.runtime.devices import MAX_EMULATED, fast_compile_flags, requested_devices

from conftest import run_python

REPORT = "import jax; print(jax.device_count(), jax.devices()[0].platform)"


def test_emulates_the_requested_count_before_jax_starts() -> None:
    out = run_python(
        f"from nnxscale.runtime.devices import emulate_devices; emulate_devices(4); {REPORT}"
    )
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["4", "cpu"]


def test_works_when_jax_is_imported_but_not_started() -> None:
    out = run_python(
        "import jax; from nnxscale.runtime.devices import emulate_devices; "
        f"emulate_devices(3); {REPORT}"
    )
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["3", "cpu"]


def test_count_comes_from_the_environment_variable() -> None:
    out = run_python(
        f"from nnxscale.runtime.devices import emulate_devices; emulate_devices(); {REPORT}",
        NNXSCALE_DEVICES="16",
    )
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["16", "cpu"]


def test_default_is_eight_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NNXSCALE_DEVICES", raising=False)
    assert requested_devices() == 8


def test_forces_the_cpu_platform_even_when_a_gpu_platform_was_chosen() -> None:
    # On a Colab GPU runtime JAX would pick the GPU; asking for "cuda" here, where there is no
    # GPU, would fail outright unless the helper switches the platform to CPU.
    out = run_python(
        f"from nnxscale.runtime.devices import emulate_devices; emulate_devices(2); {REPORT}",
        JAX_PLATFORMS="cuda",
    )
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["2", "cpu"]


def test_too_late_raises_a_clear_error_that_says_restart() -> None:
    code = (
        "import jax; jax.devices()\n"
        "from nnxscale.runtime.devices import emulate_devices, EmulationTooLateError\n"
        "try:\n    emulate_devices(4)\nexcept EmulationTooLateError as e:\n    print(e)\n"
    )
    out = run_python(code, JAX_PLATFORMS="cpu")
    assert out.returncodes == [0], out.text
    assert "already started with 1 cpu device(s)" in out.text
    assert "Restart the runtime" in out.text


def test_repeating_the_same_request_after_start_is_harmless() -> None:
    code = (
        "from nnxscale.runtime.devices import emulate_devices\n"
        f"emulate_devices(4); import jax; jax.devices(); emulate_devices(4); {REPORT}"
    )
    out = run_python(code)
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["4", "cpu"]


def test_native_leaves_jax_alone_when_it_finds_several_devices() -> None:
    # XLA_FLAGS stands in for a host with 4 accelerators: JAX finds them without being asked.
    code = (
        "from nnxscale.runtime.devices import emulate_devices; import jax\n"
        "assert emulate_devices('native') is None\n"
        f"print(jax.config.jax_num_cpu_devices); {REPORT}"
    )
    out = run_python(code, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    assert out.returncodes == [0], out.text
    assert out.output[-2:] == ["-1", "4 cpu"]


def test_native_with_one_device_emulates_eight_and_says_so() -> None:
    code = (
        f"from nnxscale.runtime.devices import emulate_devices; print(emulate_devices()); {REPORT}"
    )
    out = run_python(code, NNXSCALE_DEVICES="native", JAX_PLATFORMS="cpu")
    assert out.returncodes == [0], out.text
    assert "JAX finds 1 cpu device(s) here" in out.text
    assert "8 emulated CPU devices instead" in out.text
    assert out.text.split()[-3:] == ["8", "8", "cpu"]


def test_native_names_the_fix_when_jax_cannot_start() -> None:
    code = "from nnxscale.runtime.devices import emulate_devices; emulate_devices('native')"
    out = run_python(code, JAX_PLATFORMS="cuda")  # no GPU here
    assert out.returncodes != [0]
    assert "JAX could not start on its own devices" in out.text
    assert "Set NNXSCALE_DEVICES to a count" in out.text


@pytest.mark.parametrize("value", ["0", "-2", "eight", ""])
def test_bad_counts_name_the_variable_and_the_fix(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("NNXSCALE_DEVICES", value)
    with pytest.raises(ValueError, match=r"NNXSCALE_DEVICES=.*positive integer.*'native'"):
        requested_devices()


def test_a_count_too_large_to_emulate_is_refused_before_jax_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NNXSCALE_DEVICES", "1000000")  # crashed after 40 s
    with pytest.raises(ValueError, match=r"NNXSCALE_DEVICES='1000000': at most 256 .*Abstract"):
        requested_devices()
    assert requested_devices(MAX_EMULATED) == MAX_EMULATED


def test_native_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NNXSCALE_DEVICES", "Native")
    assert requested_devices() is None


def test_bad_argument_is_named_as_an_argument() -> None:
    with pytest.raises(ValueError, match="device count 0 is not a device count"):
        requested_devices(0)


COMPILED_AS = """
import os, jax, jax.numpy as jnp, numpy as np
from nnxscale.runtime.devices import emulate_devices
from nnxscale.runtime.devices import FAST_COMPILE, OPTIMIZED
emulate_devices(2{optimize})
x = jax.random.normal(jax.random.key(0), (4096,))
def results(options):
    step = jax.jit(lambda x: (jnp.tanh(x), jax.nn.log_softmax(x), jnp.outer(x, x[:64]) @ x[:64]))
    return np.concatenate([np.ravel(r) for r in step.lower(x).compile(compiler_options=options)(x)])
plain, fast, optimized = results(None), results(FAST_COMPILE), results(OPTIMIZED)
print(os.environ.get("XLA_FLAGS", ""))
print(np.array_equal(plain, fast), np.array_equal(plain, optimized))
"""


def test_emulated_devices_compile_every_program_fast_by_default() -> None:
    # A program compiled with no options comes out bit for bit as FAST_COMPILE's, and not as
    # XLA's defaults' (whose vectorised tanh rounds differently).
    out = run_python(COMPILED_AS.format(optimize=""), XLA_FLAGS="")  # not this process's
    assert out.returncodes == [0], out.text
    assert "--xla_backend_optimization_level=0" in out.output[-2]
    assert out.output[-1].split() == ["True", "False"]


def test_optimize_keeps_xla_defaults() -> None:
    out = run_python(COMPILED_AS.format(optimize=", optimize=True"), XLA_FLAGS="")
    assert out.returncodes == [0], out.text
    assert "xla_backend_optimization_level" not in out.output[-2]
    assert out.output[-1].split() == ["False", "True"]


def test_a_readers_own_xla_flags_win() -> None:
    flags = fast_compile_flags("--xla_backend_optimization_level=2 --xla_dump_to=/tmp/d")
    assert flags.split() == [
        "--xla_backend_optimization_level=2",
        "--xla_dump_to=/tmp/d",
    ]
    assert fast_compile_flags(flags) == flags  # emulating twice adds nothing


def test_emulating_spares_the_garbage_collector() -> None:
    code = (
        "import gc; from nnxscale.runtime.devices import emulate_devices, GC_THRESHOLD\n"
        "emulate_devices(2)\n"
        "print(gc.get_freeze_count() > 10_000, gc.get_threshold() == GC_THRESHOLD)"
    )
    out = run_python(code)
    assert out.returncodes == [0], out.text
    assert out.output[-1].split() == ["True", "True"]


def test_native_on_one_accelerator_keeps_it_beside_the_emulated_devices() -> None:
    # what a one-GPU machine reports, without one: the CPU devices come first, the default
    code = (
        "import nnxscale.runtime.devices as d; d.native_devices = lambda: (1, 'gpu', 'cuda'); "
        "d.emulate_devices('native'); import jax, os; "
        "print(jax.config.jax_platforms, os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'])"
    )
    out = run_python(code)
    assert out.returncodes == [0], out.text
    assert "with the gpu beside them as jax.devices('gpu')" in out.text
    assert out.output[-1] == "cpu,cuda false"
