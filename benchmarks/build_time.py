"""Times a cold build of the whole book and a no-change rebuild, with each chapter's execution time.

Run from the repository root: python benchmarks/build_time.py [--devices N]
Prints a table of the chapters against the book's budgets on 2 cores: 3 minutes for a cold
build, 30 s for a chapter. The build executes a chapter per core (book/_ext/nnxscale_book.py),
so a chapter's time in the build (jupyter-cache records it) is its wall time while another
chapter runs beside it, and those times add up to more than the build; afterwards each
chapter is executed again alone, in a fresh kernel, which is the time a reader's "Run all"
takes and the one the 30 s budget is for: once with the allocator the build gives its kernels
(jemalloc where installed), once with glibc's, which is what a kernel that Jupyter or Colab
starts has. It measures; it asserts nothing. With --record it
writes the chapters' times in the build where the build reads them, to start the longest
chapter first.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
BUDGET_S = 180.0
CHAPTER_BUDGET_S = 30.0


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
    args = parser.parse_args()
    env = dict(os.environ)
    if args.devices:
        env["NNXSCALE_DEVICES"] = str(args.devices)
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
    print(f"devices: {env.get('NNXSCALE_DEVICES', '8')}   cores: {os.cpu_count()}")
    print(f"alone: with the build's allocator ({allocator}), and with glibc's")
    print(f"{'chapter':36} {'in the build s':>14} {'alone s':>8} {'% of 30 s':>10} {'glibc s':>8}")
    for (name, seconds), single, plain in zip(chapters, by_itself, with_glibc, strict=True):
        share = 100 * single / CHAPTER_BUDGET_S
        print(f"{name:36} {seconds:14.1f} {single:8.1f} {share:9.1f}% {plain:8.1f}")
    total, total_glibc = sum(by_itself), sum(with_glibc)
    print(f"{'all chapters':36} {executed:14.1f} {total:8.1f} {'':10} {total_glibc:8.1f}")
    print(
        f"{'cold build (clean + build)':36} {cold:14.1f}   ({100 * cold / BUDGET_S:.1f}% of 180 s)"
    )
    reran = re.search(r"executing (\d+) chapter", warm_log)
    reran = int(reran[1]) if reran else 0
    print(f"{'no-change rebuild':36} {warm:14.1f}   ({reran} chapters re-executed)")
    for label, times in ((allocator, by_itself), ("glibc", with_glibc)):
        over = [name for (name, _), t in zip(chapters, times, strict=True) if t > CHAPTER_BUDGET_S]
        over_list = ", ".join(over) or "none"
        print(f"chapters over {CHAPTER_BUDGET_S:.0f} s alone ({label}): {over_list}")
    verdict = "within" if cold <= BUDGET_S else "OVER"
    print(f"budget: {BUDGET_S:.0f} s for a cold build; this build is {verdict} it "
          f"({BUDGET_S - cold:+.1f} s to spare)")  # fmt: skip


if __name__ == "__main__":
    main()
