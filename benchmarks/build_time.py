"""Times a cold build of the whole book and a no-change rebuild, with each chapter's execution time.

Run from the repository root: python benchmarks/build_time.py [--devices N]
Prints a table of the chapters against the book's budget of 3 minutes for a cold build on
2 cores. The build executes two chapters at once (book/_ext/nnxscale_book.py), so a chapter's
time here is its wall time while another chapter runs beside it, and the chapters' times add
up to more than the build. It measures; it asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 180.0
EXECUTED = re.compile(r"chapters/(\S+)\.md: Executed notebook in ([\d.]+) seconds")


def build(*args: str, env: dict[str, str]) -> tuple[float, str]:
    """Seconds taken by `jupyter-book <args>` and its output; stops on failure."""
    command = [str(Path(sys.executable).with_name("jupyter-book")), *args]
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if result.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{(result.stdout + result.stderr)[-3000:]}")
    return elapsed, result.stdout + result.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--devices", type=int, help="emulated devices (default: NNXSCALE_DEVICES or 8)"
    )
    args = parser.parse_args()
    env = dict(os.environ)
    if args.devices:
        env["NNXSCALE_DEVICES"] = str(args.devices)
    build("clean", "--all", ".", env=env)
    cold, log = build("build", ".", env=env)
    warm, warm_log = build("build", ".", env=env)
    chapters = [(name, float(seconds)) for name, seconds in EXECUTED.findall(log)]
    executed = sum(seconds for _, seconds in chapters)

    print(f"devices: {env.get('NNXSCALE_DEVICES', '8')}   cores: {os.cpu_count()}")
    print(f"{'chapter':28} {'execution s':>12} {'% of budget':>12}")
    for name, seconds in chapters:
        print(f"{name:28} {seconds:12.1f} {100 * seconds / BUDGET_S:11.1f}%")
    print(f"{'all chapters, overlapping':28} {executed:12.1f} {100 * executed / BUDGET_S:11.1f}%")
    print(f"{'cold build (clean + build)':28} {cold:12.1f} {100 * cold / BUDGET_S:11.1f}%")
    reran = len(EXECUTED.findall(warm_log))
    print(f"{'no-change rebuild':28} {warm:12.1f}   ({reran} chapters re-executed)")
    verdict = "within" if cold <= BUDGET_S else "OVER"
    print(f"budget: {BUDGET_S:.0f} s for a cold build; this build is {verdict} it "
          f"({BUDGET_S - cold:+.1f} s to spare)")  # fmt: skip


if __name__ == "__main__":
    main()
