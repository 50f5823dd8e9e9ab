"""Draws the book's logo and favicons (a 4 x 2 mesh of coloured devices) with matplotlib.

Run from the repository root: python book/make_logo.py
"""

from pathlib import Path

import matplotlib
from PIL import Image

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STATIC = Path(__file__).parent / "_static"


TITLE_COLOURS = {"light": ("#222222", "#1f77b4"), "dark": ("#eeeeee", "#6cb4ee")}
"""The two title lines' colours on the theme's light and dark backgrounds."""


def draw(size_inches: float, dpi: int, path: Path, title: bool, mode: str = "light") -> None:
    """Draw the mesh of coloured device squares, optionally with the book's title beside it."""
    width = size_inches * (3.2 if title else 1.0)
    fig = plt.figure(figsize=(width, size_inches), dpi=dpi)
    ax = fig.add_axes((0, 0, size_inches / width, 1))
    colours = plt.get_cmap("tab10").colors
    for row in range(4):
        for col in range(2):
            ax.add_patch(
                plt.Rectangle((col * 1.1, (3 - row) * 1.1), 1, 1, color=colours[row * 2 + col])
            )
    ax.set_xlim(-0.6, 2.8)
    ax.set_ylim(-0.15, 4.35)
    ax.set_axis_off()
    if title:
        first, second = TITLE_COLOURS[mode]
        fig.text(0.34, 0.58, "Scaling", fontsize=30, weight="bold", color=first, va="center")
        fig.text(0.34, 0.30, "Flax NNX", fontsize=30, weight="bold", color=second, va="center")
    fig.savefig(path, transparent=True)
    plt.close(fig)


if __name__ == "__main__":
    (STATIC / "root").mkdir(parents=True, exist_ok=True)
    draw(1.6, 100, STATIC / "logo.png", title=True)
    draw(1.6, 100, STATIC / "logo-dark.png", title=True, mode="dark")
    draw(0.32, 100, STATIC / "favicon.png", title=False)
    # Browsers ask the site root for /favicon.ico on pages without an icon link (the redirect).
    Image.open(STATIC / "favicon.png").save(STATIC / "root" / "favicon.ico", sizes=[(32, 32)])
