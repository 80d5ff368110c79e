"""Instrumented ``torch.distributed.rpc``: workers on loopback, every call recorded like a collective.

``launch_rpc(fn, names)`` runs ``fn(worker, *args)`` in one process per name (dtlab's
``launch``: forkserver, a failing process named, none left behind) with RPC
(TensorPipe) initialised and ``rpc.shutdown()`` called after ``fn`` returns.

Binding: the rendezvous reuses the launcher's TCPStore, which listens on 127.0.0.1
only (a ``dtlab://`` rendezvous handler connects to it as a client, so RPC opens
no store of its own), and TensorPipe listens on the interface that owns
``bind_address`` (``TP_SOCKET_IFNAME``; loopback by default) with its ``uv``
transport and ``basic`` channel only: one listening socket per worker, and no
multiplexed lanes to start. RPC unpickles whatever reaches that socket, without
authentication, so any other address is used only when asked for, with a warning.

Recording: ``rpc.rpc_sync``, ``rpc.rpc_async`` and ``rpc.remote`` are wrapped in
each worker. Each call becomes an event with dtlab.instrument's FIELDS (op =
"rpc_sync" / "rpc_async" / "remote", peer = callee name, tag = function name,
bytes = request bytes, duration_s = latency) plus ``caller`` and
``response_bytes``. Bytes are the tensor payload plus a pickle-size estimate of
everything else, not TensorPipe's framing. Not seen: torch's own internal messages
(distributed autograd's gradients, RRef bookkeeping, the shutdown handshake).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import torch

from dtlab.instrument import FIELDS

try:
    from torch.distributed.rpc.constants import UNSET_RPC_TIMEOUT
except ImportError:  # a torch built without RPC: importing dtlab still works, launch_rpc will not
    UNSET_RPC_TIMEOUT = -1.0

LOOPBACK = "127.0.0.1"
EXTRA_FIELDS = ("caller", "response_bytes")
RPC_FIELDS = FIELDS + EXTRA_FIELDS
RPC_OPS = ("rpc_sync", "rpc_async", "remote")
_RREF_BYTES = 32  # an RRef travels as owner, RRef and fork ids
_INIT_TIMEOUT_S = 60.0  # rendezvous waits for every process to start, whatever rpc_timeout_s is
_active: RpcRecorder | None = None
_workers: tuple[str, ...] = ()
_originals: dict[str, Callable[..., Any]] = {}
_current: RpcWorker | None = None


def interface_for(address: str) -> str:
    """The network interface that owns ``address`` (TensorPipe binds by interface name)."""
    import socket

    import psutil

    found = {name: [a.address for a in addrs if a.family == socket.AF_INET]
             for name, addrs in psutil.net_if_addrs().items()}
    for name, addrs in found.items():
        if address in addrs:
            return name
    known = ", ".join(f"{n}={'/'.join(a)}" for n, a in found.items() if a)
    raise ValueError(f"bind_address={address!r} is not an IPv4 address of this machine ({known})")


def warn_if_exposed(address: str) -> None:
    if address != LOOPBACK:
        warnings.warn(f"RPC will listen on {address}, reachable from other machines: torch.distributed.rpc "
                      "deserialises (unpickles) every message it receives without authentication, so anyone "
                      "who can connect can run code in these processes. Use it only on a trusted network.",
                      UserWarning, stacklevel=3)


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
    if isinstance(obj, torch._C._distributed_rpc.PyRRef):  # rpc.RRef subclasses it; received RRefs are PyRRef
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
              "peer": callee, "start": start, "end": None, "wait_s": 0.0, "async": is_async, "tag": func,
              "step": self.step, "caller": self.name, "response_bytes": 0}
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

            with contextlib.suppress(Exception):  # the owner's confirmation; private, so optional
                rref._get_future().add_done_callback(created)
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


def _rendezvous(url: str, **_kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """``dtlab://127.0.0.1:PORT?rank=R&world_size=W``: the launcher's loopback store, as a client."""
    import torch.distributed as dist

    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if pair)
    rank, world = int(query["rank"]), int(query["world_size"])
    store = dist.TCPStore(parsed.hostname, parsed.port, world, False,
                          timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))
    yield dist.PrefixStore("dtlab-rpc", store), rank, world


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
        raise RuntimeError("not inside an RPC worker started by dtlab.rpc_instrument.launch_rpc")
    return _current


def listening_sockets() -> list[str]:
    """``address:port`` of every socket this process listens on (TCP)."""
    import psutil

    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN)


def _worker_main(info: Any, fn: Callable[..., Any], names: tuple[str, ...], rpc_timeout_s: float,
                 bind_address: str, record: bool, threads: int, args: tuple) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import rpc

    torch.set_num_threads(threads)
    os.environ["TP_SOCKET_IFNAME"] = interface_for(bind_address)  # read by TensorPipe when the agent starts
    with contextlib.suppress(RuntimeError):  # already registered in this (forkserver-preloaded) process
        dist.register_rendezvous_handler("dtlab", _rendezvous)
    install(names)
    global _current
    recorder = RpcRecorder(info.rank, names[info.rank])
    # Set before init_rpc: a peer's first request may run here before fn does.
    _current = worker = RpcWorker(names[info.rank], info.rank, names, recorder, info)
    if record:
        recorder.start()
    options = rpc.TensorPipeRpcBackendOptions(
        init_method=f"dtlab://{LOOPBACK}:{os.environ['MASTER_PORT']}", rpc_timeout=max(rpc_timeout_s, _INIT_TIMEOUT_S),
        _transports=["uv"], _channels=["basic"])
    rpc.init_rpc(names[info.rank], rank=info.rank, world_size=len(names), rpc_backend_options=options)
    rpc._set_rpc_timeout(rpc_timeout_s)
    try:
        value = fn(worker, *args)
    finally:
        recorder.stop()
    rpc.shutdown()  # graceful: returns once every worker is done; a failed worker never gets here
    return {"value": value, "events": recorder.rows(), "phases": recorder.phase_rows()}


class RpcLaunchResult(list):
    """The workers' return values in rank order, with their RPC events, phases and output."""

    names: tuple[str, ...]
    events: list[dict[str, Any]]
    phases: list[dict[str, Any]]
    logs: dict[int, str]
    wall_s: float

    def events_frame(self) -> Any:
        return events_frame(self.events)


def launch_rpc(fn: Callable[..., Any], names: list[str] | tuple[str, ...], *, args: tuple = (),
               rpc_timeout_s: float = 30.0, bind_address: str = LOOPBACK, timeout_s: float = 60.0,
               progress: bool | Callable[[dict[str, Any]], None] = True, record: bool = True,
               threads: int = 0, stop: Any = None) -> RpcLaunchResult:
    """Run ``fn(worker, *args)`` as RPC worker ``names[r]`` in process r, and return the values.

    ``fn`` travels by value (cloudpickle, so a notebook function works), but what the
    workers then send each other over RPC is pickled by reference: functions called
    with ``rpc_sync`` and classes built with ``remote`` must live in an importable module.

    ``rpc_timeout_s`` bounds every RPC (a slower one raises ``RpcTimeout``);
    ``timeout_s`` bounds the launcher's process-group set-up. ``threads``: torch
    threads per process (0: the cores divided among the processes).
    """
    from dtlab.launcher import launch

    names = tuple(names)
    bad = [n for n in names if not isinstance(n, str) or not n or not n.replace("_", "").replace("-", "").isalnum()]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"RPC worker names {list(names)!r} are invalid: give unique, non-empty names "
                         "of letters, digits, '-' and '_'")
    if not rpc_timeout_s > 0:
        raise ValueError(f"rpc_timeout_s={rpc_timeout_s!r} is invalid: must be > 0 seconds")
    interface_for(bind_address)  # fails here, before any process starts
    warn_if_exposed(bind_address)
    threads = threads or max(1, (os.cpu_count() or 1) // len(names))
    out = launch(_worker_main, len(names), args=(fn, names, rpc_timeout_s, bind_address, record, threads, args),
                 backend="gloo", device="cpu", timeout_s=timeout_s, progress=progress, record=False, stop=stop)
    result = RpcLaunchResult(o["value"] for o in out)
    result.names = names
    result.events = [e for o in out for e in o["events"]]
    result.phases = [p for o in out for p in o["phases"]]
    result.logs, result.wall_s = out.logs, out.wall_s
    return result


# -- analysis ------------------------------------------------------------------
def events_frame(rows: Any) -> Any:
    """RPC events as a DataFrame (all of RPC_FIELDS, plus duration_s = latency): rows, or a RunResult."""
    import pandas as pd

    if hasattr(rows, "ranks"):
        rows = [e for r in rows.ranks for e in r.events if "caller" in e]  # RPC events, not collectives
    df = pd.DataFrame(list(rows), columns=list(RPC_FIELDS))
    df["duration_s"] = df["end"] - df["start"]
    return df


def call_table(events: Any) -> Any:
    """One row per (caller, callee, function): calls, request and response bytes, median latency."""
    df = events if hasattr(events, "columns") else events_frame(events)
    g = df.groupby(["caller", "peer", "op", "tag"], sort=True)
    out = g.agg(calls=("seq", "size"), request_bytes=("bytes", "sum"), response_bytes=("response_bytes", "sum"),
                median_latency_ms=("duration_s", "median")).reset_index().rename(columns={"peer": "callee",
                                                                                          "tag": "function"})
    out["median_latency_ms"] *= 1e3
    return out


def call_matrix(events: Any, value: str = "calls") -> Any:
    """Caller x callee: ``calls``, ``request_bytes``, ``response_bytes`` or ``bytes`` (both ways)."""
    table = call_table(events)
    table["bytes"] = table["request_bytes"] + table["response_bytes"]
    if value not in ("calls", "request_bytes", "response_bytes", "bytes"):
        raise ValueError(f"value={value!r}: choose calls, request_bytes, response_bytes or bytes")
    return table.pivot_table(index="caller", columns="callee", values=value, aggfunc="sum", fill_value=0)


def call_matrix_figure(events: Any, value: str = "calls", title: str = "") -> Any:
    """The call matrix as an annotated heat map (matplotlib Figure)."""
    from matplotlib.figure import Figure

    m = call_matrix(events, value)
    fig = Figure(figsize=(4.8, 1.6 + 0.5 * len(m)), layout="constrained")
    ax = fig.subplots()
    values = m.to_numpy(float)
    top = values.max() or 1.0
    ax.imshow(values, cmap="Blues", aspect="auto", vmin=0, vmax=top)
    for i in range(m.shape[0]):
        for j in range(m.shape[1]):
            v = values[i, j]
            text = f"{v:,.0f}" if value == "calls" else f"{v / 1024:,.1f} KiB"
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if v > top / 2 else "black")
    ax.set_xticks(range(m.shape[1]), m.columns)
    ax.set_yticks(range(m.shape[0]), m.index)
    ax.set(xlabel="callee", ylabel="caller", title=title or f"RPC {value.replace('_', ' ')}, caller x callee")
    return fig


def timeline_figure(events: Any, phases: Any, names: tuple[str, ...] | list[str], step: int | None = None) -> Any:
    """Per-worker timeline: each worker's compute phases in one lane, its outgoing RPCs in another."""
    import pandas as pd

    from dtlab import plots

    ev = events if hasattr(events, "columns") else events_frame(events)
    ph = phases if hasattr(phases, "columns") else pd.DataFrame(list(phases), columns=["rank", "phase", "start",
                                                                                        "end", "step"])
    if step is not None:
        ev, ph = ev[ev["step"] == step], ph[ph["step"] == step]
    lanes = [pd.DataFrame({"lane": [f"{names[int(r)]} compute" for r in ph["rank"]], "kind": ph["phase"],
                           "start": ph["start"], "end": ph["end"], "order": ph["rank"] * 2}),
             pd.DataFrame({"lane": [f"{names[int(r)]} rpc" for r in ev["rank"]], "kind": ev["op"],
                           "start": ev["start"], "end": ev["end"], "order": ev["rank"] * 2 + 1})]
    df = pd.concat([d for d in lanes if not d.empty]).sort_values(["order", "start"], kind="stable")
    where = f"step {step}" if step is not None else "whole run"
    return plots.gantt(df, lane="lane", color_by="kind", title=f"RPC timeline per worker ({where})")

