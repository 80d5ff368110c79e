"""The course as a static site: every notebook executed in quick mode and rendered, with the docs pages.

    python -m dtlab.app.book --out build/book      # what `make book` runs; open build/book/index.html

The pages are made with nbconvert, the Jupyter project's own converter: it comes with JupyterLab, and its
templates ship inside the package, so the build reads nothing from the network (a site generator with a
theme, such as mkdocs-jupyter or Jupyter Book, would add dependencies for the same pages). The pages load
no external script either: a static page cannot run a widget, so each widget is replaced by a short note,
and formulas are MathML made at build time (book_math), which the browser draws without MathJax.

Executing the notebooks is the slow part, so executions are kept in ``build/executed/``, keyed on the
notebook's text and on dtlab's source. ``make test`` executes every notebook anyway and leaves its
executions there (tests/test_notebooks.py), so a book built after it executes nothing again; a notebook
or a line of dtlab changed since executes anew.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import html
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from pygments.formatters import HtmlFormatter

from dtlab.app.book_math import MATH_CSS, FormulaError, MathMLExporter, markdown_html

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(__file__).resolve().parents[1]
CACHE = ROOT / "build" / "executed"
TEMPLATES = Path(__file__).resolve().parent / "book_templates"
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = ('<p class="dtlab-widget-note"><i>An interactive panel appears here when the notebook runs in '
               "JupyterLab (<code>make lab</code>).</i></p>")
QUICK_ENV = {"DTLAB_QUICK": "1", "MPLBACKEND": "Agg"}


# -- executions -----------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _package_digest() -> str:
    digest = hashlib.sha256()
    for path in sorted(PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def execution_key(notebook: Path) -> str:
    """What an execution of ``notebook`` depends on: its text and dtlab's source."""
    return hashlib.sha256(notebook.read_bytes() + _package_digest().encode()).hexdigest()


def save_execution(nb: nbformat.NotebookNode, notebook: Path, cache: Path = CACHE) -> Path:
    """Keep an executed copy of ``notebook`` for the book (tests/test_notebooks.py calls this too)."""
    cache.mkdir(parents=True, exist_ok=True)
    nb.metadata["dtlab"] = {"execution_key": execution_key(notebook)}
    target = cache / notebook.name
    tmp = target.with_suffix(".tmp")
    nbformat.write(nb, tmp)
    tmp.replace(target)  # a build reading the cache never sees half a notebook
    return target


def cached_execution(notebook: Path, cache: Path = CACHE) -> nbformat.NotebookNode | None:
    """The kept execution of ``notebook`` if it is of the current notebook and dtlab, else None."""
    path = cache / notebook.name
    if not path.is_file():
        return None
    try:
        nb = nbformat.read(path, as_version=4)
    except Exception:  # a damaged file is only a missed cache hit
        return None
    return nb if nb.metadata.get("dtlab", {}).get("execution_key") == execution_key(notebook) else None


def run_quick(notebook: Path, folder: Path, timeout_s: int = 600) -> nbformat.NotebookNode:
    """``notebook`` run top to bottom in quick mode by a fresh kernel started in ``folder``; raises
    CellExecutionError, naming the cell, where one fails. Only the kernel's environment is set, so that
    several notebooks may run at once from threads of one process."""
    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", resources={"metadata": {"path": str(folder)}})
    client.execute(env={**os.environ, **QUICK_ENV})
    return nb


def execute(notebook: Path, cache: Path = CACHE, timeout_s: int = 600) -> nbformat.NotebookNode:
    """Run ``notebook`` top to bottom in quick mode in a scratch folder, and keep the execution."""
    with tempfile.TemporaryDirectory(prefix="dtlab-book-") as scratch:
        nb = run_quick(notebook, Path(scratch), timeout_s)
    save_execution(nb, notebook, cache)
    return nb


# -- pages ----------------------------------------------------------------------------------------------------
def heading_of(markdown: str) -> str | None:
    """The first heading of a markdown text, as plain text (None without one)."""
    match = re.search(r"^#+\s+(.+)$", markdown, re.MULTILINE)
    return match.group(1).strip() if match else None


def title_of(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The notebook's first markdown heading, as plain text."""
    headings = (heading_of(cell.source) for cell in nb.cells if cell.cell_type == "markdown")
    return next((h for h in headings if h), fallback)


def without_widgets(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy whose widget outputs are a note: a static page has no kernel for them to talk to."""
    nb = nbformat.from_dict(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if WIDGET_MIME in output.get("data", {}):
                output["data"] = {"text/html": WIDGET_NOTE}
    return nb


def _site_links(page: str) -> str:
    """Links between repository files become links between pages: .md and .ipynb to .html, README to index."""
    def rewrite(match: re.Match[str]) -> str:
        target = match.group(1)
        if re.match(r"^[a-z]+:|^#", target):
            return match.group(0)
        path, _, fragment = target.partition("#")
        if path.endswith("README.md"):
            path = path[: -len("README.md")] + "index.html"
        elif path.endswith((".md", ".ipynb")):
            path = path.rsplit(".", 1)[0] + ".html"
        return f'href="{path}{"#" + fragment if fragment else ""}"'

    return re.sub(r'href="([^"]*)"', rewrite, page)


def nav_bar(up: str, pages: Sequence[tuple[str, str]], here: int | None) -> str:
    """The bar at the top of every page: home, and the previous and next notebook."""
    links = [f'<a href="{up}index.html">dtlab course</a>']
    if here is not None:
        if here > 0:
            links.append(f'<a href="{up}{pages[here - 1][0]}">← {html.escape(pages[here - 1][1])}</a>')
        if here + 1 < len(pages):
            links.append(f'<a href="{up}{pages[here + 1][0]}">{html.escape(pages[here + 1][1])} →</a>')
    return f'<nav class="dtlab-nav">{" · ".join(links)}</nav>'


NAV_CSS = (".dtlab-nav{font:14px sans-serif;padding:8px 16px;background:#f3f4f6;border-bottom:1px solid #d0d7de}"
           ".dtlab-nav a{margin-right:8px}")
PAGE_CSS = ("body{max-width:980px;margin:0 auto;font:16px/1.55 sans-serif;color:#1f2328}"
            "main{padding:0 16px 48px}img{max-width:100%}table{border-collapse:collapse}"
            "td,th{border:1px solid #d0d7de;padding:4px 8px}pre{background:#f6f8fa;padding:8px;overflow:auto}"
            "code{background:#f6f8fa}a.anchor-link{visibility:hidden;text-decoration:none;margin-left:6px}"
            "h1:hover>a.anchor-link,h2:hover>a.anchor-link,h3:hover>a.anchor-link{visibility:visible}")


def _github_anchors(page: str) -> str:
    """Heading ids as GitHub makes them (lower case, punctuation dropped, spaces to hyphens, repeats numbered),
    so a link to ``page.md#section`` lands on its section in the book as it does on GitHub."""
    seen: dict[str, int] = {}

    def rename(match: re.Match[str]) -> str:
        level, inner = match.group(1), match.group(3)
        text = html.unescape(re.sub(r"<[^>]+>", "", inner))
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        new = slug if count == 0 else f"{slug}-{count}"
        return f'<h{level} id="{new}">{inner}<a class="anchor-link" href="#{new}">'

    return re.sub(r'<h(\d) id="([^"]*)">(.*?)<a class="anchor-link" href="#\2">', rename, page)


def markdown_page(markdown: str, title: str, nav: str) -> str:
    """A page from a markdown file: the text rendered, with the site's bar and no external resource."""
    body = _site_links(_github_anchors(markdown_html(markdown)))
    style = NAV_CSS + MATH_CSS + PAGE_CSS + HtmlFormatter().get_style_defs(".highlight")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{style}</style></head><body>{nav}<main>{body}</main></body></html>\n")


def notebook_page(nb: nbformat.NotebookNode, nav: str) -> str:
    """A page from an executed notebook: its cells, printed outputs and plots, widgets as a note."""
    exporter = MathMLExporter(template_name="dtlab", extra_template_basedirs=[str(TEMPLATES)])
    resources = {"dtlab_nav": nav, "dtlab_css": NAV_CSS + MATH_CSS}
    page, _ = exporter.from_notebook_node(without_widgets(nb), resources=resources)
    return _site_links(page)


def course_list(pages: Sequence[tuple[str, str]], docs: Sequence[tuple[str, str]]) -> str:
    """The index's list of notebook pages and docs pages."""
    notebooks = "".join(f'<li><a href="{href}">{html.escape(title)}</a></li>' for href, title in pages)
    documents = "".join(f'<li><a href="{href}">{html.escape(title)}</a></li>' for href, title in docs)
    return (f'<section class="dtlab-course"><h2>The course, executed in quick mode</h2><ol start="0">{notebooks}</ol>'
            f"<h2>Method and measurements</h2><ul>{documents}</ul></section>")


# -- the build ------------------------------------------------------------------------------------------------
def executions(notebooks: Sequence[Path], cache: Path, execute_missing: bool,
               say: Callable[[str], None]) -> list[nbformat.NotebookNode]:
    """Every notebook's execution: the kept one where it is current, else run now (or an error naming it)."""
    stale = [nb for nb in notebooks if cached_execution(nb, cache) is None]
    if stale and not execute_missing:
        raise SystemExit(f"dtlab book: no current execution of {', '.join(p.name for p in stale)} in {cache}; "
                         "build without --no-execute to run them")
    done = []
    for k, notebook in enumerate(notebooks, 1):
        nb = cached_execution(notebook, cache)
        if nb is None:
            say(f"[{k}/{len(notebooks)}] executing {notebook.name} in quick mode ...")
            start = time.perf_counter()
            nb = execute(notebook, cache)
            say(f"[{k}/{len(notebooks)}] {notebook.name}: {time.perf_counter() - start:.0f} s")
        done.append(nb)
    return done


@contextmanager
def _naming(source: Path) -> Iterator[None]:
    """A formula that cannot be rendered stops the build with one line naming its file."""
    try:
        yield
    except FormulaError as error:
        raise SystemExit(f"dtlab book: {source.name}: {error}") from None


def build(out: Path, *, root: Path = ROOT, cache: Path = CACHE, execute_missing: bool = True,
          say: Callable[[str], None] = print) -> Path:
    """Write the site into ``out`` (index.html, notebooks/*.html, docs/*.html, docs/figures/); returns the index."""
    notebooks = sorted((root / "notebooks").glob("*.ipynb"))
    docs = sorted((root / "docs").glob("*.md"))
    executed = executions(notebooks, cache, execute_missing, say)
    pages = [(f"notebooks/{p.stem}.html", title_of(nb, p.stem)) for p, nb in zip(notebooks, executed)]
    doc_pages = [(f"docs/{p.stem}.html", heading_of(p.read_text()) or p.stem) for p in docs]
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    (staging / "notebooks").mkdir(parents=True)
    (staging / "docs").mkdir()
    for k, (notebook, nb) in enumerate(zip(notebooks, executed)):
        with _naming(notebook):
            (staging / pages[k][0]).write_text(notebook_page(nb, nav_bar("../", pages, k)))
    for path, (href, title) in zip(docs, doc_pages):
        with _naming(path):
            (staging / href).write_text(markdown_page(path.read_text(), title, nav_bar("../", pages, None)))
    if (root / "docs" / "figures").is_dir():
        shutil.copytree(root / "docs" / "figures", staging / "docs" / "figures")
    with _naming(root / "README.md"):
        index = markdown_page((root / "README.md").read_text(), "dtlab", nav_bar("", pages, None))
    index = index.replace("</main>", course_list(pages, doc_pages) + "</main>")
    (staging / "index.html").write_text(index)
    shutil.rmtree(out, ignore_errors=True)  # a failed build above leaves the previous site in place
    staging.replace(out)
    say(f"the course: {out / 'index.html'} ({len(pages)} notebooks, {len(doc_pages)} docs pages)")
    return out / "index.html"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.app.book", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "book", help="folder of the site")
    parser.add_argument("--cache", type=Path, default=CACHE, help="folder of the kept executions")
    parser.add_argument("--no-execute", action="store_true",
                        help="use kept executions only; fail naming any notebook without a current one")
    args = parser.parse_args(argv)
    build(args.out, cache=args.cache, execute_missing=not args.no_execute)
    return 0


if __name__ == "__main__":
    sys.exit(main())
