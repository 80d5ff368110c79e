"""The README is a short front door, and every relative link in it and in docs/ leads somewhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# [text](target) and ![alt](target); a target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> str:
    """The page without code blocks and code spans, where a bracket is not a link."""
    return CODE.sub("", FENCE.sub("", text))


def _anchors(page: Path) -> set[str]:
    """The heading anchors GitHub makes: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def _relative_links(page: Path) -> list[str]:
    return [t for t in LINK.findall(_prose(page.read_text())) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        path, _, fragment = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif fragment and file.suffix == ".md" and fragment not in _anchors(file):
            broken.append(f"{target}: no heading #{fragment} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_pages_link_to_each_other():
    assert {p.name for p in PAGES} >= {"tiers.md", "measurement.md", "exercises.md", "architecture.md",
                                        "determinism.md", "troubleshooting.md"}
    readme_links = {t.partition("#")[0] for t in _relative_links(ROOT / "README.md")}
    for page in PAGES[1:]:
        assert f"docs/{page.name}" in readme_links, f"README.md does not link to docs/{page.name}"


def test_readme_is_a_short_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    for command in ("make demo", "make test", "make lab", "make book"):
        assert command in text, f"README.md does not mention {command}"


def test_the_bench_markers_are_in_the_measurement_page_only():
    from dtlab.app.bench import BENCH_BEGIN, BENCH_DOC, BENCH_END

    for page in PAGES:
        text = page.read_text()
        if page == BENCH_DOC:
            assert text.count(BENCH_BEGIN) == 1 and text.count(BENCH_END) == 1
            assert text.index(BENCH_BEGIN) < text.index(BENCH_END)
        else:
            assert BENCH_BEGIN not in text, f"{page.relative_to(ROOT)} has a bench table that no command rewrites"


def test_every_figure_is_shown_somewhere():
    shown = {(page.parent / t.partition("#")[0]).resolve() for page in PAGES for t in _relative_links(page)}
    unshown = [f.name for f in sorted((ROOT / "docs" / "figures").glob("*.png")) if f.resolve() not in shown]
    assert not unshown, f"figures no page shows: {unshown}"


def test_every_figure_a_page_shows_has_a_command_that_makes_it():
    from dtlab.app.figures import FIGURES  # the table `make figures` runs

    shown = {(page.parent / t.partition("#")[0]).resolve().relative_to(ROOT).as_posix()
             for page in PAGES for t in _relative_links(page) if t.partition("#")[0].endswith(".png")}
    assert shown, "no page shows a figure"
    missing = sorted(shown - set(FIGURES))
    assert not missing, f"figures with no command in dtlab/app/figures.py (make figures): {missing}"
    pages = "\n".join(page.read_text() for page in PAGES)
    for path, figure in FIGURES.items():
        assert (ROOT / path).exists(), f"{path}: in the table of figures, but not in the checkout"
        assert figure.command in pages, f"{path}: no page gives its command {figure.command!r}"


def test_every_figure_has_its_data_beside_it():
    from dtlab.app.figures import FIGURES

    for png in sorted((ROOT / "docs" / "figures").glob("*.png")):
        csv = png.with_suffix(".csv").relative_to(ROOT).as_posix()
        assert csv in FIGURES, f"{png.name}: no {Path(csv).name} beside it made by `make figures`"
        assert FIGURES[csv].command == FIGURES[png.relative_to(ROOT).as_posix()].command, (
            f"{csv}: made by another command than {png.name}")
