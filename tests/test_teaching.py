"""Every chapter teaches before it proves: the reader's problem and a picture first, short
teaching cells, long checks folded under a named toggle, takeaways, and problems the reader
answers and a check judges."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import jupytext
import pytest

from book import CHAPTERS

NAMES = [c.stem for c in CHAPTERS]
HIDDEN = {"hide-cell", "hide-input", "remove-cell", "remove-input"}
LONGEST_VISIBLE = 25
"""Lines in the longest code cell a reader sees unfolded."""
MIN_PROBLEMS = 4
ANSWER = "Answer to problem {}"
CHECKED = "Checked: "
"""How a folded proof's toggle starts (`code_prompt_show`), followed by what it checks."""


def cells(md: Path) -> list:
    return jupytext.read(md).cells


def tags(cell) -> set[str]:
    return set(cell.metadata.get("tags", []))


def prompt(cell) -> str:
    return cell.metadata.get("mystnb", {}).get("code_prompt_show", "")


def draws(cell) -> bool:
    return cell.cell_type == "code" and "figure" in cell.metadata.get("mystnb", {})


def sections(md: Path) -> dict[str, list]:
    """The cells under each `## ` heading, by heading; "" holds those before the first."""
    out: dict[str, list] = {"": []}
    current = ""
    for cell in cells(md):
        if cell.cell_type == "markdown":
            heading = re.search(r"^## (.+)$", cell.source, re.M)
            if heading:
                current = heading[1].strip()
                out[current] = []
        out[current].append(cell)
    return out


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_no_code_cell_a_reader_sees_is_long(md: Path) -> None:
    """Teaching cells are short; a long cell is a proof, folded under a toggle that says what
    it checks."""
    for cell in cells(md):
        if cell.cell_type != "code":
            continue
        lines = len(cell.source.splitlines())
        if not tags(cell) & HIDDEN:
            assert lines <= LONGEST_VISIBLE, f"{lines} lines: fold it or move it into the library"
        elif lines > LONGEST_VISIBLE and "hide-input" in tags(cell):
            assert prompt(cell).startswith(CHECKED), cell.source[:80]


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_a_folded_check_says_what_it_checks_and_asserts_it(md: Path) -> None:
    for cell in cells(md):
        if cell.cell_type == "code" and prompt(cell).startswith(CHECKED):
            assert "hide-input" in tags(cell), "a check shows its result and folds its code"
            assert len(prompt(cell)) > len(CHECKED) + 10, prompt(cell)
            assert re.search(r"\bassert\b|np\.testing\.|\.check\(", cell.source), cell.source[:80]


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_opens_with_the_problem_what_you_will_do_and_a_picture(md: Path) -> None:
    """Before the setup cell: the reader's problem and a list of what the chapter lets them
    do; right after it, before any other code, a figure of the idea."""
    all_cells = cells(md)
    code = [i for i, c in enumerate(all_cells) if c.cell_type == "code"]
    opening = "\n".join(c.source for c in all_cells[: code[0]] if c.cell_type == "markdown")
    paragraphs = [p for p in opening.split("\n\n") if p.strip() and not p.startswith("#")]
    assert len(paragraphs) >= 2, "the problem, then what you will be able to do"
    assert re.search(r"^In this chapter you will", opening, re.M), opening[:200]
    assert len(re.findall(r"^- ", opening, re.M)) >= 3, "at least three things you will do"
    picture = all_cells[code[1]]
    assert draws(picture), "the first cell after the setup draws the idea"
    assert tags(picture) & {"hide-input", "remove-input"}, "the picture shows, its code folds"


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_ends_with_takeaways_then_problems(md: Path) -> None:
    headings = [h for h in sections(md) if h]
    assert headings[-2:] == ["Takeaways", "Problems"], headings[-3:]
    takeaways = "\n".join(c.source for c in sections(md)["Takeaways"] if c.cell_type == "markdown")
    assert len(re.findall(r"^- ", takeaways, re.M)) >= 3


CHECKS = "The checks (they hold the answers)"
REASONING = ("(derive)", "(predict, then measure)", "(try it)")
"""How a problem that asks for reasoning no cell prints is marked, after its number."""


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_the_reader_answers_each_problem_and_a_check_judges_it(md: Path) -> None:
    """After a folded cell of checks, each "**Problem k.**" is followed by the reader's cell
    (`answer = None`, then `checks[k](answer)`, which prints right or a hint) and by its
    solution folded under "Answer to problem k", which `checks[k].proves` against the check
    with wrong answers it must refuse. At least half of the problems ask for reasoning no cell
    prints (`REASONING`); one at least is "(try it)", whose check reads the reader's edit."""
    problems = sections(md)["Problems"]
    first = next(i for i, c in enumerate(problems) if c.source.startswith("**Problem 1"))
    checks = [c for c in problems[:first] if c.cell_type == "code" and prompt(c) == CHECKS]
    assert len(checks) == 1 and tags(checks[0]) == {"hide-cell"}, "one folded cell of checks"
    assert re.search(r"^checks = \{", checks[0].source, re.M)
    found, reasoning, tries = 0, 0, 0
    for i, cell in enumerate(problems):
        head = re.match(r"\*\*Problem (\d+)( \([^)]*\))?\.\*\*", cell.source)
        if cell.cell_type != "markdown" or not head:
            continue
        found += 1
        assert int(head[1]) == found, cell.source[:60]
        kind = (head[2] or "").strip()
        reasoning += kind in REASONING
        mine, solution = problems[i + 1], problems[i + 2]
        assert mine.cell_type == "code" and not tags(mine) & HIDDEN, mine.source
        assert re.match(r"answer = None  # \S", mine.source), mine.source
        call = re.search(rf"^checks\[{found}\]\(answer(, .+)?\)$", mine.source, re.M)
        assert call, mine.source
        if kind == "(try it)":
            tries += 1
            assert call[1], "a try-it check is given the object the reader edited"
        assert tags(solution) == {"hide-cell"}, solution.source[:60]
        assert prompt(solution) == ANSWER.format(found), prompt(solution)
        last = ast.parse(solution.source).body[-1]
        assert isinstance(last, ast.Expr) and f"checks[{found}].proves(" in ast.unparse(last)
    assert found >= MIN_PROBLEMS, f"{found} problems"
    assert 2 * reasoning >= found, f"{reasoning} of {found} ask for reasoning: mark or rewrite"
    assert tries >= 1, "one problem asks the reader to change a parameter and run a cell"


@pytest.mark.parametrize("md", CHAPTERS, ids=NAMES)
def test_prose_names_no_count_of_this_machine(md: Path) -> None:
    """The reader's machine is not the build's: a core count in prose is wrong elsewhere."""
    prose = "\n".join(c.source for c in cells(md) if c.cell_type == "markdown")
    counted = re.findall(r"\b(?:one|two|four|eight|\d+)[ -](?:CPU )?cores?\b", prose, re.I)
    assert not counted, counted
