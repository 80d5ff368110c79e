"""``python -m dtlab bench``: run every script in ``benchmarks/`` and collect their result lines.

Each benchmark prints ``NAME: measured RATIO (target ...) pass|MISS -- detail``;
this runner runs them one after another (never two at once: they would disturb
each other's timings), parses those lines and writes ``summary.csv`` and
``summary.md`` with the date and the machine; ``--docs`` puts that table into
``docs/measurement.md`` between its ``bench:begin`` and ``bench:end`` markers.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dtlab.app.bench_group import STATUS

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"
# a name may carry one bracketed qualifier: ``ft_recovery[tuned timeouts]``
RESULT = re.compile(r"^(?P<name>[\w.]+(?:\[[^\]\n]+\])?): measured (?P<value>[-\d.e+naninf]+) "
                    r"\(target (?P<target>[^)]*)\)(?P<verdict> pass| MISS)?"
                    r"(?P<quick> \[quick[^\]]*\])?(?: -- (?P<detail>.*))?$")


def scripts(only: list[str] | None = None) -> list[Path]:
    if not BENCH_DIR.is_dir():
        raise ValueError(f"no benchmarks folder at {BENCH_DIR}: run from a dtlab checkout")
    # plain_*_script.py are the baselines that the *_vs_script benchmarks start under torchrun, not benchmarks
    found = sorted(p for p in BENCH_DIR.glob("*.py") if not p.name.startswith(("_", "plain_")))
    if only:
        unknown = sorted(set(only) - {p.stem for p in found})
        if unknown:
            raise ValueError(f"unknown benchmark(s) {unknown}: choose from {[p.stem for p in found]}")
        found = [p for p in found if p.stem in only]
    return found


def parse(output: str) -> list[dict[str, str]]:
    return [m.groupdict() for line in output.splitlines() if (m := RESULT.match(line.strip()))]


def machine() -> str:
    return f"{platform.node()}: {os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}"


def run_all(out: Path, quick: bool = False, only: list[str] | None = None,
            jobs: int | None = None) -> list[dict[str, str]]:
    """Run the benchmarks; raises RuntimeError naming any that failed, after running the rest.

    ``jobs``: how many scripts run at once. A measurement runs alone (1, the default of a full run), each
    script in a fresh process; a quick smoke run only checks that each script works, so it runs two at once
    (its numbers are not measurements either way), each of the two an interpreter that runs script after
    script (``dtlab.app.bench_group``): Python, torch and the forkserver start twice, not once a script.
    """
    out.mkdir(parents=True, exist_ok=True)
    jobs = jobs or (2 if quick else 1)
    rows, failed = [], []
    todo = scripts(only)
    if quick:
        finished = _run_grouped(todo, out, jobs)
    else:
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            finished = dict(zip(todo, pool.map(lambda script: _run_script(script, out, quick), todo)))
    for script in todo:  # reported in order, whichever finished first
        proc = finished[script]
        found = parse(proc.stdout)
        for row in found:
            print(f"   {row['name']}: {row['value']} (target {row['target']}){row['verdict'] or ''}", flush=True)
        if proc.returncode != 0 or not found:
            failed.append(f"{script.stem} (exit {proc.returncode}; see {out / (script.stem + '.log')}; "
                          f"it ended:\n{_tail(proc.stdout + proc.stderr)})")
        rows += [{"script": script.stem, **row} for row in found]
    write_summary(out, rows, quick)
    if failed:
        raise RuntimeError("benchmarks failed: " + ", ".join(failed))
    return rows


def _tail(text: str, lines: int = 15) -> str:
    """The last lines of a failed script's output, so a failure names its cause where only the error is kept."""
    return "\n".join("    " + line for line in text.strip().splitlines()[-lines:])


def _run_grouped(todo: list[Path], out: Path, jobs: int) -> dict[Path, subprocess.CompletedProcess]:
    """Each script run by one of ``jobs`` group interpreters, handed out as each group finishes its last."""
    queue = list(todo)
    lock = threading.Lock()
    finished: dict[Path, subprocess.CompletedProcess] = {}

    def group() -> None:
        cmd = [sys.executable, "-m", "dtlab.app.bench_group", str(out)]
        with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              cwd=BENCH_DIR.parent) as proc:
            while True:
                with lock:
                    script = queue.pop(0) if queue else None
                if script is None:
                    break
                print(f"== {script.stem}", flush=True)
                try:
                    proc.stdin.write(f"{script}\n")
                    proc.stdin.flush()
                except BrokenPipeError:  # this group has ended: the others take its script
                    with lock:
                        queue.insert(0, script)
                    break
                code = _status(proc, script.stem)
                log = out / f"{script.stem}.log"
                text = log.read_text(errors="replace") if log.exists() else ""
                finished[script] = subprocess.CompletedProcess(cmd, code, stdout=text, stderr="")
                if code == -1:
                    break
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
    threads = [threading.Thread(target=group, name=f"bench-group-{i}") for i in range(min(jobs, len(todo)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lost = [s for s in todo if s not in finished]  # a group that died took its script with it
    for script in lost:
        finished[script] = subprocess.CompletedProcess([], -1, stdout="", stderr="its group's interpreter ended")
    return finished


def _status(proc: subprocess.Popen, name: str) -> int:
    """The exit code the group reports for ``name``; -1 where the group ended first."""
    for line in proc.stdout:
        if line.startswith(STATUS.format(name=name, code="")):
            return int(line.rsplit(" ", 1)[1])
    return -1


def _run_script(script: Path, out: Path, quick: bool) -> subprocess.CompletedProcess:
    print(f"== {script.stem}", flush=True)
    cmd = [sys.executable, str(script), "--out", str(out), *(["--quick"] if quick else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH_DIR.parent)
    (out / f"{script.stem}.log").write_text(proc.stdout + proc.stderr)
    return proc


def write_summary(out: Path, rows: list[dict[str, str]], quick: bool) -> None:
    import pandas as pd

    pd.DataFrame(rows).to_csv(out / "summary.csv", index=False)
    date = datetime.date.today().isoformat()
    lines = [f"Measured {date} on {machine()}{' (quick smoke run: not measurements)' if quick else ''}.", "",
             "| benchmark | measured | target | verdict | detail |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        verdict = (r["verdict"] or "").strip() or "—"
        lines.append(f"| `{r['name']}` | {float(r['value']):.3f} | {r['target']} | {verdict} | {r['detail'] or ''} |")
    (out / "summary.md").write_text("\n".join(lines) + "\n")


BENCH_BEGIN, BENCH_END = "<!-- bench:begin -->", "<!-- bench:end -->"
BENCH_DOC = BENCH_DIR.parent / "docs" / "measurement.md"  # the page whose benchmark table ``--docs`` rewrites


def update_doc(path: Path, summary_md: str) -> None:
    """Replace what lies between the page's bench markers with ``summary_md`` (written atomically)."""
    text = path.read_text()
    start, end = text.find(BENCH_BEGIN), text.find(BENCH_END)
    if start < 0 or end < start:
        raise ValueError(f"{path} has no {BENCH_BEGIN} ... {BENCH_END} section to regenerate")
    new = text[:start + len(BENCH_BEGIN)] + "\n" + summary_md.strip() + "\n" + text[end:]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(new)
    tmp.replace(path)
