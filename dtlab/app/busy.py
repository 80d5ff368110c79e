"""The course on a busy machine: every notebook in quick mode beside processes that keep the cores busy.

    python -m dtlab.app.busy [--hogs 4] [--jobs 2] [--only 00_overview,...] [--out results/busy]

A classroom server is never idle. This starts ``--hogs`` processes that spin on the CPU (each a
plain busy loop, dying with this process), then runs the notebooks as the notebook test does
(``book.run_quick``, ``--jobs`` at a time, each in its own kernel) and writes
``busy_notebooks.csv``: per notebook, whether it passed, the cell that failed if one did, its
seconds, and the load average as it ended. ``busy_notebooks.png`` draws the seconds. It exits 1
if a notebook failed. The measurement is the pass or fail: a notebook's seconds beside the hogs
say how much longer a learner waits, not how fast the code is.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
from nbclient.exceptions import CellExecutionError

from dtlab.app.book import ROOT, run_quick
from dtlab.launch import lifeline
from dtlab.plots import busy as busy_plots
from dtlab.plots.style import save

__all__ = ["hogs", "main", "run_notebooks"]

SPIN = "while True: pass"


def hogs(count: int) -> list[subprocess.Popen]:
    """``count`` processes spinning on the CPU, each ending when this process does (however it ends)."""
    return [subprocess.Popen(lifeline.dying_with_parent([sys.executable, "-c", SPIN])) for _ in range(count)]


def _one(path: Path, timeout_s: int) -> dict:
    t0 = time.perf_counter()
    failed = ""
    with tempfile.TemporaryDirectory(prefix="dtlab-busy-") as scratch:
        try:
            run_quick(path, Path(scratch), timeout_s)
        except CellExecutionError as exc:
            failed = f"{exc.ename}: {exc.evalue}"[:200]
        except TimeoutError as exc:
            failed = f"timed out: {exc}"
    return {"notebook": path.stem, "passed": not failed, "failure": failed,
            "seconds": time.perf_counter() - t0, "load_1min": os.getloadavg()[0]}


def run_notebooks(paths: Sequence[Path], jobs: int, timeout_s: int, log=print) -> pd.DataFrame:
    """Each notebook run in quick mode, ``jobs`` at a time: one row each, in the order given."""
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(_one, path, timeout_s) for path in paths]
        rows = []
        for future in futures:
            rows.append(future.result())
            row = rows[-1]
            log(f"{row['notebook']}: {'passed' if row['passed'] else 'FAILED: ' + row['failure']} "
                f"in {row['seconds']:.0f} s (load {row['load_1min']:.1f})")
    return pd.DataFrame(rows)


def _chosen(only: str) -> list[Path]:
    every = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    if not only:
        return every
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(names) - {p.stem for p in every})
    if unknown:
        raise ValueError(f"--only: no notebook {', '.join(unknown)}; choose from {', '.join(p.stem for p in every)}")
    return [p for p in every if p.stem in names]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hogs", type=int, default=4, help="processes spinning on the CPU beside the notebooks")
    p.add_argument("--jobs", type=int, default=2, help="notebooks run at once, each in its own kernel")
    p.add_argument("--only", default="", help="comma-separated notebook names (default: all)")
    p.add_argument("--timeout", type=int, default=900, help="seconds a cell may take")
    p.add_argument("--out", type=Path, default=Path("results/busy"), help="folder for the CSV and the figure")
    args = p.parse_args(argv)
    if args.hogs < 0 or args.jobs < 1 or args.timeout < 1:
        p.error(f"--hogs {args.hogs} must be >= 0, --jobs {args.jobs} and --timeout {args.timeout} >= 1")
    try:
        paths = _chosen(args.only)
    except ValueError as exc:
        p.error(str(exc))
    args.out.mkdir(parents=True, exist_ok=True)
    spinning = hogs(args.hogs)
    print(f"{len(spinning)} CPU hogs started beside {len(paths)} notebooks ({args.jobs} at a time) on "
          f"{os.cpu_count()} cores", flush=True)
    try:
        table = run_notebooks(paths, args.jobs, args.timeout, log=lambda line: print(line, flush=True))
    finally:
        for hog in spinning:
            hog.kill()
            hog.wait()
    table.to_csv(args.out / "busy_notebooks.csv", index=False)
    save(busy_plots.notebook_seconds(table, hogs=args.hogs, cores=os.cpu_count() or 1),
         args.out / "busy_notebooks.png")
    print(f"{int(table.passed.sum())} of {len(table)} notebooks passed beside {args.hogs} CPU hogs; "
          f"wrote {args.out}/busy_notebooks.csv and busy_notebooks.png")
    return 0 if table.passed.all() else 1


if __name__ == "__main__":
    sys.exit(main())
