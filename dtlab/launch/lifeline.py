"""What ends a run's processes, namespaces and folders when the process that started it dies.

A kernel killed mid-run (SIGKILL, or SIGTERM: Python's default is to die at once, no
``finally`` runs) cannot clean up after itself, so two things that need no
cooperation from it do:

- **The parent-death signal** (``PR_SET_PDEATHSIG``): the kernel asks Linux to send a
  process SIGKILL the moment its parent ends. It does not pass to a process's own
  children, so every level sets it for itself: ``dying_with_parent`` wraps a command
  (a torchrun agent, the delay relay) in this file, which sets it and then execs the
  command (the setting survives exec); torchrun's workers set it at their start
  (``dtlab.launch.worker``), its parent being their agent; rank processes set it too
  (``dtlab.launch.rank``). A process whose parent died before it could set it sees
  that its parent is no longer the one expected (``LIFELINE_PID_ENV``) and exits.
- **A watched pipe**: the reaper, a small process in a session of its own (so a
  signal to the kernel's process group does not reach it), reads what the launchers
  register -- temporary folders, network namespaces, links, agent processes -- on a
  pipe from the kernel. When the pipe closes with something still registered, the
  kernel died mid-run: the reaper kills those processes, deletes those namespaces and
  links, removes those folders, and exits. It runs only while something is registered.

This file runs as a script too (``exec`` and ``reap``), so it imports nothing from
dtlab and nothing outside the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LIFELINE_PID_ENV", "die_with_parent", "dying_with_parent", "folder", "forget", "forget_process",
           "process_start", "reaper_pid", "remove_folder", "remove_namespace", "scratch_folder", "stale_folders",
           "sweep_folders", "temporary_folder", "watch", "watch_process", "watching"]

LIFELINE_PID_ENV = "DTLAB_LIFELINE_PID"  # the pid a wrapped command runs as: its children's expected parent
_PR_SET_PDEATHSIG = 1
# A temporary folder of a run: dtlab-<what>-<pid of the process that made it>-<mkdtemp's random part>.
_FOLDER = re.compile(r"^dtlab-[a-z][a-z0-9-]*?-(\d+)-[a-z0-9_]{8}$")


# -- the parent-death signal ----------------------------------------------------------------------------------------
def die_with_parent(expected_parent: int | None = None, sig: int = signal.SIGKILL) -> None:
    """Have Linux send ``sig`` to this process when its parent ends (elsewhere: nothing to do).

    With ``expected_parent``, a parent that already ended (this process was handed to init or a
    subreaper) ends this process at once: the signal would never come.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if expected_parent is not None and os.getppid() != expected_parent:
        os._exit(1)


def dying_with_parent(cmd: list[str]) -> list[str]:
    """``cmd``, run so that it gets SIGKILL when the calling thread's process ends.

    PR_SET_PDEATHSIG follows the thread that started the process: call this from the thread
    that waits for it (every launcher does).
    """
    if not sys.platform.startswith("linux"):
        return list(cmd)
    # -S -I: no site-packages, no environment: the wrapper starts in milliseconds and execs at once.
    return [sys.executable, "-S", "-I", __file__, "exec", str(os.getpid()), *cmd]


def _exec(parent: int, cmd: list[str]) -> None:
    die_with_parent(parent)
    # The command's children (torchrun's workers) check that their parent is this very process.
    os.environ[LIFELINE_PID_ENV] = str(os.getpid())
    os.execvp(cmd[0], cmd)


# -- the reaper -----------------------------------------------------------------------------------------------------
def process_start(pid: int) -> str:
    """The start time of ``pid`` in clock ticks since boot ("" if it is gone): a pid and this name one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[19]


class _Reaper:
    """The kernel's side: what is registered now, and the reaper process while anything is."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._forget_all()

    def _forget_all(self) -> None:
        self.entries: Counter[tuple[str, str]] = Counter()
        self.proc: subprocess.Popen | None = None
        self.owner = os.getpid()

    def _send(self, op: str, kind: str, value: str) -> None:
        if self.proc is None or self.proc.poll() is not None:  # none yet, or one killed by hand
            if op == "+":
                self._start()  # it is told everything registered, this entry included
            return
        try:
            self.proc.stdin.write((json.dumps([op, kind, value]) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:  # it died between the check and the write
            self.proc = None
            if op == "+":
                self._start()

    def _start(self) -> None:
        # Its own session: Ctrl-C in a terminal, or a signal to the kernel's process group, must not reach it.
        self.proc = subprocess.Popen([sys.executable, "-S", "-I", __file__, "reap"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        lines = "".join(json.dumps(["+", kind, value]) + "\n" for kind, value in self.entries)
        with contextlib.suppress(OSError):  # it died at once: the next registration starts another
            self.proc.stdin.write(lines.encode())
            self.proc.stdin.flush()

    def _stop(self) -> None:
        if self.proc is not None:  # nothing registered: it reads the end of the pipe, has nothing to do, exits
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            self.proc = None

    def add(self, kind: str, value: str) -> None:
        with self.lock:
            if os.getpid() != self.owner:  # a forked child: the reaper and what it knows are its parent's
                self._forget_all()
            self.entries[kind, value] += 1
            self._send("+", kind, value)

    def remove(self, kind: str, value: str) -> None:
        with self.lock:
            if os.getpid() != self.owner or not self.entries[kind, value]:
                return
            self.entries[kind, value] -= 1
            if self.entries[kind, value]:
                return
            del self.entries[kind, value]
            self._send("-", kind, value)  # even the last one: the reaper must not remove what was kept on purpose
            if not self.entries:
                self._stop()

    def pid(self) -> int | None:
        with self.lock:
            return self.proc.pid if self.proc is not None and self.proc.poll() is None else None


_REAPER = _Reaper()


def watch(kind: str, value: str) -> None:
    """Register a ``folder``, ``netns`` or ``link`` the reaper removes if this process dies before ``forget``."""
    if kind not in ("folder", "netns", "link"):
        raise ValueError(f"kind={kind!r} is invalid: the reaper removes a folder, netns or link")
    _REAPER.add(kind, value)


def forget(kind: str, value: str) -> None:
    """This process removed it itself (or keeps it on purpose): the reaper leaves it alone."""
    _REAPER.remove(kind, value)


def watch_process(pid: int) -> str:
    """The reaper kills ``pid`` and its descendants if this process dies first; returns the start time that
    ``forget_process`` takes with the pid."""
    start = process_start(pid)
    _REAPER.add("proc", f"{pid}:{start}")
    return start


def forget_process(pid: int, start: str) -> None:
    _REAPER.remove("proc", f"{pid}:{start}")


def reaper_pid() -> int | None:
    """The reaper's pid while it runs (something is registered), else None."""
    return _REAPER.pid()


def temporary_folder(prefix: str) -> Path:
    """A new folder ``<tempdir>/<prefix><pid>-XXXXXXXX``, removed by the reaper if this process dies first.

    The pid in its name lets ``sweep_folders`` (``python -m dtlab clean``) find it if even the reaper was killed.
    """
    path = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
    watch("folder", str(path))
    return path


def scratch_folder(name: str) -> Path:
    """A folder for the rest of this session (a notebook's scratch space): ``<tempdir>/dtlab-<name>-<pid>-XXXXXXXX``,
    removed when this process ends, however it ends -- a kernel shut down, restarted or killed."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9-]*", name):
        raise ValueError(f"name={name!r} is invalid: lower-case letters, digits and '-', starting with a letter")
    return temporary_folder(f"dtlab-{name}-")


def remove_folder(path: str | os.PathLike[str]) -> None:
    """Remove a folder made by ``temporary_folder`` (safe to call twice)."""
    shutil.rmtree(path, ignore_errors=True)
    forget("folder", str(path))


@contextlib.contextmanager
def folder(prefix: str) -> Iterator[Path]:
    """``with folder("dtlab-x-") as path:`` a ``temporary_folder``, removed on exit however the block ends."""
    path = temporary_folder(prefix)
    try:
        yield path
    finally:
        remove_folder(path)


@contextlib.contextmanager
def watching(kind: str, value: str) -> Iterator[None]:
    watch(kind, value)
    try:
        yield
    finally:
        forget(kind, value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's: alive
        return True
    return True


def stale_folders(tmpdir: str | os.PathLike[str] | None = None) -> list[Path]:
    """This user's run folders in the temporary directory whose process no longer runs."""
    root = Path(tmpdir or tempfile.gettempdir())
    found = []
    for path in root.glob("dtlab-*"):
        m = _FOLDER.match(path.name)
        with contextlib.suppress(OSError):
            if m and path.is_dir() and path.stat().st_uid == os.getuid() and not _alive(int(m[1])):
                found.append(path)
    return sorted(found)


def sweep_folders(tmpdir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove ``stale_folders`` (those a process killed with its reaper left); returns them."""
    found = stale_folders(tmpdir)
    for path in found:
        shutil.rmtree(path, ignore_errors=True)
    return found


# -- in the reaper process ------------------------------------------------------------------------------------------
def _descendants(root: int) -> list[int]:
    """``root`` and every process below it, from /proc (taken before any is killed: orphans lose the link)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _kill(value: str) -> None:
    pid, _, start = value.partition(":")
    if not start or process_start(int(pid)) != start:  # gone, or the pid now names another process
        return
    for p in _descendants(int(pid)):
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)


def _ip(*args: str) -> str:
    with contextlib.suppress(OSError):
        return subprocess.run(["ip", *args], capture_output=True, text=True).stdout
    return ""


def remove_namespace(name: str) -> None:
    """Kill every process inside network namespace ``name``, then delete it (its veth goes with it)."""
    for pid in _ip("netns", "pids", name).split():
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    _ip("netns", "del", name)


def _remove_tree(path: str, wait_s: float = 5.0) -> None:
    # Processes killed a moment ago may still be writing into it: try until it is gone.
    deadline = time.monotonic() + wait_s
    while os.path.lexists(path):
        shutil.rmtree(path, ignore_errors=True)
        if time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _clean(entries: dict[tuple[str, str], int]) -> None:
    for kind, value in entries:
        if kind == "proc":
            _kill(value)
    for kind, value in entries:
        if kind == "netns":
            remove_namespace(value)
    for kind, value in entries:
        if kind == "link":
            _ip("link", "del", value)
    for kind, value in entries:
        if kind == "folder":
            _remove_tree(value)


def _reap() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    entries: dict[tuple[str, str], int] = {}
    for raw in sys.stdin.buffer:
        with contextlib.suppress(ValueError, TypeError):
            op, kind, value = json.loads(raw)
            if op == "+":
                entries[kind, value] = 1
            else:
                entries.pop((kind, value), None)
    _clean(entries)  # the pipe closed: with nothing registered, the kernel simply had nothing running


if __name__ == "__main__":
    if sys.argv[1:2] == ["exec"] and len(sys.argv) > 3:
        _exec(int(sys.argv[2]), sys.argv[3:])
    elif sys.argv[1:] == ["reap"]:
        _reap()
    else:
        sys.exit("usage: lifeline.py exec PARENT_PID CMD... | reap")
