"""The book's formulas are MathML made at build time: no raw TeX on a page, no script to fetch."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbconvert.filters.markdown_mistune import MarkdownWithMath

from dtlab.app.book import build, markdown_page, notebook_page
from dtlab.app.book_math import FormulaError, MathMLRenderer, mathml

ROOT = Path(__file__).resolve().parents[1]
# Anything a page would load from elsewhere: a script, style sheet, image or frame by URL, or a CSS url().
REMOTE = re.compile(r'<(?:script|link|img|iframe|source)[^>]+(?:src|href)="(?:https?:)?//|url\(["\']?(?:https?:)?//')


def maths(page: str) -> list[str]:
    return re.findall(r"<math\b.*?</math>", page, re.DOTALL)


def test_a_notebook_page_shows_inline_display_and_latex_output_formulas_as_mathml():
    cells = [nbformat.v4.new_markdown_cell("Load-balancing loss $E \\sum_e f_e P_e$, where\n\n"
                                           "$$\\frac{2(N-1)}{N} \\cdot \\frac{B}{\\beta}$$"),
             nbformat.v4.new_code_cell("show()", outputs=[nbformat.v4.new_output(
                 "display_data", data={"text/latex": "$$x_i^2$$", "text/plain": "<Math>"})])]
    page = notebook_page(nbformat.v4.new_notebook(cells=cells), nav="<nav></nav>")
    found = maths(page)
    assert len(found) == 3, found
    assert ['display="block"' in m for m in found] == [False, True, True]
    assert "<munder>" not in found[0] and "<msub><mo>∑</mo><mi>e</mi></msub>" in found[0]  # inline: a subscript
    assert "<mfrac>" in found[1] and "<msubsup>" in found[2]
    assert "$E" not in page and "\\sum" not in page and "\\frac" not in page
    assert not REMOTE.search(page), REMOTE.search(page).group(0)
    assert not re.search(r"<script\b", page) and "mathjax" not in page.lower()  # nothing runs: the browser draws MathML


def test_a_docs_page_renders_formulas_but_leaves_code_alone():
    page = markdown_page("# Costs\n\nA ring moves $\\frac{2(N-1)}{N}$ of the bytes; `$HOME` stays.\n\n"
                         "$$\\begin{aligned} t &= \\alpha + n/\\beta \\\\ b &= n/t \\end{aligned}$$\n",
                         "Costs", nav="")
    found = maths(page)
    assert len(found) == 2 and "<mtable" in found[1] and "columnalign" in found[1]
    assert "<code>$HOME</code>" in page
    assert "\\frac" not in page and "aligned" not in page
    assert not REMOTE.search(page)


@pytest.mark.parametrize("tex", ["\\foo{x}", "a & b", "\\frac{a}{"])
def test_a_formula_that_cannot_be_rendered_is_named(tex):
    with pytest.raises(FormulaError, match=re.escape(f"${tex}$")):
        mathml(tex)


class Collect(MathMLRenderer):
    """A renderer that keeps each formula's TeX, and whether it is displayed, instead of rendering it."""

    def __init__(self) -> None:
        super().__init__(escape=False)
        self.found: list[tuple[str, bool]] = []

    def inline_math(self, body: str) -> str:
        self.found.append((body, False))
        return ""

    def block_math(self, body: str) -> str:
        self.found.append((body, True))
        return ""

    def latex_environment(self, name: str, body: str) -> str:
        self.found.append((f"\\begin{{{name}}}{body}\\end{{{name}}}", True))
        return ""


def course_formulas() -> list[tuple[str, str, bool]]:
    """(file, TeX, display) of every formula in the notebooks' markdown, the docs and the README."""
    texts = [(p.name, cell.source) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))
             for cell in nbformat.read(p, as_version=4).cells if cell.cell_type == "markdown"]
    texts += [(p.name, p.read_text()) for p in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]]
    found = []
    for name, text in texts:
        collect = Collect()
        MarkdownWithMath(renderer=collect).render(text)
        found += [(name, tex, display) for tex, display in collect.found]
    return found


def test_every_formula_of_the_course_renders():
    formulas = course_formulas()
    assert any(name == "17_experts.ipynb" and "\\sum" in tex for name, tex, _ in formulas)
    failures = []
    for name, tex, display in formulas:
        try:
            mathml(tex, display)
        except FormulaError as error:
            failures.append(f"{name}: {error}")
    assert not failures, "\n".join(failures)


def test_a_build_with_a_formula_it_cannot_render_stops_naming_the_file_and_keeps_the_old_site(tmp_path):
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "costs.md").write_text("# Costs\n\nA step takes $\\stepcost{n}$.\n")
    (tmp_path / "README.md").write_text("# dtlab\n")
    out = tmp_path / "book"
    out.mkdir()
    (out / "index.html").write_text("the previous site")
    with pytest.raises(SystemExit, match=r"costs\.md: cannot render \\stepcost in the formula \$\\stepcost\{n\}\$"):
        build(out, root=tmp_path, cache=tmp_path / "executed", execute_missing=False, say=lambda _: None)
    assert (out / "index.html").read_text() == "the previous site"
