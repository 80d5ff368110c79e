"""Where a command's results go: a folder checked before any process starts, and a fallback when saving fails."""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtlab.core.results import RunResult


def check_writable(folder: str | os.PathLike[str], flag: str) -> Path:
    """Make sure ``folder`` can be created and written, before any process starts; leaves no trace.

    ValueError naming ``flag`` otherwise: a run that trains for minutes and then cannot save loses its results.
    """
    out = Path(folder)
    missing = []  # the folders this check creates, deepest first, removed again afterwards
    for parent in (out, *out.parents):
        if parent.exists() or parent.is_symlink():
            break
        missing.append(parent)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".dtlab-probe-"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {folder}: cannot create or write this folder ({exc.strerror or exc})") from None
    finally:
        for made in missing:
            with contextlib.suppress(OSError):
                made.rmdir()
    return out


def fallback(out: str | os.PathLike[str], exc: OSError, write: Callable[[Path], Any]) -> Path:
    """After a failed save: write into a new temporary folder instead, and say so (one line on stderr)."""
    folder = Path(tempfile.mkdtemp(prefix="dtlab-results-"))
    write(folder)
    print(f"error: could not write --out {out} ({exc.strerror or exc}); the results are saved in {folder} instead",
          file=sys.stderr)
    return folder


def save_result(result: RunResult, out: str | os.PathLike[str]) -> tuple[Path, bool]:
    """``result.save(out)``; if that fails, into a new temporary folder (said on stderr). (folder, saved in out?)"""
    try:
        return result.save(out), True
    except OSError as exc:
        return fallback(out, exc, result.save), False
