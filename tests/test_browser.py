"""The built book in a real headless Chromium: pages, images, links, search, screenshots.

Without Chromium these tests skip, unless NNXSCALE_REQUIRE_BROWSER=1 (CI sets it), which
makes a missing browser a failure.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import re
import shutil
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from book import BRANCH, CHAPTERS, REPOSITORY, ROOT, tracked

pytestmark = [pytest.mark.book, pytest.mark.browser]

PAGES = [
    "index.html", "book/intro.html", "book/setup.html",
    *[f"chapters/{c.stem}.html" for c in CHAPTERS],
    "book/glossary.html", "book/references.html", "book/status.html",
    "genindex.html", "search.html",
]  # fmt: skip
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
SCREENSHOTS = ROOT / "_build" / "screenshots"


def chromium_path() -> str | None:
    return os.environ.get("NNXSCALE_CHROMIUM") or shutil.which("chromium")


@pytest.fixture(scope="module")
def site(built_book: Path) -> Iterator[str]:
    """The built HTML served on a free localhost port."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

    handler = functools.partial(Quiet, directory=str(built_book))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    path = chromium_path()
    if path is None:
        message = "no Chromium found: install Debian's chromium package (apt-get install chromium)"
        if os.environ.get("NNXSCALE_REQUIRE_BROWSER") == "1":
            pytest.fail(message + "; NNXSCALE_REQUIRE_BROWSER=1 makes browser tests mandatory")
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=path, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def open_page(browser, url: str):
    """A page loaded until the network is idle, with every console error and failed request."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type == "error" else None)  # fmt: skip
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url}"))
    page.on("response", lambda r: problems.append(f"HTTP {r.status}: {r.url}")
            if r.status >= 400 else None)  # fmt: skip
    page.goto(url, wait_until="networkidle")
    # Treescope renders an output once it has come into view: bring each into view, as a
    # reader scrolling down would, and give it up to 5 s to render.
    page.evaluate(
        "async () => { for (const c of document.querySelectorAll('treescope-container')) {"
        " c.scrollIntoView(); for (let t = 0; t < 100; t++) {"
        " if (c.shadowRoot && !c.shadowRoot.textContent.includes('(Loading...)')) break;"
        " await new Promise(r => setTimeout(r, 50)); } } window.scrollTo(0, 0); }"
    )
    page.wait_for_load_state("networkidle")
    return page, problems


def save_screenshot(page, path: Path, *, full_page: bool = False) -> None:
    """A screenshot for a person to look at (no test reads it). Chromium's capture sometimes
    fails under load ("Unable to capture screenshot") on a page that loaded cleanly: try
    again, up to three times, before letting the error through."""
    for attempt in range(3):
        try:
            page.screenshot(path=path, full_page=full_page)
            return
        except Exception as error:
            if "Unable to capture screenshot" not in str(error) or attempt == 2:
                raise
            page.wait_for_timeout(500)


def test_every_built_page_is_checked(built_book: Path) -> None:
    built = {
        str(p.relative_to(built_book))
        for p in built_book.rglob("*.html")
        if not p.relative_to(built_book).parts[0].startswith("_")
    }
    assert built == set(PAGES)


@pytest.mark.parametrize("path", PAGES)
def test_page_loads_cleanly_with_its_images(browser, site: str, path: str) -> None:
    page, problems = open_page(browser, f"{site}/{path}")
    images = page.evaluate(
        "Array.from(document.images).map(i => [i.src, i.complete && i.naturalWidth > 0])"
    )
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    save_screenshot(page, SCREENSHOTS / (path.replace("/", "_")[:-5] + ".png"), full_page=True)
    page.close()
    assert problems == []
    assert [src for src, ok in images if not ok] == []
    assert images, "every page shows at least the logo"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_chapter_buttons_point_at_committed_files(browser, site: str, chapter: Path) -> None:
    page, problems = open_page(browser, f"{site}/chapters/{chapter.stem}.html")
    links = page.eval_on_selector_all("a", "as => as.map(a => a.href)")
    page.close()
    assert problems == []
    github = REPOSITORY.removeprefix("https://github.com/")
    colab = [u for u in links if u.startswith("https://colab.research.google.com/")]
    assert colab == [f"https://colab.research.google.com/github/{github}/blob/{BRANCH}/"
                     f"colab/{chapter.stem}.ipynb"]  # fmt: skip
    assert tracked(ROOT / "colab" / f"{chapter.stem}.ipynb")  # book/colab.py writes it
    assert REPOSITORY in links
    assert any(u.startswith(f"{REPOSITORY}/issues/new") for u in links)
    download = [u for u in links if u.endswith(f"_sources/chapters/{chapter.stem}.ipynb")]
    assert download, "download button for the executed notebook"
    with urllib.request.urlopen(download[0]) as response:
        notebook = json.load(response)
    outputs = [o for c in notebook["cells"] if c["cell_type"] == "code" for o in c["outputs"]]
    assert outputs, "the downloadable notebook carries the build's outputs"


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_interactive_outputs_render(browser, site: str, chapter: Path) -> None:
    """Treescope outputs (chapter 2) render their content once scrolled into view."""
    page, problems = open_page(browser, f"{site}/chapters/{chapter.stem}.html")
    page.wait_for_timeout(500)
    contents = page.evaluate(
        "Array.from(document.querySelectorAll('treescope-container'))"
        ".map(c => c.shadowRoot ? c.shadowRoot.textContent : '')"
    )
    leftovers = page.evaluate("document.querySelectorAll('.nnxscale-deferred').length")
    page.close()
    assert problems == []
    assert leftovers == 0
    assert all(text and "(Loading...)" not in text for text in contents), contents


def test_search_finds_a_chapter(browser, site: str) -> None:
    page, problems = open_page(browser, f"{site}/search.html?q=collectives")
    page.wait_for_selector("#search-results li a", timeout=20_000)
    hits = page.eval_on_selector_all("#search-results li a", "as => as.map(a => a.href)")
    page.close()
    assert any(f"chapters/{CHAPTERS[0].stem}.html" in h for h in hits), hits
    assert problems == []


SIDEBAR_BOX = """selector => {
    const element = document.querySelector(selector);
    const box = element.getBoundingClientRect();
    const style = getComputedStyle(element);  // a drawer is position: fixed (no offsetParent)
    return style.display !== 'none' && style.visibility === 'visible'
        && box.width > 0 && box.right > 0 && box.left < window.innerWidth;
}"""
"""Whether the element is on screen: displayed, visible, and inside the viewport."""


def visible_toggle(page, kind: str):
    """The one visible, clickable sidebar toggle of `kind` (primary or secondary)."""
    toggles = [t for t in page.locator(f".{kind}-toggle").all() if t.is_visible()]
    assert len(toggles) == 1, f"{len(toggles)} visible {kind} toggles"
    box = toggles[0].bounding_box()
    assert box and box["width"] >= 24 and box["height"] >= 24, f"{kind} toggle of size {box}"
    return toggles[0]


@pytest.mark.parametrize("mode", ["light", "dark"])
@pytest.mark.parametrize(("width", "height"), [(1400, 900), (390, 844)], ids=["desktop", "phone"])
def test_header_has_one_search_box_and_toggles_that_work(
    browser, site: str, width: int, height: int, mode: str
) -> None:
    """What a reader does first: find search, open and close the chapter list and the page
    outline. (pydata-sphinx-theme 0.17 with sphinx-book-theme 1.3 rendered a second header
    with a second search box and a hidden second `.primary-toggle` that took the click.)"""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(f"{site}/chapters/{CHAPTERS[1].stem}.html", wait_until="networkidle")
    page.evaluate(f"document.documentElement.dataset.theme = '{mode}'")
    search = page.locator(".search-button-field, .search-button__button").all()
    assert len([s for s in search if s.is_visible()]) == 1, "one search box in the header"
    primary, secondary = ".bd-sidebar-primary", ".bd-sidebar-secondary"
    wide = width >= 1200  # where the theme shows both sidebars until they are toggled away
    assert page.evaluate(SIDEBAR_BOX, primary) is wide
    visible_toggle(page, "primary").click()
    page.wait_for_timeout(400)  # the sidebar slides
    assert page.evaluate(SIDEBAR_BOX, primary) is not wide, "the chapter list toggles"
    if not wide:
        page.mouse.click(width - 10, height // 2)  # outside the drawer: it closes
        page.wait_for_timeout(400)
        assert page.evaluate(SIDEBAR_BOX, primary) is False
        assert page.evaluate(SIDEBAR_BOX, secondary) is False
        visible_toggle(page, "secondary").click()
        page.wait_for_timeout(400)
        assert page.evaluate(SIDEBAR_BOX, secondary) is True, "the page outline opens"
    else:
        assert page.evaluate(SIDEBAR_BOX, secondary) is True
    save_screenshot(page, SCREENSHOTS / f"navigation-{width}-{mode}.png")
    page.close()


def _luminance(rgb) -> float:
    """WCAG relative luminance of an sRGB colour (0-255 channels)."""
    channels = [c / 255 for c in rgb[:3]]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(a, b) -> float:
    """WCAG contrast ratio of two colours (1 to 21)."""
    high, low = sorted((_luminance(a), _luminance(b)), reverse=True)
    return (high + 0.05) / (low + 0.05)


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_the_logo_title_is_legible_in_each_mode(browser, site: str, built_book: Path, mode) -> None:
    """Each line of the logo's title ("Scaling", "Flax NNX") against the page background."""
    from PIL import Image

    page = browser.new_page(viewport={"width": 1400, "height": 900})
    page.goto(f"{site}/chapters/{CHAPTERS[0].stem}.html", wait_until="networkidle")
    page.evaluate(f"document.documentElement.dataset.theme = '{mode}'")
    page.wait_for_timeout(200)
    shown = page.evaluate(
        "[...document.querySelectorAll('.logo__image')].filter(i => i.offsetParent !== null)"
        ".map(i => [i.getAttribute('src'), i.naturalWidth])"
    )
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.close()
    assert len(shown) == 1 and shown[0][1] > 0, shown
    background = [int(c) for c in background[background.index("(") + 1 : -1].split(",")[:3]]
    logo = Image.open(built_book / "_static" / Path(shown[0][0]).name).convert("RGBA")
    width, height = logo.size
    title = [
        (y, pixel)
        for y in range(height)
        for x in range(int(0.34 * width), width)
        if (pixel := logo.getpixel((x, y)))[3] == 255
    ]
    for line in (lambda y: y < height / 2, lambda y: y >= height / 2):
        colours = sorted((p for y, p in title if line(y)), key=_luminance)
        assert colours, "the title has two lines of text"
        median = colours[len(colours) // 2]
        assert contrast(median, background) >= 3.0, (mode, median, background)  # WCAG, large


OVERFLOWING = """() => {
    const article = document.querySelector('article.bd-article');
    const edge = article.getBoundingClientRect().right + 1;
    const clipped = (el) => {  // inside a box that scrolls or clips and itself fits
        for (let a = el.parentElement; a && a !== article; a = a.parentElement) {
            const x = getComputedStyle(a).overflowX;
            if (['auto', 'scroll', 'hidden'].includes(x) && a.getBoundingClientRect().right <= edge)
                return true;
        }
        return false;
    };
    return [...article.querySelectorAll('*')]
        .filter(el => el.getBoundingClientRect().width > 0)
        .filter(el => el.getBoundingClientRect().right > edge && !clipped(el))
        .map(el => el.tagName + '.' + el.className + ': ' + el.textContent.slice(0, 60));
}"""
"""Elements reaching past the article's right edge, unless inside a box that scrolls or clips."""
TABLE_HINTS = """() => [...document.querySelectorAll('.pst-scrollable-table-container')]
    .filter(box => box.offsetParent !== null).map(box => {
        const hint = box.previousElementSibling;
        return [box.scrollWidth > box.clientWidth + 1,
                !!hint && hint.classList.contains('nnxscale-scroll-hint') && !hint.hidden];
    })"""
"""For each table shown: whether it scrolls sideways, and whether a line above it says so."""
WIDE_CODE = """() => [...document.querySelectorAll('.cell_input pre')]
    .filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 60))"""
WIDE_LISTINGS = """() => [...document.querySelectorAll('.cell_output div.highlight-python pre')]
    .filter(p => p.scrollWidth > p.clientWidth + 1).map(p => p.textContent.slice(0, 60))"""
"""The library's source listings that scroll sideways (their lines are up to 100 columns)."""


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
@pytest.mark.parametrize(("width", "height"), [(1400, 900), (390, 844)], ids=["desktop", "phone"])
def test_nothing_is_wider_than_the_page(browser, site: str, chapter: Path, width, height) -> None:
    """Wide tables and code scroll inside their own box; at desktop width code cells and the
    library's listings fit."""
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(f"{site}/chapters/{chapter.stem}.html", wait_until="networkidle")
    overflowing = page.evaluate(OVERFLOWING)
    wide_code = page.evaluate(WIDE_CODE)
    wide_listings = page.evaluate(WIDE_LISTINGS)
    tables = page.evaluate(TABLE_HINTS)
    listings = page.eval_on_selector_all(
        ".cell_output div.highlight-python pre", "ps => ps.map(p => getComputedStyle(p).whiteSpace)"
    )
    if width < 1200:
        (SCREENSHOTS / "phone").mkdir(parents=True, exist_ok=True)
        save_screenshot(page, SCREENSHOTS / "phone" / f"{chapter.stem}.png", full_page=True)
    page.close()
    assert overflowing == []
    assert all(scrolls == hinted for scrolls, hinted in tables), tables
    assert set(listings) <= {"pre"}, "the library's source listings keep their lines whole"
    if width >= 1200:
        assert wide_code == [], "code cells wider than the book's 86 columns"
        assert wide_listings == [], "listings of the library's source wider than the page"


FIGURES = """() => [...document.querySelectorAll('article.bd-article img')].map(img => {
    const figure = img.closest('figure');
    const caption = figure && figure.querySelector('figcaption');
    return {src: img.getAttribute('src'), alt: img.getAttribute('alt') || '',
            number: caption ? (caption.querySelector('.caption-number') || {}).textContent : null,
            caption: caption ? caption.textContent.trim() : '', id: figure ? figure.id : '',
            natural: img.naturalWidth, shown: img.getBoundingClientRect().width};
})"""


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_every_image_is_a_numbered_captioned_figure(browser, site: str, chapter: Path) -> None:
    """Each image: inside a numbered figure with a caption, alt text that describes it (not a
    file name), drawn at twice the size it is shown, and referenced from the text."""
    page, problems = open_page(browser, f"{site}/chapters/{chapter.stem}.html")
    figures = page.evaluate(FIGURES)
    references = page.eval_on_selector_all(
        "article a[href*='#fig-']:not(.headerlink)",
        "as => as.map(a => [a.getAttribute('href'), a.textContent])",
    )
    page.close()
    assert problems == []
    assert figures, "every chapter has at least one figure"
    for figure in figures:
        assert figure["number"] and figure["number"].startswith("Figure "), figure
        assert len(figure["caption"]) > len(figure["number"]) + 20, figure
        assert len(figure["alt"]) > 20, figure
        assert not re.search(r"\.(png|svg|jpe?g)$|_images/|^/", figure["alt"]), figure
        assert figure["natural"] >= 1.9 * figure["shown"], f"not drawn at 2x: {figure}"
    referenced = {href.rpartition("#")[2] for href, _ in references}
    assert {f["id"] for f in figures} <= referenced, "every figure is referenced from the text"
    assert all(text.startswith("Figure ") and text[7].isdigit() for _, text in references)


def test_glossary_links_resolve(browser, site: str) -> None:
    """Every chapter links glossary terms, and each link lands on a term the glossary defines."""
    page = browser.new_page()
    page.goto(f"{site}/book/glossary.html", wait_until="networkidle")
    terms = set(page.eval_on_selector_all("dl.glossary dt[id]", "ds => ds.map(d => d.id)"))
    linked = {}
    for chapter in CHAPTERS:
        page.goto(f"{site}/chapters/{chapter.stem}.html", wait_until="networkidle")
        linked[chapter.stem] = page.eval_on_selector_all(
            "article a[href*='glossary.html#']", "as => as.map(a => a.getAttribute('href'))"
        )
    page.close()
    assert terms
    for stem, hrefs in linked.items():
        assert hrefs, f"{stem} links no glossary term"
        assert {h.rpartition("#")[2] for h in hrefs} <= terms, stem


@pytest.mark.parametrize("mode", ["light", "dark"])
def test_treescope_outputs_follow_the_mode(browser, site: str, mode: str) -> None:
    """Chapter 2's treescope outputs: dark on a dark page, light on a light one."""
    from io import BytesIO

    from PIL import Image, ImageStat

    page, problems = open_page(browser, f"{site}/chapters/{CHAPTERS[1].stem}.html")
    page.evaluate(f"document.documentElement.dataset.theme = '{mode}'")
    box = page.locator("treescope-container").first
    box.scroll_into_view_if_needed()
    page.wait_for_timeout(300)
    shot = Image.open(BytesIO(box.screenshot())).convert("L")
    page.close()
    assert problems == []
    brightness = ImageStat.Stat(shot).mean[0] / 255
    assert brightness < 0.35 if mode == "dark" else brightness > 0.65, brightness


def test_search_snippets_are_chapter_text(browser, site: str) -> None:
    """Result snippets quote the chapter: no header buttons, outline or raw LaTeX."""
    page, problems = open_page(browser, f"{site}/search.html?q=reduce-scatter")
    page.wait_for_selector("#search-results li p.context", timeout=20_000)
    snippets = page.eval_on_selector_all(
        "#search-results li p.context", "ps => ps.map(p => p.textContent)"
    )
    page.close()
    assert problems == []
    assert snippets
    for text in snippets:
        for chrome in ("\\frac", "\\(", "$$", "Open issue", ".ipynb", "Contents", "Ctrl+K"):
            assert chrome not in text, (chrome, text)


CALCULATOR = """(inputs) => {
    const root = document.querySelector('.nnxscale-calc');
    const form = root.querySelector('form');
    return inputs.map((input) => {
        for (const [name, value] of Object.entries(input)) {
            const element = form.elements[name];
            if (element.type === 'checkbox') element.checked = value;
            else element.value = String(value);
        }
        form.dispatchEvent(new Event('input'));
        return Object.fromEntries([...root.querySelectorAll('[data-field]')]
            .filter((cell) => cell.dataset.value !== '')
            .map((cell) => [cell.dataset.field, cell.dataset.value === undefined
                ? cell.textContent : Number(cell.dataset.value)]));
    });
}"""


def calculator_grid() -> list[dict]:
    """Every planned strategy on every device, for three dense models and two mixtures of
    experts, clusters and setups (each with its remat policies and two micro-batch counts, a
    pipeline on the lockstep executor, on 1F1B with one and two virtual stages, on ZB-H1 and
    on ZB-V), under both memory ledgers and every precision: over 500 inputs, some that
    cannot run."""
    from nnxscale import configs, costs
    from nnxscale.costs.planner import EXPERT_PLANNED, PLANNED

    dense = {"experts": 0, "top_k": 1, "capacity_factor": 2.0}
    small = dict(vocab=96, embed=48, heads=6, kv_heads=3, head_dim=8, mlp=80, layers=6, **dense)
    mixtral = {k: getattr(configs.MIXTRAL_8X7B, k) for k in SIZES}
    mixtral.update(experts=8, top_k=2, capacity_factor=1.25)
    switch = dict(small, experts=4, top_k=1, capacity_factor=1.5)
    every, two = list(costs.HARDWARE), ["H100", "TPU v5p"]
    clusters = [
        (
            {k: getattr(configs.LLAMA3_8B, k) for k in SIZES} | dense,
            8,
            64,
            4096,
            (2, 2, 2, 2, 2),
            every,
        ),
        (
            {k: getattr(configs.LLAMA3_70B, k) for k in SIZES} | dense,
            256,
            1024,
            4096,
            (4, 8, 4, 16, 4),
            every,
        ),
        (small, 12, 24, 48, (2, 3, 2, 2, 2), every),
        (mixtral, 64, 512, 4096, (2, 2, 2, 2, 8), two),
        (switch, 12, 24, 48, (2, 3, 2, 2, 2), two),
    ]
    wrong = [dict(switch, top_k=5), dict(switch, capacity_factor=0), dict(switch, experts=-1)]
    clusters += [(cfg, 12, 24, 48, (2, 3, 2, 2, 2), ["H100"]) for cfg in wrong]
    found = [
        {
            **cfg, "seq": seq, "batch": batch, "devices": devices, "hardware": hardware,
            "strategy": strategy, "tensor": degrees[0], "stages": degrees[1],
            "context": degrees[2], "replicas": degrees[3], "expert_axis": degrees[4],
            "micro": micro, "remat": remat, "schedule": schedule, "virtual": virtual,
        }
        for cfg, devices, batch, seq, degrees, hardwares in clusters
        for hardware in hardwares
        for strategy in PLANNED + EXPERT_PLANNED
        for micro in (degrees[1], 2 * degrees[1])
        for remat in ("no", "dots", "full")
        for schedule, virtual in (
            ("lockstep", 1), ("1F1B", 1), ("1F1B", 2), ("ZB-H1", 1), ("ZB-V", 2)
        )
        if (schedule != "lockstep") == strategy.startswith("PP")
        or (schedule, remat) == ("lockstep", "no")
    ]  # fmt: skip
    # both ledgers and every precision, each on a third and a sixth of any regular slice
    precisions = list(costs.PRECISIONS)
    return [
        {**i, "ledger": ("program", "fused", "fused")[k % 3], "precision": precisions[k % 6]}
        for k, i in enumerate(found)
    ]


SIZES = ("vocab", "embed", "heads", "kv_heads", "head_dim", "mlp", "layers")


def library_answer(inputs: dict) -> tuple[str, object]:
    """What the library says of one input of the grid: ("mesh", message) where the degrees do
    not divide the devices, ("reason", why) where the setup cannot run (virtual stages it
    cannot have among them), else ("cost", (the model's `Config`, its `StepCost`))."""
    from nnxscale import Config, calculator, costs
    from nnxscale.placement.catalogue import STRATEGIES

    mixture = {k: inputs[k] for k in ("experts", "top_k", "capacity_factor")}
    try:
        cfg = Config(
            **{k: inputs[k] for k in SIZES}, **mixture, max_len=inputs["seq"],
            compute_dtype=calculator.DTYPE, scan_layers=True,
        )  # fmt: skip
    except ValueError as error:  # a mixture that cannot run: the Config says why
        return "reason", str(error).removeprefix("Config: ")
    remat = {"no": False, "dots": "dots", "full": "full"}[inputs["remat"]]
    degrees = {k: inputs[k] for k in calculator.DEGREES.values()}
    try:
        setup = calculator.setup_for(
            STRATEGIES[inputs["strategy"]], inputs["devices"], degrees, inputs["micro"], remat,
            inputs["schedule"], inputs["virtual"], inputs["ledger"],
            costs.PRECISIONS[inputs["precision"]],
        )  # fmt: skip
    except ValueError as error:
        return ("reason" if "virtual=" in str(error) else "mesh"), str(error)
    reason = costs.unsuitable(cfg, setup, inputs["batch"], inputs["seq"])
    if reason:
        return "reason", reason
    return "cost", (
        cfg,
        costs.step_cost(cfg, setup, inputs["hardware"], inputs["batch"], inputs["seq"]),
    )


def test_the_calculator_computes_what_the_library_computes(browser, site: str) -> None:
    """The page's calculator, driven through its form over the grid, gives the library's
    numbers (memory by part, peak, bytes, FLOPs, times, to 1e-9 relative) or its reason."""
    from nnxscale import costs

    page, problems = open_page(browser, f"{site}/chapters/12_choosing_a_strategy.html")
    grid = calculator_grid()
    shown = page.evaluate(CALCULATOR, grid)
    page.close()
    assert problems == []
    assert len(grid) >= 500
    reasons = 0
    for inputs, got in zip(grid, shown, strict=True):
        kind, answer = library_answer(inputs)
        if kind == "mesh":
            assert "do not divide" in got["verdict"], inputs
            reasons += 1
            continue
        if kind == "reason":
            assert got == {"verdict": f"cannot run: {answer}"}, inputs
            reasons += 1
            continue
        cfg, cost = answer
        expected = {
            "parameter count": costs.counts(cfg).total,
            **cost.memory,
            "peak per device": cost.peak,
            "bytes sent per device": cost.sent,
            "FLOPs per device": cost.flops,
            "compute time": cost.compute_time,
            "communication time": cost.comm_time,
            "exposed communication": cost.exposed,
            "predicted step time": cost.step_time,
        }
        assert set(got) == set(expected), inputs
        for field, value in expected.items():
            assert got[field] == pytest.approx(value, rel=1e-9, abs=1e-12), (field, inputs)
    assert reasons and len(grid) - reasons >= 300  # both kinds of answer, many priced


TOGGLES = """(start) => [...document.querySelectorAll('article details.hide')]
    .filter(d => d.querySelector('summary .collapsed').textContent.trim().startsWith(start))
    .map(d => d.querySelector('summary .collapsed').textContent.trim())"""
"""The titles of the folded cells whose toggle starts with `start`."""
OPENED = """(title) => {
    const d = [...document.querySelectorAll('article details.hide')].find(
        d => d.querySelector('summary .collapsed').textContent.trim() === title);
    const shown = (el) => !!el && el.checkVisibility({contentVisibilityAuto: true})
        && el.innerText.trim().length > 0;  // closed <details> hide without a zero box
    const output = d.closest('.cell').querySelector('.cell_output');
    const source = d.closest('.cell').querySelector('.cell_input');
    return {open: d.open, source: shown(source), output: shown(output),
            text: output ? output.innerText.trim() : ''};
}"""
"""Whether a folded cell is open, and whether its code and its output are on screen."""


@pytest.mark.parametrize("chapter", CHAPTERS, ids=[c.stem for c in CHAPTERS])
def test_answers_and_folded_checks_open_and_show_their_result(
    browser, site: str, chapter: Path
) -> None:
    """Each problem's answer is folded until the reader opens it, and then shows the code that
    computed it and the answer; each folded check shows its result and opens onto its code."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{site}/chapters/{chapter.stem}.html", wait_until="networkidle")
    answers = page.evaluate(TOGGLES, "Answer to problem")
    checks = page.evaluate(TOGGLES, "Checked: ")
    assert answers == [f"Answer to problem {k}" for k in range(1, len(answers) + 1)]
    assert len(answers) >= 4, answers
    for title in answers + checks:
        before = page.evaluate(OPENED, title)
        assert not before["open"] and not before["source"], (title, before)
        assert before["output"] is (title in checks), (title, before)  # a check shows its result
        page.locator("article details.hide summary", has_text=title).first.click()
        after = page.evaluate(OPENED, title)
        assert after["open"] and after["source"] and after["output"], (title, after)
        assert len(after["text"]) > 10, (title, after["text"])
    page.close()
