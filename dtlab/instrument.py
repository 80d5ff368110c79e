"""CommRecorder: every c10d collective and point-to-point call as an event.

Recording works by wrapping the Python entry points of ``torch.distributed``
(and its ``distributed_c10d`` module, where torch's own code looks them up) for
the whole process. The wrappers call the original function unchanged, so c10d
behaves exactly as before. What never passes through Python -- DDP's reducer
-- is seen through a comm hook (``recording_hook``) that dtlab's DDP tiers
register. Events are plain lists while recording (appending is cheap) and
become a DataFrame or a Chrome trace afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

# Event layout (a list, mutated in place when an async op completes).
FIELDS = ("rank", "seq", "op", "bytes", "dtype", "group_size", "peer", "start", "end", "wait_s", "async", "tag", "step")
(RANK, SEQ, OP, BYTES, DTYPE, GROUP, PEER, START, END, WAIT, ASYNC, TAG, STEP) = range(len(FIELDS))

# Collectives whose nccl-tests bus-bandwidth factor is 2(n-1)/n, (n-1)/n or 1.
_BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' factor from algorithm to bus bandwidth (1 for broadcast, p2p...)."""
    if n <= 1:
        return 0.0 if op in _BUS_FACTORS else 1.0
    return _BUS_FACTORS.get(op, lambda _n: 1.0)(n)


def algbw(nbytes: float, seconds: float) -> float:
    """Algorithm bandwidth in bytes/s: the message size over the time."""
    return nbytes / seconds if seconds > 0 else float("nan")


def busbw(op: str, nbytes: float, seconds: float, n: int) -> float:
    """Bus bandwidth in bytes/s, by the nccl-tests definitions."""
    return algbw(nbytes, seconds) * bus_factor(op, n)


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _dtype(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return str(obj.dtype).removeprefix("torch.")
    if isinstance(obj, (list, tuple)) and obj:
        return _dtype(obj[0])
    return ""


def _arg(args: Sequence[Any], kwargs: dict[str, Any], index: int, name: str, default: Any = None) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# How to read (bytes, peer) from each wrapped function's arguments. The size
# convention is nccl-tests': all_gather counts the gathered output,
# reduce_scatter the full input.
_SIZE_RULES: dict[str, Callable[[tuple, dict], tuple[Any, Any]]] = {
    "all_reduce": lambda a, k: (_arg(a, k, 0, "tensor"), None),
    "broadcast": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "src")),
    "reduce": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "dst")),
    "all_gather": lambda a, k: (_arg(a, k, 0, "tensor_list"), None),
    "all_gather_into_tensor": lambda a, k: (_arg(a, k, 0, "output_tensor"), None),
    "reduce_scatter": lambda a, k: (_arg(a, k, 1, "input_list"), None),
    "reduce_scatter_tensor": lambda a, k: (_arg(a, k, 1, "input"), None),
    "all_to_all": lambda a, k: (_arg(a, k, 1, "input_tensor_list"), None),
    "all_to_all_single": lambda a, k: (_arg(a, k, 1, "input"), None),
    "gather": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 2, "dst")),
    "scatter": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 2, "src")),
    "barrier": lambda a, k: (None, None),
    # pipelining passes group_dst/group_src (ranks within the group; global ones for the default group)
    "send": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "dst", k.get("group_dst"))),
    "recv": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "src", k.get("group_src"))),
    "isend": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "dst", k.get("group_dst"))),
    "irecv": lambda a, k: (_arg(a, k, 0, "tensor"), _arg(a, k, 1, "src", k.get("group_src"))),
}
# Positions of the ``group`` and ``async_op`` arguments (None: not taken).
_GROUP_ASYNC_POS: dict[str, tuple[int, int | None]] = {
    "all_reduce": (2, 3), "broadcast": (2, 3), "reduce": (3, 4), "all_gather": (2, 3),
    "all_gather_into_tensor": (2, 3), "reduce_scatter": (3, 4), "reduce_scatter_tensor": (3, 4),
    "all_to_all": (2, 3), "all_to_all_single": (4, 5), "gather": (3, 4), "scatter": (3, 4),
    "barrier": (0, 1), "send": (2, None), "recv": (2, None), "isend": (2, None), "irecv": (2, None),
}
_ALWAYS_ASYNC = {"isend", "irecv"}
OP_CODES = {name: i + 1 for i, name in enumerate([*_SIZE_RULES, "broadcast_coalesced", "batch_isend_irecv", "wait"])}
OP_NAMES = {code: name for name, code in OP_CODES.items()}

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
        t0 = time.perf_counter()
        result = self._work.wait(*args, **kwargs)
        t1 = time.perf_counter()
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
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, t0, time.perf_counter(), self.step))

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        previous, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = previous

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
            end: float | None, is_async: bool) -> list:
        ev = [self.rank, len(self.events), op, nbytes, dtype, group_size, peer, start, end, 0.0,
              is_async, self.tag, self.step]
        self.events.append(ev)
        return ev

    # -- results ---------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        out = []
        for ev in self.events:
            row = dict(zip(FIELDS, ev))
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


def events_frame(rows: list[dict[str, Any]]) -> Any:
    """Events as a DataFrame with duration and bandwidth columns (bytes/s)."""
    import pandas as pd

    extra = [k for k in (rows[0] if rows else {}) if k not in FIELDS]  # e.g. the RPC recorder's caller
    df = pd.DataFrame(rows, columns=list(FIELDS) + extra)
    df["duration_s"] = df["end"] - df["start"]
    dur = df["duration_s"].where(df["duration_s"] > 0)
    df["algbw"] = df["bytes"] / dur
    factors = [bus_factor(op, int(n)) for op, n in zip(df["op"], df["group_size"])]
    df["busbw"] = df["algbw"] * pd.Series(factors, index=df.index, dtype=float)
    return df


def chrome_trace(events: list[dict[str, Any]], phases: list[dict[str, Any]] = ()) -> dict[str, Any]:
    """Chrome trace JSON (opens in Perfetto or chrome://tracing): one process per rank."""
    if not events and not phases:
        return {"traceEvents": []}
    t0 = min([e["start"] for e in events] + [p["start"] for p in phases])
    out = []
    for p in phases:
        out.append({"name": p["phase"], "cat": "compute", "ph": "X", "pid": int(p["rank"]), "tid": "compute",
                    "ts": (p["start"] - t0) * 1e6, "dur": (p["end"] - p["start"]) * 1e6,
                    "args": {"step": p["step"]}})
    for e in events:
        out.append({"name": e["op"], "cat": "comm", "ph": "X", "pid": int(e["rank"]), "tid": "comm",
                    "ts": (e["start"] - t0) * 1e6, "dur": max(0.0, e["end"] - e["start"]) * 1e6,
                    "args": {k: e[k] for k in ("bytes", "dtype", "group_size", "peer", "wait_s", "tag", "step")}})
    for rank in sorted({int(x["pid"]) for x in out}):
        out.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_chrome_trace(path: str, events: list[dict[str, Any]], phases: list[dict[str, Any]] = ()) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(events, phases), f, default=str)


# -- the wrappers ----------------------------------------------------------------
_group_sizes: dict[int, int] = {}


def _group_size(group: Any) -> int:
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


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    rule = _SIZE_RULES[name]
    code = OP_CODES[name]
    always_async = name in _ALWAYS_ASYNC
    group_pos, async_pos = _GROUP_ASYNC_POS[name]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        rec = _active
        if rec is None or rec.suppressed:
            return fn(*args, **kwargs)
        payload, peer = rule(args, kwargs)
        is_async = always_async or bool(
            async_pos is not None and _arg(args, kwargs, async_pos, "async_op", False))
        size = _group_size(_arg(args, kwargs, group_pos, "group"))
        rec._enter(code)
        start = time.perf_counter()
        rec.suppressed = True  # torch implements some ops with others (send is isend + wait): count once
        try:
            work = fn(*args, **kwargs)
        finally:
            rec.suppressed = False
        rec._leave()  # not reached on an exception: the op stays "in flight" for the launcher's report
        end = None if is_async else time.perf_counter()
        ev = rec.add(name, _nbytes(payload), _dtype(payload), size, peer, start, end, is_async)
        if is_async and work is not None:
            _watch_completion(work, ev)
            return _RecordedWork(work, ev, rec)
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
        start = time.perf_counter()
        rec.suppressed = True
        try:
            return fn(process_group, tensors, *args, **kwargs)
        finally:
            rec.suppressed = False
            rec._leave()
            rec.add("broadcast", _nbytes(list(tensors)), _dtype(list(tensors)), process_group.size(), src,
                    start, time.perf_counter(), False)[TAG] = rec.tag or "broadcast_coalesced"

    wrapper.__dtlab_original__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_batch_isend_irecv(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(p2p_op_list: Any) -> Any:
        rec = _active
        if rec is None or rec.suppressed:
            return fn(p2p_op_list)
        rec._enter(OP_CODES["batch_isend_irecv"])
        start = time.perf_counter()
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
            ev = rec.add(op, _nbytes(p2p.tensor), _dtype(p2p.tensor), _group_size(p2p.group), p2p.peer,
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
            name: functools.partial(_wrap, name) for name in _SIZE_RULES
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


# -- DDP ---------------------------------------------------------------------------
def recording_hook(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """Wrap a DDP comm hook so that each bucket's reduction is recorded.

    The collectives the inner hook issues are recorded by the wrappers above and
    tagged with the bucket index; a hook that issues none through Python still
    leaves one event per bucket.
    """

    @functools.wraps(inner)
    def hook(state: Any, bucket: Any) -> Any:
        rec = _active
        if rec is None:
            return inner(state, bucket)
        before = len(rec.events)
        start = time.perf_counter()
        previous, rec.tag = rec.tag, f"ddp_bucket:{bucket.index()}"
        try:
            fut = inner(state, bucket)
        finally:
            rec.tag = previous
        if len(rec.events) == before:
            buf = bucket.buffer()
            size = _group_size(getattr(state, "process_group", state))
            ev = rec.add("all_reduce", _nbytes(buf), _dtype(buf), size, None, start, None, True)
            ev[TAG] = f"ddp_bucket:{bucket.index()}"

            def done(_fut: Any) -> None:
                ev[END] = time.perf_counter()

            fut.add_done_callback(done)
        return fut

    return hook


def allreduce_hook(process_group, bucket):  # noqa: ANN001, ANN201 - DDP rejects string annotations here
    """DDP's default reduction (divide by the world size, all-reduce), recorded cheaply.

    Same arithmetic as ``default_hooks.allreduce_hook``, but the one Python
    callback on the future both unwraps the result and stamps the bucket's end
    time, where wrapping the default hook would add a second callback per bucket.
    """
    rec = _active
    buf = bucket.buffer()
    group = process_group if process_group is not None else c10d._get_default_group()
    buf.div_(group.size())
    all_reduce = getattr(c10d.all_reduce, "__dtlab_original__", c10d.all_reduce)  # recorded here, not twice
    start = time.perf_counter()
    work = all_reduce(buf, group=group, async_op=True)
    if rec is None:
        return work.get_future().then(lambda fut: fut.value()[0])
    ev = rec.add("all_reduce", _nbytes(buf), _dtype(buf), group.size(), None, start, None, True)
    ev[TAG] = f"ddp_bucket:{bucket.index()}"

    def done(fut: Any) -> torch.Tensor:
        ev[END] = time.perf_counter()
        return fut.value()[0]

    return work.get_future().then(done)
