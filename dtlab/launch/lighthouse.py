"""torchft's lighthouse as a process of the run: started before the replica groups, stopped after them.

The lighthouse is torchft's quorum server (Rust, inside ``torchft._torchft``):
every replica group's manager asks it, at every step, which groups take part.
dtlab runs it as a child process in a session of its own, bound to loopback (or
to the first simulated host's address), on a port the OS picks unless one is
given, and kills the whole session when the run ends, however it ends.

The process loads torchft's extension module directly instead of importing the
``torchft`` package, whose ``__init__`` imports torch: the lighthouse needs
none of it and so starts in milliseconds instead of seconds. It runs as a script
file, not ``python -c``: the lighthouse parses the process's own command line,
where ``-c`` and the code would stand before its arguments. That process forks:
the server runs in the child, and the parent ends it as soon as the pipe the
launcher holds on its stdin closes, so a launcher killed without a word (SIGKILL
of a kernel) leaves no lighthouse behind either.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dtlab.core.ft import TUNED_TIMEOUTS, Timeouts
from dtlab.launch import lifeline

__all__ = ["Lighthouse", "LighthouseError", "running", "start", "stop"]

START_TIMEOUT_S = 20.0

_MAIN = """
import glob, importlib.machinery, importlib.util, os, sys
spec = importlib.util.find_spec("torchft")
if spec is None or spec.origin is None:
    sys.exit("torchft is not installed: pip install torchft==0.2.0")
so = glob.glob(os.path.join(os.path.dirname(spec.origin), "_torchft*.so"))[0]
loader = importlib.machinery.ExtensionFileLoader("torchft._torchft", so)
module = importlib.util.module_from_spec(importlib.util.spec_from_file_location("torchft._torchft", so,
                                                                                 loader=loader))
loader.exec_module(module)
watcher = os.getpid()
server = os.fork()
if server == 0:
    import ctypes
    try:  # SIGKILL when the watcher ends, however it ends (PR_SET_PDEATHSIG, Linux)
        ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != watcher:
        os._exit(0)
    module.lighthouse_main()
    os._exit(0)
# This process watches: when the launcher's pipe on stdin closes -- the run ended, or its launcher died
# without a word -- the server goes too; when the server exits (a port clash), so does this process.
import select, signal
while True:
    if select.select([0], [], [], 0.2)[0] and not os.read(0, 4096):
        os.kill(server, signal.SIGKILL)
        os._exit(0)
    done, status = os.waitpid(server, os.WNOHANG)
    if done:
        os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
"""
_LISTENING = re.compile(r"listening on: \S+:(\d+)")


class LighthouseError(RuntimeError):
    """The lighthouse did not start (its output says why)."""


@dataclass
class Lighthouse:
    """A running lighthouse: ``addr`` is what the managers are given (``http://host:port``)."""

    addr: str
    port: int
    proc: subprocess.Popen
    log_path: Path
    own_folder: Path | None = None  # made by start (no log_dir given): removed by stop

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def command(script: Path, host: str, port: int, min_replicas: int, netns: str | None = None,
            timeouts: Timeouts = TUNED_TIMEOUTS) -> list[str]:
    cmd = [sys.executable, str(script), "--bind", f"{host}:{port}", "--min_replicas", str(min_replicas),
           "--heartbeat_timeout_ms", str(timeouts.heartbeat_timeout_ms),
           "--join_timeout_ms", str(timeouts.join_timeout_ms), "--quorum_tick_ms", str(timeouts.quorum_tick_ms)]
    return ["ip", "netns", "exec", netns, *cmd] if netns else cmd


def start(host: str = "127.0.0.1", port: int = 0, min_replicas: int = 1, netns: str | None = None,
          log_dir: str | os.PathLike[str] | None = None, timeouts: Timeouts = TUNED_TIMEOUTS) -> Lighthouse:
    """Start a lighthouse bound to ``host:port`` (0: a free port) and wait until it listens.

    A port already in use is a ValueError in one line; any other start failure a LighthouseError with
    the lighthouse's own last words.
    """
    own = None if log_dir else lifeline.temporary_folder("dtlab-lighthouse-")
    folder = Path(log_dir or own)
    log_path, script = folder / "lighthouse.log", folder / "lighthouse_main.py"
    script.write_text(_MAIN)
    with open(log_path, "wb") as log:
        # RUST_LOG=info whatever the caller's: its "listening on" line is how this function learns the port.
        proc = subprocess.Popen(command(script, host, port, min_replicas, netns, timeouts), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.PIPE, start_new_session=True,
                                env={**os.environ, "RUST_LOG": "info"})
    try:
        bound = _wait_listening(proc, log_path, host, port)
    except BaseException:  # an interrupt too: the process must not outlive the call
        _kill(proc)
        if own is not None:
            lifeline.remove_folder(own)
        raise
    return Lighthouse(f"http://{host}:{bound}", bound, proc, log_path, own)


def _wait_listening(proc: subprocess.Popen, log_path: Path, host: str, port: int) -> int:
    """The port the lighthouse listens on, once its log says so."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        found = _LISTENING.search(text)
        if found:
            return int(found[1])
        if proc.poll() is not None:
            raise _start_error(host, port, text)
        time.sleep(0.02)
    raise LighthouseError(f"the lighthouse did not listen within {START_TIMEOUT_S:g} s; its output:\n"
                          f"{log_path.read_text(errors='replace')[-2000:]}")


def _start_error(host: str, port: int, text: str) -> Exception:
    if "Address already in use" in text:
        return ValueError(f"lighthouse_port={port}: {host}:{port} is already in use; choose another port, "
                          f"or 0 for a free one")
    last = text.strip().splitlines()[-1] if text.strip() else "no output"
    return LighthouseError(f"the lighthouse exited at start: {last}")


def _kill(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # its session: the watcher and the server it forked, nothing else
    proc.wait()
    if proc.stdin is not None:
        proc.stdin.close()


def stop(lighthouse: Lighthouse) -> None:
    """Kill the lighthouse and remove the folder ``start`` made for it, if it made one (safe to call twice)."""
    if lighthouse.proc.poll() is None:
        _kill(lighthouse.proc)
    if lighthouse.own_folder is not None:
        lifeline.remove_folder(lighthouse.own_folder)


@contextlib.contextmanager
def running(host: str = "127.0.0.1", port: int = 0, min_replicas: int = 1, netns: str | None = None,
            log_dir: str | os.PathLike[str] | None = None,
            timeouts: Timeouts = TUNED_TIMEOUTS) -> Iterator[Lighthouse]:
    """``with running(...) as lighthouse:`` -- stopped on exit, also after an error or an interrupt."""
    lighthouse = start(host, port, min_replicas, netns, log_dir, timeouts)
    try:
        yield lighthouse
    finally:
        stop(lighthouse)
