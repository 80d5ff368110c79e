"""Several benchmark scripts run one after another in one interpreter: the quick smoke run's way.

    python -m dtlab.app.bench_group OUT SCRIPT [SCRIPT ...]
    python -m dtlab.app.bench_group OUT          # the scripts' paths on stdin, one a line, as they are handed out

A smoke run checks that every script works, not what it measures, and most of a quick script's time is
starting: Python, torch, pandas, and the forkserver with every tier preloaded, several seconds of CPU each
time. Here they are paid once for the scripts of a group. Each script runs as ``__main__`` with
``--out OUT --quick``, its output (its subprocesses' too) in ``OUT/NAME.log``; the line
``bench_group: NAME exit CODE`` on this process's own output says how it ended. A full run never comes
here: a measurement runs alone, in a fresh process (``dtlab.app.bench``).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

STATUS = "bench_group: {name} exit {code}"

__all__ = ["STATUS", "main", "run_script"]


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """File descriptors 1 and 2 to ``path`` (what the script's own subprocesses write too), then back."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _exit_code(exc: SystemExit) -> int:
    """What the interpreter would exit with: a message goes to stderr and means 1, as ``sys.exit("...")`` does."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def run_script(script: Path, out: Path) -> int:
    """Run ``script --out OUT --quick`` as ``__main__`` here; its exit code (1 for an exception, printed)."""
    argv, path = sys.argv, list(sys.path)
    sys.argv = [str(script), "--out", str(out), "--quick"]
    sys.path.insert(0, str(script.parent))  # as ``python SCRIPT`` has it: the scripts import their neighbours
    try:
        with _output_to(out / f"{script.stem}.log"):
            try:
                runpy.run_path(str(script), run_name="__main__")
                return 0
            except SystemExit as exc:
                return _exit_code(exc)
            except BaseException:  # noqa: BLE001 - reported in the script's log, as the interpreter would
                traceback.print_exc()
                return 1
    finally:
        sys.argv, sys.path[:] = argv, path


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    # from stdin, a runner hands each group its next script as the last one ends: the groups stay evenly busy
    scripts = argv[1:] or (line.strip() for line in sys.stdin if line.strip())
    for script in map(Path, scripts):
        print(STATUS.format(name=script.stem, code=run_script(script, out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
