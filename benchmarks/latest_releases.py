"""Every chapter against the newest releases of its dependencies, which Colab moves to first.

Run from the repository root: python3.12 benchmarks/latest_releases.py [--summary FILE]
It makes a fresh virtual environment with the Python that runs it (3.12 or later: the newest
JAX needs it), installs `nnxscale` with `pip install -U`, so that its dependencies' lower bounds
(pyproject.toml) are the only limit and the index's newest releases come in, with the pinned
tools that execute a notebook (requirements.txt), then executes every chapter in a fresh kernel,
two at a time, the way "Run all" does. It prints the versions it ran against the pinned ones and
each chapter's result (the failing cell and its error, and the first warning a chapter prints:
a deprecation is a bug to fix before the pins move), writes the same Markdown to --summary (the
scheduled workflow's status page), and exits 1 if a chapter failed. It measures what the index
serves today and asserts nothing about it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "tensorstore", "treescope",
            "numpy", "matplotlib")  # fmt: skip
"""The library's dependencies whose versions the report names."""
TOOLS = ("jupytext", "nbclient", "ipykernel")
"""What executes a notebook, installed at the book's pins: only the library's side moves."""


def pinned() -> dict[str, str]:
    """The exact versions requirements.txt pins, by lower-case package name."""
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        name, _, version = line.partition("==")
        if version:
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def install(venv: Path) -> Path | str:
    """A fresh environment at `venv` with the newest releases the library allows: its Python,
    or what pip said when it could not resolve or install them (itself a result to report)."""
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    pins = pinned()
    tools = [f"{tool}=={pins[tool]}" for tool in TOOLS]
    command = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-U"]
    done = subprocess.run([*command, "-e", str(ROOT), *tools], capture_output=True, text=True)
    return python if done.returncode == 0 else done.stderr[-3000:]


def execute(path: Path) -> dict[str, str | float]:
    """Run every cell of a chapter (its MyST source) in a fresh kernel; its result, time, the
    failing cell and its error, or else the first warning it printed."""
    import jupytext
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    notebook = jupytext.read(path)
    client = NotebookClient(
        notebook, timeout=600, kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )  # fmt: skip
    start = time.perf_counter()
    result: dict[str, str | float] = {"chapter": path.stem, "result": "passed", "detail": ""}
    try:
        client.execute(stderr=subprocess.DEVNULL)  # the kernel's start-up notices
    except CellExecutionError as error:
        failing = next(
            (c for c in notebook.cells if any(o.get("output_type") == "error"
                                              for o in c.get("outputs", []))),
            None,
        )  # fmt: skip
        where = failing.source.strip().splitlines()[0] if failing else "a cell"
        result["result"] = "FAILED"
        result["detail"] = f"`{where[:60]}`: {error.ename}: {error.evalue}"[:300]
    result["seconds"] = time.perf_counter() - start
    if not result["detail"]:
        for cell in notebook.cells:
            for output in cell.get("outputs", []):
                text = output.get("text", "") if output.get("name") == "stderr" else ""
                warned = [line for line in text.splitlines() if "Warning" in line]
                if warned and not result["detail"]:
                    result["detail"] = "warns: " + warned[0].strip()[:280]
    return result


def report(results: list[dict[str, str | float]]) -> str:
    """The Markdown the run prints and the status page shows: versions, then chapters."""
    pins = pinned()
    lines = ["## The book against the newest releases", "",
             "| package | ran | pinned |", "|---|---|---|",
             f"| python | {sys.version.split()[0]} | 3.12 |"]  # fmt: skip
    for name in PACKAGES:
        lines.append(f"| {name} | {importlib.metadata.version(name)} | {pins.get(name, '')} |")
    lines += ["", "| chapter | result | seconds | failing cell, or first warning |",
              "|---|---|--:|---|"]  # fmt: skip
    for r in results:
        detail = str(r["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {r['chapter']} | {r['result']} | {r['seconds']:.1f} | {detail} |")
    failed = [str(r["chapter"]) for r in results if r["result"] != "passed"]
    lines += ["", f"{len(results) - len(failed)} of {len(results)} chapters passed"
              + (f"; failed: {', '.join(failed)}" if failed else "")]  # fmt: skip
    return "\n".join(lines) + "\n"


def publish(text: str, summary: Path | None) -> None:
    """Print the report, and add it to `summary` (a workflow's status page) if given."""
    print(text)
    if summary:
        with open(summary, "a") as page:
            page.write(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / "_build" / "latest-releases")
    parser.add_argument("--summary", type=Path, help="also write the report to this file")
    parser.add_argument("--chapters", nargs="*", help="chapter names (default: all)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    every = sorted(p.stem for p in (ROOT / "chapters").glob("[0-9A-Z][0-9]_*.md"))
    chapters = args.chapters or every
    if not args.inside:  # install, then run this script again inside the new environment
        python = install(args.venv)
        if isinstance(python, str):
            failed = f"## The book against the newest releases\n\npip failed:\n```\n{python}\n```\n"
            publish(failed, args.summary)
            sys.exit(1)
        again = [str(python), __file__, "--inside", "--chapters", *chapters]
        if args.summary:
            again += ["--summary", str(args.summary)]
        sys.exit(subprocess.run(again, env={**os.environ, "PYTHONNOUSERSITE": "1"}).returncode)
    with ProcessPoolExecutor(2) as pool:  # a chapter per core, as the build runs them
        results = list(pool.map(execute, [ROOT / "chapters" / f"{c}.md" for c in chapters]))
    publish(report(results), args.summary)
    sys.exit(1 if any(r["result"] != "passed" for r in results) else 0)


if __name__ == "__main__":
    main()
