"""Persistent ranks: N processes with ``torch.distributed`` initialised that run one piece of code after another,
keeping their state in between (what ``%%ranks`` runs on; ``dtlab.app.ranks``).

It is the local launcher (``dtlab.launch.local``) kept open: the same forkserver with torch preloaded, the same
loopback store (kept for the session: ``dist.new_group`` in a later cell needs it), the same liveness pipe and
parent-death signal, so that the ranks end with the kernel however it ends, the same live slots, watchdog,
culprit-first error and Flight Recorder dumps. What differs is what a failure costs. A cell that raises on every
rank alike (a typo) leaves the process group as it was, and the ranks keep their state. A failure that can
leave it broken -- a collective that timed out, a rank that died or was left waiting for a peer that raised,
gloo's "connection closed" -- ends the session: its ranks are killed, and ``alive`` turns False.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dtlab.core.config import check_world_cap
from dtlab.core.failures import RankError
from dtlab.launch.contract import LaunchOptions, ProgressBar, launch_error
from dtlab.launch.flight import Dumps
from dtlab.launch.local import Ranks, context, loopback_store, main_not_reimported, op_states
from dtlab.launch.session_rank import session_main

Output = Callable[[int, str], None]  # (rank, complete lines of what it printed)
_SESSION_GRACE_S = 2.0  # after a cell's first error: the other ranks' (the same typo, often) arrive meanwhile


@dataclass
class CellOutcome:
    """What one cell left: the rows of its collectives and its phases on every rank, and each rank's output."""

    rows: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    output: dict[int, str] = field(default_factory=dict)
    wall_s: float = 0.0


class _SessionRanks(Ranks):
    """The local launcher's ranks, on duplex pipes (cells go out on them), echoing each rank's output live."""

    grace_s = _SESSION_GRACE_S

    def __init__(self, world_size: int, options: LaunchOptions, on_output: Output) -> None:
        super().__init__(context("forkserver"), world_size, options)
        self.conns: list[Any] = []
        self.extras: dict[int, dict[str, Any]] = {}  # rank -> rows, phases and owned names of its last reply
        self.on_output = on_output
        self.offsets = [0] * world_size
        self.output: dict[int, list[str]] = {}

    def start_session(self, port: int) -> None:
        options = self.options.for_ranks()
        for r in range(self.world_size):
            mine, theirs = self.ctx.Pipe(duplex=True)
            p = self.ctx.Process(target=session_main, name=f"dtlab-ranks{r}", daemon=True,
                                 args=(r, self.world_size, port, theirs, self.live_buffer, self.log_paths[r],
                                       options, self.alive_r))
            with main_not_reimported():
                p.start()
            theirs.close()
            self.procs.append(p)
            self.conns.append(mine)
            self.readers[mine] = r

    def reset(self) -> None:
        self.results.clear()
        self.failures.clear()
        self.extras.clear()
        self.output = {r: [] for r in range(self.world_size)}
        self.note, self.first_failure_at, self.started = "", None, time.perf_counter()
        self.bar.close()
        self.bar = ProgressBar(self.options.progress)  # a bar per cell: rank 0's ``dtlab.report()`` calls

    def _handle(self, rank: int, kind: str, body: Any) -> None:
        super()._handle(rank, kind, body)
        if kind == "ok":
            self.extras[rank] = self.results[rank]
        elif kind == "error":
            self.extras[rank] = body.extra

    def _receive(self) -> None:
        super()._receive()
        self.echo()

    def echo(self, final: bool = False) -> None:
        """Pass on the complete lines each rank printed since the last call (at the end, any last partial one)."""
        for r, path in enumerate(self.log_paths):
            with contextlib.suppress(OSError), open(path, "rb") as f:
                f.seek(self.offsets[r])
                new = f.read()
                upto = len(new) if final else new.rfind(b"\n") + 1
                if upto:
                    self.offsets[r] += upto
                    text = new[:upto].decode(errors="replace")
                    self.output[r].append(text)
                    self.on_output(r, text)

    def answered(self) -> bool:
        return len(self.results) + len(self.failures) == self.world_size

    def collected(self, key: str) -> list[dict[str, Any]]:
        return [row for r in sorted(self.extras) for row in self.extras[r].get(key, [])]

    def owned(self) -> set[str]:
        return {name for extra in self.extras.values() for name in extra.get("owned", [])}


class RankSession:
    """``world_size`` persistent ranks; ``run(code, names)`` runs code on each, ``close()`` ends them.

    ``names`` maps a name to its cloudpickle bytes, bound in each rank's namespace unless the rank's own cells
    bound that name (``owned``). ``on_output(rank, text)`` gets what each rank prints, as it prints it.
    ``timeout_s`` bounds one collective; ``flight_recorder`` switches PyTorch's Flight Recorder on, and a cell
    that ends the session brings every rank's dump home (``error.flight``).
    """

    def __init__(self, world_size: int, *, backend: str = "auto", device: str = "auto", timeout_s: float = 60.0,
                 flight_recorder: bool = False, record: bool = True, on_output: Output | None = None) -> None:
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} is invalid: must be an integer >= 1")
        check_world_cap(world_size)
        options = LaunchOptions(backend=backend, device=device, timeout_s=timeout_s, record=record,
                                flight_recorder=flight_recorder)
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self.flight_recorder = flight_recorder
        self.cells = 0
        self.alive, self.ranks, self.dumps, self.store = True, None, None, None
        self.owned: set[str] = set()
        try:
            self.dumps = Dumps(flight_recorder)
            options = dataclasses.replace(options, env={**self.dumps.env()})
            self.store, port = loopback_store(world_size, timeout_s)
            self.ranks = _SessionRanks(world_size, options, on_output or (lambda rank, text: None))
            self.ranks.reset()
            self.ranks.start_session(port)
            self._wait()  # every rank has joined the process group, or the error says which did not
        except BaseException:
            self.close()
            raise
        self.owned = self.ranks.owned()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.ranks.procs if p.pid is not None]

    def run(self, code: str, names: dict[str, bytes] | None = None) -> CellOutcome:
        """Run ``code`` on every rank; raises the launcher's RankError or CollectiveTimeout, culprit first
        (with ``error.events``: the rows recorded; ``error.session_ended``: whether the ranks were ended)."""
        if not self.alive:
            raise RuntimeError("this session's ranks were ended; start a new RankSession")
        self.cells += 1
        self.ranks.reset()
        self.dumps.clear()
        for conn in self.ranks.conns:
            with contextlib.suppress(OSError):  # a rank that died since: the wait below names it
                conn.send(("run", self.cells, code, dict(names or {})))
        self._wait()
        self.owned = self.ranks.owned()
        out = self.ranks
        return CellOutcome(out.collected("rows"), out.collected("phases"),
                           {r: "".join(t) for r, t in out.output.items()}, time.perf_counter() - out.started)

    def _wait(self) -> None:
        ranks = self.ranks
        assert ranks is not None
        try:
            ranks.wait()
        except BaseException:  # an interrupt: ranks stopped at different points share no usable process group
            self.close()
            raise
        ranks.echo(final=True)
        if not ranks.failures:
            return
        ops = op_states(ranks.live, self.world_size, set(ranks.results))
        broken = not ranks.answered() or ranks.note or any(
            f.kind != "exception" or f.looks_like_victim or "timed out" in f.message.lower()
            for f in ranks.failures.values())
        flight: dict[int, bytes] = {}
        if broken:
            self.dumps.request(self.dumps.missing(range(self.world_size)))  # idle ranks too: the diagnosis needs all
            flight = self.dumps.collect()
            self.close()
        error: RankError = launch_error(list(ranks.failures.values()), ops, ranks.note,
                                        events=ranks.collected("rows"), flight=flight)
        error.session_ended = bool(broken)  # type: ignore[attr-defined]
        error.phases = ranks.collected("phases")  # type: ignore[attr-defined]
        raise error

    def close(self) -> None:
        """End the ranks (safe to call twice): no process, pipe or folder of the session is left."""
        if not self.alive:
            return
        self.alive = False
        if self.ranks is not None:
            self.ranks.teardown()  # the liveness pipe closes, every rank is killed, the logs' folder goes
        if self.dumps is not None:
            self.dumps.close()
        self.store = None  # the store's server stops with the session
