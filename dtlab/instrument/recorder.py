"""CommRecorder: every c10d collective and point-to-point call as an event.

Recording works by wrapping the Python entry points of ``torch.distributed``
(and its ``distributed_c10d`` module, where torch's own code looks them up) for
the whole process. The wrappers call the original function unchanged, so c10d
behaves exactly as before. What never passes through Python -- DDP's reducer
-- is seen through a comm hook (``dtlab.instrument.ddp_hooks``) that dtlab's
DDP tiers register. Events are plain lists while recording (appending is cheap) and
become a DataFrame or a Chrome trace afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from dtlab.core.comm import END, FIELDS, START, TAG, WAIT, events_frame
from dtlab.core.timing import StepClock
from dtlab.instrument.calls import (
    ALWAYS_ASYNC,
    EXTRA_RULES,
    GROUP_ASYNC_POS,
    OP_CODES,
    SIZE_RULES,
    arg,
    dtype_name,
    tensor_nbytes,
)

_active: CommRecorder | None = None
_originals: dict[tuple[Any, str], Callable[..., Any]] = {}
_install_lock = threading.Lock()


class _RecordedWork:
    """A Work handle that notes how long the caller waited on it."""

    __slots__ = ("_work", "_event", "_recorder")

    def __init__(self, work: Any, event: list, recorder: CommRecorder) -> None:
        self._work, self._event, self._recorder = work, event, recorder

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        rec = self._recorder
        rec._enter(OP_CODES["wait"])
        t0 = rec.now()
        result = self._work.wait(*args, **kwargs)
        t1 = rec.now()  # on CUDA: where the stream is once it waits for the op (see dtlab.core.timing)
        rec._leave()
        ev = self._event
        ev[WAIT] += t1 - t0
        if ev[END] is None or ev[END] < t1:
            ev[END] = t1
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class CommRecorder:
    """Records communication events (and compute phases) of one process.

    Use as a context manager, or ``start()`` / ``stop()``. While started, every
    collective in the process is recorded, whoever calls it.

    ``live`` is an optional shared array of 5 doubles per process that the
    launcher reads to say which op a hung rank is waiting in.
    """

    def __init__(self, rank: int | None = None, live: Any = None) -> None:
        self.rank = rank
        self.events: list[list[Any]] = []
        self.phases: list[tuple[str, float, float, int]] = []
        self._step = -1
        self.tag = ""
        self.suppressed = False
        self.live = live
        if live is not None:
            live[4] = -1
        self.clock_offset = time.time() - time.perf_counter()
        self.clock: StepClock | None = None  # set by the training loop on CUDA, where CPU time is launch time

    @property
    def step(self) -> int:
        """The training step that events are attributed to (-1: before training)."""
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if self.live is not None:
            self.live[4] = value

    # -- switching on and off ------------------------------------------------
    def start(self) -> CommRecorder:
        global _active
        if _active is not None and _active is not self:
            raise RuntimeError("another CommRecorder is already recording in this process")
        if self.rank is None:
            self.rank = dist.get_rank() if dist.is_initialized() else 0
        install()
        _active = self
        return self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None

    def __enter__(self) -> CommRecorder:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- what the training loop tells it -------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a compute phase (forward, backward, ...) for the timeline."""
        t0 = self.now()
        try:
            yield
        finally:
            self.phases.append((name, t0, self.now(), self.step))

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        previous, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = previous

    def now(self) -> float:
        """A timestamp: ``time.perf_counter()``, or on CUDA a mark of the step's clock (resolved after it)."""
        return self.clock.mark() if self.clock is not None else time.perf_counter()

    def retime(self, times: dict[float, float], events_from: int = 0, phases_from: int = 0) -> None:
        """Move timestamps taken since these positions to the device's clock (``StepClock.resolve``)."""
        if not times:
            return
        for ev in self.events[events_from:]:
            ev[START] = times.get(ev[START], ev[START])
            if ev[END] is not None:
                ev[END] = times.get(ev[END], ev[END])
        self.phases[phases_from:] = [(n, times.get(a, a), times.get(b, b), s) for n, a, b, s in
                                     self.phases[phases_from:]]

    # -- recording -------------------------------------------------------------
    def _enter(self, code: int) -> None:
        live = self.live
        if live is not None:
            live[0] += 1
            live[1] = code
            live[2] = 1.0
            live[3] = time.time()

    def _leave(self) -> None:
        if self.live is not None:
            self.live[2] = 0.0

    def add(self, op: str, nbytes: int, dtype: str, group_size: int, peer: Any, start: float,
            end: float | None, is_async: bool, **extra: Any) -> list:
        """A new event; ``extra`` fields (an all-to-all's split sizes) follow the FIELDS as one dict."""
        ev = [self.rank, len(self.events), op, nbytes, dtype, group_size, peer, start, end, 0.0,
              is_async, self.tag, self.step]
        if extra:
            ev.append(extra)
        self.events.append(ev)
        return ev

    # -- results ---------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        out = []
        for ev in self.events:
            row = dict(zip(FIELDS, ev))
            if len(ev) > len(FIELDS):
                row.update(ev[len(FIELDS)])
            if row["end"] is None:
                row["end"] = row["start"]
            row["start"] += self.clock_offset
            row["end"] += self.clock_offset
            out.append(row)
        return out

    def phase_rows(self) -> list[dict[str, Any]]:
        return [
            {"rank": self.rank, "phase": n, "start": a + self.clock_offset, "end": b + self.clock_offset, "step": s}
            for n, a, b, s in self.phases
        ]

    def frame(self) -> Any:
        return events_frame(self.rows())


# -- the wrappers ----------------------------------------------------------------
_group_sizes: dict[int, int] = {}


def group_size(group: Any) -> int:
    key = id(group)
    size = _group_sizes.get(key)
    if size is None:
        size = dist.get_world_size(group) if group is not None else dist.get_world_size()
        _group_sizes[key] = size
    return size


def _watch_completion(work: Any, event: list) -> None:
    try:
        fut = work.get_future()
    except Exception:  # some backends/ops have no future; wait() still records
        return

    def done(_fut: Any) -> None:
        t = time.perf_counter()
        if event[END] is None or event[END] < t:
            event[END] = t

    fut.add_done_callback(done)


def _handed_to_torch(depth: int = 2) -> bool:
    """Whether the wrapped call came from torch itself (DDP's join, for one), which may pass the Work on
    to C++: that needs the real object, so such calls get it back (their end is still recorded)."""
    caller = sys._getframe(depth).f_globals.get("__name__", "")
    return caller == "torch" or caller.startswith("torch.")


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    rule = SIZE_RULES[name]
    extra_rule = EXTRA_RULES.get(name)
    code = OP_CODES[name]
    always_async = name in ALWAYS_ASYNC
    group_pos, async_pos = GROUP_ASYNC_POS[name]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None or rec.suppressed:
            return fn(*args, **kwargs)
        payload, peer = rule(args, kwargs)
        is_async = always_async or bool(
            async_pos is not None and arg(args, kwargs, async_pos, "async_op", False))
        size = group_size(arg(args, kwargs, group_pos, "group"))
        rec._enter(code)
        start = rec.now()
        rec.suppressed = True  # torch implements some ops with others (send is isend + wait): count once
        try:
            work = fn(*args, **kwargs)
        finally:
            rec.suppressed = False
        rec._leave()  # not reached on an exception: the op stays "in flight" for the launcher's report
        end = None if is_async else rec.now()
        extra = extra_rule(args, kwargs, size) if extra_rule is not None else {}
        ev = rec.add(name, tensor_nbytes(payload), dtype_name(payload), size, peer, start, end, is_async, **extra)
        if is_async and work is not None:
            _watch_completion(work, ev)
            return work if _handed_to_torch() else _RecordedWork(work, ev, rec)
        return work

    wrapper.__dtlab_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_broadcast_coalesced(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(process_group: Any, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None or rec.suppressed:
            return fn(process_group, tensors, *args, **kwargs)
        src = args[1] if len(args) > 1 else kwargs.get("src", 0)
        rec._enter(OP_CODES["broadcast_coalesced"])
        start = rec.now()
        rec.suppressed = True
        try:
            return fn(process_group, tensors, *args, **kwargs)
        finally:
            rec.suppressed = False
            rec._leave()
            rec.add("broadcast", tensor_nbytes(list(tensors)), dtype_name(list(tensors)), process_group.size(), src,
                    start, rec.now(), False)[TAG] = rec.tag or "broadcast_coalesced"

    wrapper.__dtlab_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch_isend_irecv(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(p2p_op_list: Any) -> Any:
        rec = _active
        if rec is None or rec.suppressed:
            return fn(p2p_op_list)
        rec._enter(OP_CODES["batch_isend_irecv"])
        start = rec.now()
        rec.suppressed = True  # the isend/irecv it issues are recorded below, once
        try:
            works = fn(p2p_op_list)
        finally:
            rec.suppressed = False
            rec._leave()
        # One event per transfer, so a pipeline's traffic counts op by op.
        events = []
        for p2p in p2p_op_list:
            op = "isend" if getattr(p2p.op, "__name__", "") == "isend" else "irecv"
            ev = rec.add(op, tensor_nbytes(p2p.tensor), dtype_name(p2p.tensor), group_size(p2p.group), p2p.peer,
                         start, None, True)
            ev[TAG] = rec.tag or "batched"
            events.append(ev)
        if not works:
            return works
        if len(works) == len(events):
            out = []
            for work, ev in zip(works, events):
                _watch_completion(work, ev)
                out.append(_RecordedWork(work, ev, rec))
            return out
        # Coalesced into fewer works (NCCL): every transfer ends with them.
        for work in works:
            for ev in events:
                _watch_completion(work, ev)
        return [_RecordedWork(w, events[0], rec) for w in works]

    wrapper.__dtlab_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def install() -> None:
    """Wrap the c10d entry points once per process (idempotent).

    ``torch.distributed`` re-exports ``distributed_c10d``'s functions; both names
    get the *same* wrapper, so identity checks inside torch (``P2POp`` accepts
    only ``isend``/``irecv``) still hold.
    """
    with _install_lock:
        if _originals:
            return
        makers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            name: functools.partial(_wrap, name) for name in SIZE_RULES
        }
        makers["_broadcast_coalesced"] = _wrap_broadcast_coalesced
        makers["batch_isend_irecv"] = _wrap_batch_isend_irecv
        wrapped: dict[int, Callable[..., Any]] = {}
        for module in (c10d, dist):
            for name, make in makers.items():
                fn = getattr(module, name, None)
                if fn is None:
                    continue
                original = getattr(fn, "__dtlab_original__", fn)
                _originals[(module, name)] = original
                if id(original) not in wrapped:
                    wrapped[id(original)] = make(original)
                setattr(module, name, wrapped[id(original)])


def uninstall() -> None:
    """Put the original functions back (the recorder then sees nothing)."""
    with _install_lock:
        for (module, name), fn in _originals.items():
            setattr(module, name, fn)
        _originals.clear()


def active() -> CommRecorder | None:
    return _active
