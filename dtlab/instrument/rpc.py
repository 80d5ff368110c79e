"""Recording ``torch.distributed.rpc``: every call an event, like a collective.

``rpc.rpc_sync``, ``rpc.rpc_async`` and ``rpc.remote`` are wrapped in each
worker (``install``). Each call becomes an event with the FIELDS of
``dtlab.core.comm`` (op = "rpc_sync" / "rpc_async" / "remote", peer = callee
name, tag = function name, bytes = request bytes, duration_s = latency) plus
``caller`` and ``response_bytes``. Bytes are the tensor payload plus a
pickle-size estimate of everything else, not TensorPipe's framing. Not seen:
torch's own internal messages (distributed autograd's gradients, RRef
bookkeeping, the shutdown handshake). ``dtlab.launch.rpc`` starts the workers.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from dtlab.core.comm import FIELDS
from dtlab.core.compat import is_rref, on_rref_created

try:
    from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
except ImportError:  # a torch built without RPC: importing dtlab still works, launch_rpc will not
    UNSET_RPC_TIMEOUT = -1.0

EXTRA_FIELDS = ("caller", "response_bytes")
RPC_FIELDS = FIELDS + EXTRA_FIELDS
_RREF_BYTES = 32  # an RRef travels as owner, RRef and fork ids
_active: RpcRecorder | None = None
_workers: tuple[str, ...] = ()
_originals: dict[str, Callable[..., Any]] = {}
_current: RpcWorker | None = None


def payload_bytes(obj: Any) -> int:
    """Estimated bytes of an RPC argument or result: tensor data plus a pickle estimate of the rest."""
    if obj is None:
        return 0
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bool, int, float)):
        return 8
    if isinstance(obj, (str, bytes)):
        return len(obj)
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(payload_bytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(payload_bytes(k) + payload_bytes(v) for k, v in obj.items())
    if is_rref(obj):
        return _RREF_BYTES
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # unpicklable here (RPC has its own reducers): count nothing rather than fail the call
        return 0


class RpcTimeout(TimeoutError):
    """An RPC took longer than its timeout (``rpc_timeout_s`` unless the call gave one)."""


class RpcRecorder:
    """The RPC calls (and compute phases) of one worker process."""

    def __init__(self, rank: int, name: str) -> None:
        self.rank, self.name = rank, name
        self.events: list[dict[str, Any]] = []
        self.phases: list[tuple[str, float, float, int]] = []
        self.step = -1
        self.clock_offset = time.time() - time.perf_counter()

    def start(self) -> RpcRecorder:
        global _active
        _active = self
        return self

    @property
    def recording(self) -> bool:
        return _active is self

    def stop(self) -> None:
        global _active
        if _active is self:
            _active = None

    @contextlib.contextmanager
    def phase(self, name: str, step: int | None = None) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.phases.append((name, t0, time.perf_counter(), self.step if step is None else step))

    def add(self, op: str, callee: str, func: str, nbytes: int, start: float, is_async: bool) -> dict[str, Any]:
        ev = {"rank": self.rank, "seq": len(self.events), "op": op, "bytes": nbytes, "dtype": "", "group_size": 2,
              "group": "rpc", "peer": callee, "start": start, "end": None, "wait_s": 0.0, "async": is_async,
              "tag": func, "step": self.step, "caller": self.name, "response_bytes": 0}
        self.events.append(ev)
        return ev

    def rows(self) -> list[dict[str, Any]]:
        off = self.clock_offset
        return [{**e, "start": e["start"] + off, "end": (e["end"] or e["start"]) + off} for e in self.events]

    def phase_rows(self) -> list[dict[str, Any]]:
        off = self.clock_offset
        return [{"rank": self.rank, "phase": n, "start": a + off, "end": b + off, "step": s}
                for n, a, b, s in self.phases]


def _callee(to: Any) -> str:
    name = getattr(to, "name", to)  # a WorkerInfo or a name
    if isinstance(name, str) and _workers and name not in _workers:
        raise ValueError(f"unknown RPC worker {name!r}: this job's workers are {', '.join(_workers)}")
    return str(name)


def _func_name(func: Any) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or type(func).__name__


def _clear_error(exc: BaseException, op: str, callee: str, func: str, timeout: float) -> BaseException:
    if "timeout" not in str(exc).lower():
        return exc
    limit = timeout if timeout and timeout > 0 else torch.distributed.rpc.get_rpc_timeout()
    caller = _active.name if _active is not None else "this worker"
    return RpcTimeout(f"{op} {caller} -> {callee} ({func}) timed out after {limit:g} s "
                      f"(rpc_timeout_s={torch.distributed.rpc.get_rpc_timeout():g}); torch says: {exc}")


def _wrap_sync(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def rpc_sync(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        callee, rec = _callee(to), _active
        start = time.perf_counter()
        try:
            value = fn(to, func, args, kwargs, timeout)
        except RuntimeError as exc:
            raise _clear_error(exc, "rpc_sync", callee, _func_name(func), timeout) from exc
        if rec is not None:
            ev = rec.add("rpc_sync", callee, _func_name(func), payload_bytes(args) + payload_bytes(kwargs),
                         start, False)
            ev["end"], ev["response_bytes"] = time.perf_counter(), payload_bytes(value)
        return value

    return rpc_sync


def _wrap_async(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def rpc_async(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        callee, rec, name = _callee(to), _active, _func_name(func)
        start = time.perf_counter()
        ev = None
        if rec is not None:
            ev = rec.add("rpc_async", callee, name, payload_bytes(args) + payload_bytes(kwargs), start, True)
        inner = fn(to, func, args, kwargs, timeout)
        # A future of our own, so that a timeout arrives as RpcTimeout with the call named.
        outer: torch.futures.Future = torch.futures.Future()

        def done(f: torch.futures.Future) -> None:
            try:
                value = f.value()
            except BaseException as exc:  # every error must reach the caller's wait(), or it hangs
                outer.set_exception(_clear_error(exc, "rpc_async", callee, name, timeout))
                return
            if ev is not None:
                ev["end"], ev["response_bytes"] = time.perf_counter(), payload_bytes(value)
            outer.set_result(value)

        inner.add_done_callback(done)
        return outer

    return rpc_async


def _wrap_remote(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def remote(to: Any, func: Any, args: Any = None, kwargs: Any = None, timeout: float = UNSET_RPC_TIMEOUT) -> Any:
        callee, rec = _callee(to), _active
        start = time.perf_counter()
        rref = fn(to, func, args, kwargs, timeout)
        if rec is not None:
            ev = rec.add("remote", callee, _func_name(func), payload_bytes(args) + payload_bytes(kwargs), start, True)
            ev["response_bytes"] = _RREF_BYTES  # the value stays on the callee; the caller gets an RRef

            def created(_f: Any) -> None:
                ev["end"] = time.perf_counter()

            on_rref_created(rref, created)  # the owner's confirmation
        return rref

    return remote


def install(workers: tuple[str, ...] | list[str] = ()) -> None:
    """Wrap ``rpc.rpc_sync``, ``rpc.rpc_async`` and ``rpc.remote`` for this process (idempotent).

    Only the package's names are replaced: torch's own uses inside ``rpc.api``
    (shutdown, RRef bookkeeping) stay unrecorded. ``rref_proxy`` compares its
    ``rpc_api`` against ``rpc_async`` by identity, so its name is replaced too.
    """
    global _workers
    from torch.distributed import rpc
    from torch.distributed.rpc import rref_proxy

    _workers = tuple(workers)
    if _originals:
        return
    for name, wrap in (("rpc_sync", _wrap_sync), ("rpc_async", _wrap_async), ("remote", _wrap_remote)):
        _originals[name] = getattr(rpc, name)
        setattr(rpc, name, wrap(_originals[name]))
    rref_proxy.rpc_async = rpc.rpc_async


@dataclass
class RpcWorker:
    """What ``fn`` receives: who this process is among the RPC workers."""

    name: str
    rank: int
    names: tuple[str, ...]
    recorder: RpcRecorder
    info: Any  # DistInfo of the process group the launcher made (gloo, loopback)


def current_worker() -> RpcWorker:
    """This process's RpcWorker, for code that RPC runs here (inside ``launch_rpc`` only)."""
    if _current is None:
        raise RuntimeError("not inside an RPC worker started by dtlab.launch.rpc.launch_rpc")
    return _current


def set_current(worker: RpcWorker | None) -> None:
    """Make ``worker`` this process's RpcWorker (the launcher does, before RPC starts)."""
    global _current
    _current = worker


# -- analysis ------------------------------------------------------------------
def events_frame(rows: Any) -> Any:
    """RPC events as a DataFrame (all of RPC_FIELDS, plus duration_s = latency): rows, or a RunResult."""
    import pandas as pd

    if hasattr(rows, "ranks"):
        rows = [e for r in rows.ranks for e in r.events if "caller" in e]  # RPC events, not collectives
    df = pd.DataFrame(list(rows), columns=list(RPC_FIELDS))
    df["duration_s"] = df["end"] - df["start"]
    return df
