"""Measured-looking numbers on the pages that no committed result stands behind.

A measured number belongs between quote markers (``dtlab.app.quotes``), where it is written from its result.
This scan reads the README, ``docs/`` and the notebooks' markdown cells outside those blocks, and outside the
tables that a run rewrites between its own markers, and lists every number that looks measured: a ratio
(``1.78×``), a percentage, a time, a rate, a float gap (``4.5e-14``) or a decimal of two places or more. A number
that is not a measurement (a version, a paper's identifier, a configuration value, a target) is let through
by ``ALLOWED``, each pattern with the reason it is not one.

    python -m dtlab.app.unquoted     # list them (exit 1 when any)
    python -m dtlab.app.unquoted --shrink tests/quotes_typed_by_hand.txt   # take off the list what left the pages
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat

from dtlab.app.quotes import BLOCK, ROOT, pages

__all__ = ["ALLOWED", "MEASURED", "main", "shrink", "unquoted"]

_NUMBER = r"(?<![\w.^/\-−+])\d[\d,]*(?:\.\d+)?"
_UNIT = (r"(?:×|[ \u00a0]?%|[ \u00a0]?(?:ns|µs|us|ms|s|min|minutes|seconds|hours)\b"
         r"|[ \u00a0]?(?:[kMG]B|[KMG]iB|GFLOP|TFLOP|samples|tokens|steps)/s\b)")
MEASURED = re.compile(rf"{_NUMBER}{_UNIT}|{_NUMBER}e-\d+|(?<![\w.^/\-−+])\d+\.\d{{2,}}(?![\d.])")

# Tables a run writes between its own markers (``make bench``; ``dtlab.experiments.recorder_cost``).
GENERATED = re.compile(r"<!-- (?P<name>bench|recorder-cost):begin -->.*?<!-- (?P=name):end -->", re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")  # an option, a call or a name, as typed: not a result

# (pattern, why it is not a measurement); a flagged number inside a match of one of these is let through.
ALLOWED: tuple[tuple[str, str], ...] = (
    (r"(?:[Tt]orch|Python|torchft)\s?(?:>=|<)?\d+\.\d+(?:\.\d+)?\+?", "a software version"),
    (r"arXiv:\d{4}\.\d{4,5}", "a paper's identifier"),
    (r"(?:\blr|Switch's) \d\.\d+", "a learning rate or a loss coefficient: a configuration value"),
    (r"make that about \d+ %", "arithmetic on the formula just given"),
    (r"\((?:10|60) s by\s+default|30 minutes (?:in plain torch|by default)",
     "a timeout's default, set by dtlab or torch, not timed"),
    (r"(?:target|targets|aim of|≤|<=|tested to|hold|keep)\s~?\d+(?:\.\d)?(?: %|e-\d+| minutes)"
     r"|within (?:[13]0 %|1e-\d+)", "a target or a test's tolerance, set before measuring"),
    (r"(?:gap above|within|bound of|\(bf16:|hold float32 to|\ba|against|\(>)\s+[15]e-\d+\b",
     "a parity test's bound, a power of ten set before measuring (a measured gap has its digits)"),
    (r"±\d+ %", "a guide line drawn on a figure"),
    (r"\| (?:≥|≤) \d\.\d+ \|", "a benchmark's target ratio in a table's target column, set before measuring"),
    (r"(?:every|missing for|a burst of|The(?= 0\.3 s above)|out after|group after|default is"
     r"|waits(?: out the)?|timeout of|`join_timeout`,)\s\**\d+(?:\.\d+)? m?s\**(?! later)",
     "a timeout or an interval dtlab or torchft is configured with (``ft.Options(timeouts=...)``, a test's)"),
    (r"\*\*assumed\*\*[^.]*", "a projection's assumed costs, said to be assumed"),
    (r"4 µs (?:cost )?per kernel", "the planner's per-kernel cost, said to be assumed, not fitted"),
    (r"90 % (?:bootstrap )?interval", "the confidence level an interval is drawn at, chosen before measuring"),
    (r"Mixtral 8×7B", "a model's name"),
    (r"A100's 312 TFLOP/s", "the A100's bf16 peak, from its spec sheet"),
    (r"single GPU 3\.75 s, naive\s+split 4\.02 s, pipelined 2\.43 s", "PyTorch's tutorial's published times"),
    (r"about one every 3\.1 hours", "Llama 3's published fault rate"),
    (r"54 × 24 / 419 = \*\*3\.09 h\*\*", "arithmetic on Llama 3's published fault count and days"),
    (r"MAMF: 85\.9 % of the A100's bf16 peak, 80\.1 % of the H100's"
     r"|FlashAttention-2's published 50 % \(A100\) and 35 % \(H100\)", "published efficiencies, cited"),
)
_ALLOWED = [re.compile(p) for p, _ in ALLOWED]


def _texts(page: Path) -> Iterator[tuple[str, str]]:
    """(where, text): the page, or each markdown cell of a notebook."""
    if page.suffix != ".ipynb":
        yield "", page.read_text()
        return
    for i, cell in enumerate(nbformat.read(page, as_version=4).cells):
        if cell.cell_type == "markdown":
            yield f" cell {i}", cell.source


def _blank(match: re.Match) -> str:
    return re.sub(r"[^\n]", " ", match.group(0))  # keeps the lines where they were


def flagged(text: str) -> list[tuple[int, str, str]]:
    """(line, number, the line's text) for each measured-looking number outside quotes, tables and code."""
    text = GENERATED.sub(_blank, BLOCK.sub(_blank, text))
    allowed = [m.span() for pattern in _ALLOWED for m in pattern.finditer(text)]  # code spans give context
    text = CODE_SPAN.sub(_blank, text)
    lines = text.splitlines()
    out = []
    for m in MEASURED.finditer(text):
        if any(lo <= m.start() and m.end() <= hi for lo, hi in allowed):
            continue
        line = text.count("\n", 0, m.start())
        out.append((line + 1, m.group(0), lines[line].strip()))
    return out


def unquoted(root: Path = ROOT) -> dict[str, str]:
    """Each measured-looking number without a source, ``page: number | its line``, to where it is (cell, line)."""
    found = {}
    for page in pages(root):
        for where, text in _texts(page):
            for line, number, context in flagged(text):
                found.setdefault(f"{page.relative_to(root)}: {number} | {context}", f"{where.strip()} line {line}")
    return found


def shrink(listed: Path, root: Path = ROOT) -> tuple[int, int, list[str]]:
    """Take off ``listed`` (one ``page: number | its line`` a line) what no page states any more; the list only
    shrinks, so a number on the pages and not on the list is returned, not added: (before, after, new)."""
    found, known = set(unquoted(root)), listed.read_text().splitlines()
    kept = [line for line in known if line in found]
    listed.write_text("".join(f"{line}\n" for line in kept))
    return len(known), len(kept), sorted(found - set(known))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtlab.app.unquoted", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shrink", type=Path, metavar="LIST", help="take off LIST the numbers no page states")
    args = parser.parse_args(argv)
    if args.shrink:
        before, after, new = shrink(args.shrink)
        print(f"{args.shrink}: {before} -> {after} entries")
        print("\n".join(f"not on the list (quote it or allow it): {key}" for key in new))
        return 1 if new else 0
    found = unquoted()
    print("\n".join(f"{key}  ({at})" for key, at in found.items())
          or "every measured-looking number is quoted from a result or allowed")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
