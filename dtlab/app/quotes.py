"""Measured numbers on the pages, rendered from the committed results they come from.

A page quotes a result between two markers, ``<!-- quote:NAME -->`` and ``<!-- /quote:NAME -->``, in the
README, in ``docs/`` and in the notebooks' markdown cells: on lines of their own around a block (a table),
or inline, within a sentence or a table's cell, for a quote of one line. ``dtlab.app.quoted.QUOTES`` maps
each NAME to the function that writes its text from files under ``docs/figures/``: the pages never hold a
number typed by hand there, and two pages that quote one result cannot disagree.

    python -m dtlab.app.quotes            # rewrite every marked block from the committed results
    python -m dtlab.app.quotes --check    # list the blocks that differ from their results (exit 1)

``tests/test_quotes.py`` runs the check, so a changed result without its pages (or a page edited by hand
between the markers) fails the suite.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import nbformat

from dtlab.app.quoted import QUOTES

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- quote:(?P<name>[\w-]+) -->(?P<newline>\n?)(?P<body>.*?)<!-- /quote:(?P=name) -->", re.S)

__all__ = ["BLOCK", "check", "main", "pages", "render", "render_text"]


def pages(root: Path = ROOT) -> list[Path]:
    """Every page that may quote a result: the README, the docs and the notebooks."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "notebooks").glob("*.ipynb"))]


def render_text(text: str, root: Path = ROOT, where: str = "") -> str:
    """``text`` with every marked block rewritten from its result; ValueError names an unknown block."""
    def fill(match: re.Match) -> str:
        name = match["name"]
        if name not in QUOTES:
            raise ValueError(f"{where or 'page'}: unknown quote {name!r} (known: {', '.join(sorted(QUOTES))})")
        text = QUOTES[name](root).rstrip("\n")
        if match["newline"]:
            return f"<!-- quote:{name} -->\n{text}\n<!-- /quote:{name} -->"
        if "\n" in text:
            raise ValueError(f"{where or 'page'}: quote {name!r} is a block: put its markers on lines of their own")
        return f"<!-- quote:{name} -->{text}<!-- /quote:{name} -->"
    return BLOCK.sub(fill, text)


def _texts(page: Path) -> Iterator[tuple[object, str]]:
    """(holder, text) for each text of a page that may hold blocks: the page, or a notebook's markdown cells."""
    if page.suffix != ".ipynb":
        yield None, page.read_text()
        return
    nb = nbformat.read(page, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "<!-- quote:" in cell.source:
            yield (nb, cell), cell.source


def render(page: Path, root: Path = ROOT) -> bool:
    """Rewrite ``page``'s blocks from their results; True where it changed."""
    changed, notebook = False, None
    for holder, text in _texts(page):
        new = render_text(text, root, str(page.relative_to(root)))
        if new == text:
            continue
        changed = True
        if holder is None:
            page.write_text(new)
        else:
            notebook, cell = holder
            cell.source = new
    if notebook is not None:
        page.write_text(nbformat.writes(notebook) + "\n")
    return changed


def check(root: Path = ROOT) -> list[str]:
    """One line per block whose page differs from its result (empty when every page agrees)."""
    stale = []
    for page in pages(root):
        for _, text in _texts(page):
            for match in BLOCK.finditer(text):
                rendered = render_text(match.group(0), root, str(page.relative_to(root)))
                if rendered != match.group(0):
                    stale.append(f"{page.relative_to(root)}: quote:{match['name']} differs from its result "
                                 f"(python -m dtlab.app.quotes rewrites it)")
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.app.quotes", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="list the blocks that differ; change nothing")
    args = parser.parse_args(argv)
    if args.check:
        stale = check()
        print("\n".join(stale) or "every quoted block agrees with its result")
        return 1 if stale else 0
    for page in pages():
        if render(page):
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
