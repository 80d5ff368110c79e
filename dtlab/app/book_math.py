"""The book's formulas as MathML, made when the book is built, so a page shows them offline and without a script.

latex2mathml (pure Python) turns each formula's TeX into MathML, which browsers lay out themselves (Chromium
and Edge since version 109, Firefox, Safari): nothing is bundled into the site and nothing is fetched. It reads
the TeX that JupyterLab's MathJax and GitHub read, ``$...$`` inline and ``$$...$$`` or an environment on a
line of its own for display. A formula it cannot convert stops the build with an error naming the formula,
rather than leave raw TeX on a page.
"""

from __future__ import annotations

import re
from typing import Any

from jinja2 import pass_context
from latex2mathml.converter import convert
from nbconvert import HTMLExporter
from nbconvert.filters.markdown_mistune import IPythonRenderer, MarkdownWithMath

# A notebook aligns equations with MathJax's `aligned` inside $$; latex2mathml knows the same layout as `align*`.
_ALIGNED = re.compile(r"\\(begin|end)\{aligned\}")
# What latex2mathml passes through unconverted: an unknown command, or a column separator outside a table.
_UNCONVERTED = re.compile(r"<m[io]>(\\[A-Za-z]+|&)</m[io]>")
# A font with OpenType maths tables (macOS, Windows, TeX Live, Debian's fonts-dejavu-extra) sizes sums and roots;
# MathML Core leaves out latex2mathml's columnalign, so aligned equations keep their columns through CSS (Chromium
# aligns a cell's formula to the right only with -webkit-right), an align's two sides meeting at the `=`.
MATH_CSS = ('math{font-family:"STIX Two Math","Cambria Math","Latin Modern Math","DejaVu Math TeX Gyre",math}'
            "math[display=block]{margin:.8em 0}"
            "mtd[columnalign=right]{text-align:right;text-align:-webkit-right}"
            "mtd[columnalign=left]{text-align:left;text-align:-webkit-left}"
            'mtable[columnspacing^="0em"]>mtr>mtd{padding-left:0;padding-right:0}')


class FormulaError(ValueError):
    """A formula that latex2mathml cannot turn into MathML."""


def mathml(tex: str, display: bool = False) -> str:
    """The MathML of the TeX formula ``tex``, inline or on a line of its own; FormulaError if it cannot."""
    source = _ALIGNED.sub(lambda m: "\\" + m.group(1) + "{align*}", tex)
    try:
        markup = convert(source, display="block" if display else "inline")
    except Exception as error:  # latex2mathml's own errors carry no message worth more than its name
        raise FormulaError(f"cannot render the formula ${tex}$ ({type(error).__name__}: {error})") from None
    left = _UNCONVERTED.search(markup)
    if left:
        raise FormulaError(f"cannot render {left.group(1)} in the formula ${tex}$ (latex2mathml does not know it)")
    return markup


class MathMLRenderer(IPythonRenderer):
    """nbconvert's markdown renderer, with formulas as MathML where it leaves their TeX for MathJax."""

    def inline_math(self, body: str) -> str:
        return mathml(body)

    def block_math(self, body: str) -> str:
        return mathml(body, display=True)

    def latex_environment(self, name: str, body: str) -> str:
        return mathml(f"\\begin{{{name}}}{body}\\end{{{name}}}", display=True)


def markdown_html(source: str) -> str:
    """Markdown to HTML as nbconvert renders it, formulas as MathML."""
    return MarkdownWithMath(renderer=MathMLRenderer(escape=False)).render(source)


class MathMLExporter(HTMLExporter):
    """nbconvert's HTML exporter whose markdown filter (markdown cells, markdown and LaTeX outputs) writes MathML."""

    @pass_context  # a template filter that reads the cell being rendered, as the method it replaces
    def markdown2html(self, context: Any, source: str) -> str:
        # As HTMLExporter.markdown2html, with the renderer swapped.
        cell = context.get("cell", {})
        renderer = MathMLRenderer(escape=False, attachments=cell.get("attachments", {}),
                                  embed_images=self.embed_images,
                                  path=context.get("resources", {}).get("metadata", {}).get("path", ""),
                                  anchor_link_text=self.anchor_link_text,
                                  exclude_anchor_links=self.exclude_anchor_links, **self.lexer_options)
        return MarkdownWithMath(renderer=renderer).render(source)
