"""Every notebook runs top to bottom in a real Jupyter kernel, in quick mode."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from dtlab.app.book import CACHE as EXECUTIONS
from dtlab.app.book import executions, run_quick, save_execution
from dtlab.app.predict import HEADLESS_NOTE

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert NOTEBOOKS and NOTEBOOKS[0].name == "00_overview.ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    assert all(not c.get("outputs") and not c.get("execution_count") for c in nb.cells if c.cell_type == "code")


# A cell that calls the exercises or the bug zoo is the learner's to write; the rest is the lesson, kept short.
LEARNER_CELL = re.compile(r"\b(exercises|bugzoo)\.")
INLINE_DRAWING = re.compile(r"\bFigure\(|\bplt\.|\.subplots\(|\bax\.(plot|bar|barh|scatter|imshow)\(")


def code_lines(source: str) -> int:
    return sum(1 for line in source.splitlines() if line.strip() and not line.strip().startswith("#"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_a_lesson_is_short_and_draws_through_the_package(path):
    nb = nbformat.read(path, as_version=4)
    lesson = [c.source for c in nb.cells if c.cell_type == "code" and not LEARNER_CELL.search(c.source)]
    assert sum(code_lines(s) for s in lesson) <= 150, f"{path.name}: move plumbing into the package"
    drawn = [s.splitlines()[0] for s in lesson if INLINE_DRAWING.search(s)]
    assert not drawn, f"{path.name} draws a figure inline (put it in dtlab.plots): {drawn}"
    assert not re.search(r"import \w+ as \w+_runs\b", "\n".join(lesson)), f"{path.name}: no *_runs aliases"


def test_the_checks_above_catch_what_they_look_for():
    assert code_lines("a = 1\n\n# why\nb = 2\n") == 2
    assert INLINE_DRAWING.search("fig = Figure(figsize=(3, 2))") and INLINE_DRAWING.search("ax.barh(x, y)")
    assert not INLINE_DRAWING.search("plots.checkpointing(table)")
    assert LEARNER_CELL.search("exercises.check('tp_mlp', my_tp_mlp)") and not LEARNER_CELL.search("plots.gantt(f)")


# Two notebooks run at once, each in its own kernel: a busy machine must not fail a notebook (a classroom server
# is one), and what one notebook spends waiting for processes to start, the other spends computing.
NOTEBOOK_JOBS = 2


def timed_run(path: Path, folder: Path) -> tuple[nbformat.NotebookNode, float]:
    t0 = time.perf_counter()
    return run_quick(path, folder, timeout_s=300), time.perf_counter() - t0


@pytest.fixture(scope="module")
def executed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Future]:
    """The selected notebooks' executions, started together on first use (``NOTEBOOK_JOBS`` at a time)."""
    chosen = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", "") == "test_notebook_runs_in_quick_mode"]
    pool = ThreadPoolExecutor(max_workers=NOTEBOOK_JOBS)
    yield {path: pool.submit(timed_run, path, tmp_path_factory.mktemp(path.stem)) for path in chosen}
    pool.shutdown(cancel_futures=True)  # a stopped session starts none of the notebooks still queued


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_in_quick_mode(path, executed):
    nb, elapsed = executed[path].result()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    printed = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    if ".reveal(" in path.read_text():  # nbclient is no live front-end: the measurement shows at once, saying why
        assert "measured:" in printed and HEADLESS_NOTE in printed
    save_execution(nb, path, EXECUTIONS)  # the book (below, and `make book`) renders these
    print(f"{path.name}: {elapsed:.1f} s (beside another notebook)")


def _offline(cmd: list[str]) -> list[str]:
    """``cmd`` in a network namespace of its own with loopback only, where this machine allows one (root)."""
    if shutil.which("unshare") and subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0:
        return ["unshare", "--net", "sh", "-c", 'ip link set lo up 2>/dev/null; exec "$@"', "sh", *cmd]
    if os.environ.get("CI") == "true":
        pytest.fail("CI must check that the book builds offline, and `unshare --net` is not available")
    pytest.skip("`unshare --net` needs root: the offline build is checked where it is available")


@pytest.mark.slow
def test_the_book_builds_offline_from_the_executions_and_a_page_shows_a_plot_and_a_formula(tmp_path):
    from tests.test_book_formulas import REMOTE
    from tests.test_browser import CHROMIUM, CHROMIUM_ARGS, _missing

    executions(NOTEBOOKS, EXECUTIONS, execute_missing=True, say=print)  # only those the test above did not run
    out = tmp_path / "book"
    cmd = [sys.executable, "-m", "dtlab.app.book", "--out", str(out), "--no-execute"]
    done = subprocess.run(_offline(cmd), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    pages = sorted((out / "notebooks").glob("*.html"))
    assert [p.stem for p in pages] == [p.stem for p in NOTEBOOKS]
    docs = sorted((out / "docs").glob("*.html"))
    assert len(docs) >= 3
    for page in [out / "index.html", *pages, *docs]:
        assert not REMOTE.search(page.read_text()), page.name  # nothing loaded from a CDN, MathJax included
    with_formulas = [page for page in [*pages, *docs] if "<msub>" in page.read_text()]
    assert with_formulas, "notebook 17's load-balancing loss is a formula with subscripts, rendered as MathML"
    compare = (out / "notebooks" / "11_compare.html").read_text()
    assert "make lab" in compare, "a widget is replaced by a note saying where it runs"

    reason = _missing()
    if reason and os.environ.get("CI") == "true":
        pytest.fail(f"the book's browser check cannot run under CI: {reason}")
    if reason:
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.goto((out / "index.html").as_uri())
            course = page.locator(".dtlab-course ol a")
            assert course.count() == len(NOTEBOOKS)
            course.filter(has_text="Single").first.click()  # notebook 01: the single-device baseline's plots
            page.wait_for_selector("img[src^='data:image/png']", timeout=20_000)
            plot = page.locator("img[src^='data:image/png']").first
            plot.scroll_into_view_if_needed()
            assert plot.is_visible()
            assert page.evaluate("(img) => img.naturalWidth", plot.element_handle()) > 100
            assert "01_single_device" in page.url
            page.screenshot(path=str(tmp_path / "book-page.png"))
            assert_formula_drawn(page, with_formulas[0])
        finally:
            browser.close()


def assert_formula_drawn(page, html_file: Path) -> None:
    """A formula with a subscript is laid out as MathML (the subscript below its base's baseline, as a browser
    without MathML would not place it) and its paragraph shows no TeX."""
    page.goto(html_file.as_uri())
    formula = page.locator("math:has(msub)").first
    formula.scroll_into_view_if_needed()
    box = formula.bounding_box()
    assert box and box["width"] > 5 and box["height"] > 5, box
    assert page.evaluate("(m) => m instanceof MathMLElement", formula.element_handle())
    base, subscript = (formula.locator("msub").first.locator(":scope > *").nth(k).bounding_box() for k in (0, 1))
    assert subscript["y"] + subscript["height"] > base["y"] + base["height"] + 1, (base, subscript)
    assert subscript["x"] >= base["x"] + base["width"] - 1, (base, subscript)
    paragraph = formula.locator("xpath=ancestor::*[self::p or self::li or self::td][1]").inner_text()
    assert "$" not in paragraph and "\\" not in paragraph, paragraph
    page.screenshot(path=str(html_file.parent / f"{html_file.stem}-formula.png"))
