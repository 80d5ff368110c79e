"""``%%ranks N``: a notebook cell run on N ranks that keep their state from one such cell to the next.

    %load_ext dtlab

    %%ranks 4
    x = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(x)
    print(x)

Each rank is a process with ``torch.distributed`` initialised (gloo on CPU; NCCL where there is a GPU for every
rank) whose namespace starts with ``rank``, ``world_size``, ``device``, ``info``, ``dist`` and ``torch`` and keeps
whatever the cells bind: a model built in one ``%%ranks`` cell is trained in the next. Each name the cell reads
from the notebook is sent along (cloudpickle), unless the ranks' own cells bound that name; one that cannot be
pickled is named in one line and the cell does not run. What each rank prints is shown as it prints it,
labelled ``[rank R]``; the cell's recorded collectives come back as a table, ``_ranks.events`` (``--out r``:
``r.events``), with each rank's span of the cell in ``_ranks.phases`` for ``plots.timeline``. An exception is
reported as ``dtlab.launch`` reports one: the failing rank first, with its traceback. A failure that leaves the
process group unusable -- a collective that timed out, a rank left waiting for one that raised -- ends the ranks
(the next cell starts new ones, and says so); with ``--flight-recorder`` a timeout comes with the Flight Recorder's
diagnosis. ``%ranks stop`` ends them; so does the kernel's end, however it ends.

Why not ipyparallel, whose engines (``%%px``) are the well-kept way to run a cell on persistent processes: the
engine here must be ``torch.distributed``, and dtlab's launcher already provides all that ipyparallel's engines
would have to be wrapped to give -- ranks from a forkserver with torch preloaded, a loopback store, the
CommRecorder and its live slots (which collective a hung rank waits in), the watchdog, culprit-first errors,
Flight Recorder dumps, and the liveness pipe and parent-death signal that end the ranks with the kernel even when
it is SIGKILLed -- while ipyparallel would add a controller, ZeroMQ and a dependency beside them. So the ranks are
the local launcher's, kept open (``dtlab.launch.session``).
"""

from __future__ import annotations

import argparse
import ast
import keyword
import re
import shlex
from dataclasses import dataclass
from typing import Any

import cloudpickle
import pandas as pd
import torch
from IPython.core.error import UsageError

from dtlab.core.comm import events_frame
from dtlab.core.config import BACKENDS
from dtlab.core.env import resolve_backend
from dtlab.core.failures import CollectiveTimeout, RankError
from dtlab.launch.session import RankSession
from dtlab.launch.session_rank import PRESET
from dtlab.read.flight import report as flight_report

DEFAULT_OUT = "_ranks"
DEFAULT_TIMEOUT_S = 60.0
# IPython's own history names (_, __, _5, _i5, _oh, ...): never the cell's to send.
_HISTORY = re.compile(r"_+|_i+|_i?\d+|_[oid]h")
PHASE_COLUMNS = ["rank", "phase", "start", "end", "step"]
_MAGICS: dict[int, RanksMagic] = {}  # id(shell) -> its magic: one set of ranks per shell


@dataclass
class RanksResult:
    """What a ``%%ranks`` cell left: ``events`` (one row per collective per rank: ``dtlab.core.comm.FIELDS`` with
    duration and bandwidths), ``phases`` (each rank's span of the cell), each rank's ``output``, the wall time,
    and the error if the cell raised."""

    events: pd.DataFrame
    phases: pd.DataFrame
    output: dict[int, str]
    wall_s: float
    world_size: int
    error: BaseException | None = None

    def __repr__(self) -> str:
        state = f", error={type(self.error).__name__}" if self.error is not None else ""
        return (f"RanksResult(world_size={self.world_size}, {len(self.events)} collectives, "
                f"wall_s={self.wall_s:.3f}{state})")


# -- the line ---------------------------------------------------------------------------------------------------
class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, no usage block, no SystemExit in the kernel
        raise UsageError(f"%%ranks: {message} (usage: %%ranks N [--backend B] [--timeout S] [--flight-recorder] "
                         "[--out NAME])")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("world_size", nargs="?", type=int, help="number of ranks (default: the running ranks')")
    p.add_argument("--backend", choices=BACKENDS, help="auto (default), gloo or nccl")
    p.add_argument("--timeout", type=float, help="seconds one collective may wait (default 60)")
    p.add_argument("--flight-recorder", action=argparse.BooleanOptionalAction, default=None,
                   help="PyTorch's Flight Recorder in every rank: a timeout comes with its diagnosis")
    p.add_argument("--out", default=DEFAULT_OUT, help="where the result goes (default _ranks)")
    return p


@dataclass(frozen=True)
class Wanted:
    """The ranks a cell asks for (what it left out: the running ranks' settings, else the defaults)."""

    world_size: int
    backend: str
    timeout_s: float
    flight_recorder: bool
    out: str

    def same_ranks(self, other: Wanted | None) -> bool:
        """Whether ranks started for ``other`` serve this cell (where the result goes does not matter)."""
        return other is not None and (other.world_size, other.backend, other.timeout_s, other.flight_recorder) == (
            self.world_size, self.backend, self.timeout_s, self.flight_recorder)


def parse(line: str, running: Wanted | None = None) -> Wanted:
    """The magic's line, checked: each mistake is one UsageError naming it. What it leaves out is the
    ``running`` ranks' setting, else the default."""
    try:
        args = _parser().parse_args(shlex.split(line))
    except ValueError as exc:  # shlex: an unclosed quote
        raise UsageError(f"%%ranks: {exc}") from None
    n = args.world_size if args.world_size is not None else (running.world_size if running else None)
    if n is None:
        raise UsageError("%%ranks: give the number of ranks, e.g. %%ranks 4")
    if n < 1:
        raise UsageError(f"%%ranks: N={n} is invalid: give a number of ranks >= 1")
    timeout = args.timeout if args.timeout is not None else (running.timeout_s if running else DEFAULT_TIMEOUT_S)
    if not timeout > 0 or timeout == float("inf"):
        raise UsageError(f"%%ranks: --timeout {timeout:g} is invalid: give a number of seconds > 0")
    if not args.out.isidentifier() or keyword.iskeyword(args.out):
        raise UsageError(f"%%ranks: --out {args.out!r} is invalid: give a Python name")
    backend = args.backend or (running.backend if running else "auto")
    fr = args.flight_recorder if args.flight_recorder is not None else bool(running and running.flight_recorder)
    return Wanted(n, backend, float(timeout), fr, args.out)


def placement(backend: str, world_size: int) -> tuple[str, str]:
    """(backend, device) for ``world_size`` ranks: ``auto`` takes NCCL only with a GPU for every rank."""
    if backend == "auto" and torch.cuda.is_available() and torch.cuda.device_count() < world_size:
        backend = "gloo"  # NCCL refuses two ranks on one GPU
    if backend == "nccl" and not torch.cuda.is_available():
        raise UsageError("%%ranks: --backend nccl needs CUDA devices and torch sees none: use --backend gloo")
    return resolve_backend(backend, "cpu" if backend == "gloo" else "cuda" if backend == "nccl" else "auto")


# -- the cell's names -----------------------------------------------------------------------------------------------
def cell_names(code: str) -> tuple[set[str], set[str]]:
    """(names the cell reads, names it binds): what it may need from the notebook, and what it makes itself."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        raise UsageError(f"%%ranks: the cell does not parse: {exc.msg} (line {exc.lineno})") from None
    read: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            bound.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
    return read, bound


def names_to_send(code: str, user_ns: dict[str, Any], hidden: set[str], owned: set[str]) -> dict[str, bytes]:
    """Each notebook name the cell reads, pickled; a UsageError naming every one that cannot be sent.

    Left out: names the ranks' cells bound (``owned``), the ranks' preset names, IPython's own, and a name the
    cell binds itself whose notebook value cannot be pickled (the cell makes its own)."""
    read, bound = cell_names(code)
    sent: dict[str, bytes] = {}
    refused: list[str] = []
    for name in sorted(read):
        if (name not in user_ns or name in owned or name in PRESET or name in hidden
                or _HISTORY.fullmatch(name)):
            continue
        try:
            sent[name] = cloudpickle.dumps(user_ns[name])
        except Exception as exc:  # noqa: BLE001 - whatever pickling raises, the name is what the learner needs
            if name not in bound:
                refused.append(f"{name} ({type(exc).__name__}: {str(exc)[:80]})")
    if refused:
        raise UsageError(f"%%ranks: cannot send {', '.join(refused)} to the ranks: make it in a %%ranks cell "
                         "instead, or pass what it holds")
    return sent


# -- the magic ------------------------------------------------------------------------------------------------------
def _print_labelled(rank: int, text: str) -> None:
    print("".join(f"[rank {rank}] {line}\n" for line in text.splitlines()), end="", flush=True)


def _result(rows: list[dict[str, Any]], phases: list[dict[str, Any]], output: dict[int, str], wall_s: float,
            world_size: int, error: BaseException | None = None) -> RanksResult:
    return RanksResult(events_frame(rows), pd.DataFrame(phases, columns=PHASE_COLUMNS), output, wall_s, world_size,
                       error)


def _error_lines(error: RankError, ended: bool) -> list[str]:
    """What the notebook shows for a failed cell: the launcher's report, not the magic's own frames."""
    lines = str(error).splitlines()
    if isinstance(error, CollectiveTimeout) and getattr(error, "flight", None):
        try:
            lines += flight_report(error).splitlines()
        except Exception as exc:  # noqa: BLE001 - a dump that cannot be read must not hide the error itself
            lines.append(f"(the Flight Recorder dumps could not be read: {exc})")
    if ended:
        lines.append("%%ranks: the ranks were ended, and what they held with them; the next %%ranks cell starts "
                     "new ones")
    return lines


class RanksMagic:
    """``%%ranks`` (and ``%ranks stop``) for one IPython shell; holds its ranks between cells."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.session: RankSession | None = None
        self.started_for: Wanted | None = None  # what the running ranks were started with

    @property
    def running(self) -> Wanted | None:
        return self.started_for if self.session is not None and self.session.alive else None

    def __call__(self, line: str, cell: str | None = None) -> None:
        if cell is None:
            self.line(line)
            return
        try:
            self.cell(line, cell)
        except KeyboardInterrupt as interrupt:  # while the ranks started or ran: they were ended
            lines = ["KeyboardInterrupt: %%ranks: the ranks were ended, and what they held with them"]
            interrupt._render_traceback_ = lambda: lines  # type: ignore[attr-defined]  # not the magic's frames
            raise

    def cell(self, line: str, cell: str) -> None:
        wanted = parse(line, self.started_for)  # after ranks were ended, a bare %%ranks starts them as they were
        backend, device = placement(wanted.backend, wanted.world_size)
        owned = self.session.owned if self.session is not None and wanted.same_ranks(self.running) else set(PRESET)
        names = names_to_send(cell, self.shell.user_ns, set(getattr(self.shell, "user_ns_hidden", {})), owned)
        session = self._ranks(wanted, backend, device)
        try:
            out = session.run(cell, names)
        except RankError as error:
            ended = bool(getattr(error, "session_ended", False))
            self.shell.user_ns[wanted.out] = _result(getattr(error, "events", []), getattr(error, "phases", []),
                                                     {}, 0.0, wanted.world_size, error)
            lines = _error_lines(error, ended)
            error._render_traceback_ = lambda: lines  # type: ignore[attr-defined]  # IPython shows these instead
            raise
        result = _result(out.rows, out.phases, out.output, out.wall_s, wanted.world_size)
        self.shell.user_ns[wanted.out] = result
        print(f"%%ranks: {wanted.world_size} ranks, {out.wall_s:.2f} s, {len(result.events)} collectives recorded "
              f"in {wanted.out}.events")

    def _ranks(self, wanted: Wanted, backend: str, device: str) -> RankSession:
        if self.session is not None and wanted.same_ranks(self.running):
            return self.session
        if self.session is not None and self.session.alive:
            print(f"%%ranks: ending the {self.session.world_size} ranks running (what they hold goes with them)")
            self.session.close()
        print(f"%%ranks: starting {wanted.world_size} ranks ({backend} on {device}); they keep their state from "
              "cell to cell")
        try:
            self.session = RankSession(wanted.world_size, backend=backend, device=device, timeout_s=wanted.timeout_s,
                                       flight_recorder=wanted.flight_recorder, on_output=_print_labelled)
        except ValueError as exc:  # the machine's cap on ranks (DTLAB_MAX_WORLD_SIZE)
            raise UsageError(f"%%ranks: {exc}") from None
        except RankError as error:
            lines = ["%%ranks: the ranks could not start", *str(error).splitlines()]
            error._render_traceback_ = lambda: lines  # type: ignore[attr-defined]
            raise
        self.started_for = wanted
        return self.session

    def line(self, line: str) -> None:
        word = line.strip()
        if word == "stop":
            if self.session is not None and self.session.alive:
                self.session.close()
                print(f"%ranks: ended the {self.session.world_size} ranks")
            else:
                print("%ranks: no ranks running")
        elif word == "":
            s = self.session
            print(f"%ranks: {s.world_size} ranks running, cells run: {s.cells}; variables of their own: "
                  f"{', '.join(sorted(s.owned - set(PRESET))) or 'none'}" if s is not None and s.alive
                  else "%ranks: no ranks running")
        else:
            raise UsageError(f"%ranks: {word!r} is not a command: %ranks (what runs) or %ranks stop")

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext dtlab`` (or ``dtlab.app.ranks``): registers ``%%ranks`` and ``%ranks``."""
    magic = _MAGICS[id(ipython)] = RanksMagic(ipython)
    ipython.register_magic_function(magic, magic_kind="line_cell", magic_name="ranks")


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext``: the ranks end."""
    magic = _MAGICS.pop(id(ipython), None)
    if magic is not None:
        magic.close()


def session(ipython: Any) -> RankSession | None:
    """The ranks ``%%ranks`` holds in this shell now (None if none run): their ``pids``, ``owned`` names."""
    magic = _MAGICS.get(id(ipython))
    return magic.session if magic is not None and magic.session is not None and magic.session.alive else None
