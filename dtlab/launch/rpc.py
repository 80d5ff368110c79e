"""``launch_rpc(fn, names)``: one process per RPC worker name, with TensorPipe RPC up.

It runs ``fn(worker, *args)`` in one process per name (dtlab's ``launch``:
forkserver, a failing process named, none left behind) with RPC initialised
and ``rpc.shutdown()`` called after ``fn`` returns, and returns an
``RpcLaunchResult``: a ``LaunchResult`` with the workers' names, RPC calls and phases.

Binding: the rendezvous reuses the launcher's TCPStore, which listens on 127.0.0.1
only (a ``dtlab://`` rendezvous handler connects to it as a client, so RPC opens
no store of its own), and TensorPipe listens on the interface that owns
``bind_address`` (``TP_SOCKET_IFNAME``; loopback by default) with its ``uv``
transport and ``basic`` channel only: one listening socket per worker, and no
multiplexed lanes to start. RPC unpickles whatever reaches that socket, without
authentication, so any other address is used only when asked for, with a warning.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch

from dtlab.core.compat import set_rpc_timeout, tensorpipe_options
from dtlab.core.config import check_world_cap, shared_threads
from dtlab.core.net import LOOPBACK, interface_for, warn_if_exposed
from dtlab.instrument.rpc import RpcRecorder, RpcWorker, events_frame, install, set_current
from dtlab.launch.contract import LaunchResult, Progress
from dtlab.launch.local import launch

_INIT_TIMEOUT_S = 60.0  # rendezvous waits for every process to start, whatever rpc_timeout_s is


def _rendezvous(url: str, **_kwargs: Any) -> Iterator[tuple[Any, int, int]]:
    """``dtlab://127.0.0.1:PORT?rank=R&world_size=W``: the launcher's loopback store, as a client."""
    import torch.distributed as dist

    parsed = urlparse(url)
    query = dict(pair.split("=", 1) for pair in parsed.query.split("&") if pair)
    rank, world = int(query["rank"]), int(query["world_size"])
    store = dist.TCPStore(parsed.hostname, parsed.port, world, False,
                          timeout=datetime.timedelta(seconds=_INIT_TIMEOUT_S))
    yield dist.PrefixStore("dtlab-rpc", store), rank, world


def _worker_main(info: Any, fn: Callable[..., Any], names: tuple[str, ...], rpc_timeout_s: float,
                 bind_address: str, record: bool, threads: int, args: tuple) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed import rpc

    torch.set_num_threads(threads)
    os.environ["TP_SOCKET_IFNAME"] = interface_for(bind_address)  # read by TensorPipe when the agent starts
    with contextlib.suppress(RuntimeError):  # already registered in this (forkserver-preloaded) process
        dist.register_rendezvous_handler("dtlab", _rendezvous)
    install(names)
    recorder = RpcRecorder(info.rank, names[info.rank])
    # Set before init_rpc: a peer's first request may run here before fn does.
    worker = RpcWorker(names[info.rank], info.rank, names, recorder, info)
    set_current(worker)
    if record:
        recorder.start()
    options = tensorpipe_options(f"dtlab://{LOOPBACK}:{os.environ['MASTER_PORT']}",
                                 max(rpc_timeout_s, _INIT_TIMEOUT_S))
    rpc.init_rpc(names[info.rank], rank=info.rank, world_size=len(names), rpc_backend_options=options)
    set_rpc_timeout(rpc_timeout_s)
    try:
        value = fn(worker, *args)
    finally:
        recorder.stop()
    rpc.shutdown()  # graceful: returns once every worker is done; a failed worker never gets here
    return {"value": value, "events": recorder.rows(), "phases": recorder.phase_rows()}


@dataclass(eq=False, repr=False)
class RpcLaunchResult(LaunchResult):
    """The workers' return values in rank order, with their names, RPC calls, phases and output.

    ``events`` are the RPC calls the workers recorded (``dtlab.instrument.rpc``), not torchrun's
    run events; ``phases`` the phases they marked.
    """

    names: tuple[str, ...] = ()
    phases: list[dict[str, Any]] = field(default_factory=list)

    def events_frame(self) -> Any:
        return events_frame(self.events)


def _check_names(names: tuple[str, ...]) -> None:
    bad = [n for n in names if not isinstance(n, str) or not n or not n.replace("_", "").replace("-", "").isalnum()]
    if not names or bad or len(set(names)) != len(names):
        raise ValueError(f"RPC worker names {list(names)!r} are invalid: give unique, non-empty names "
                         "of letters, digits, '-' and '_'")


def launch_rpc(fn: Callable[..., Any], names: list[str] | tuple[str, ...], *, args: tuple = (),
               rpc_timeout_s: float = 30.0, bind_address: str = LOOPBACK, timeout_s: float = 60.0,
               progress: Progress = True, record: bool = True, threads: int = 0,
               stop: threading.Event | None = None) -> RpcLaunchResult:
    """Run ``fn(worker, *args)`` as RPC worker ``names[r]`` in process r, and return the values.

    ``fn`` travels by value (cloudpickle, so a notebook function works), but what the
    workers then send each other over RPC is pickled by reference: functions called
    with ``rpc_sync`` and classes built with ``remote`` must live in an importable module.

    ``rpc_timeout_s`` bounds every RPC (a slower one raises ``RpcTimeout``);
    ``timeout_s`` bounds the launcher's process-group set-up. ``threads``: torch
    threads per process (0: the cores divided among the processes). ``record``
    switches the RPC recorder on (the c10d CommRecorder stays off).
    """
    names = tuple(names)
    _check_names(names)
    check_world_cap(len(names), "RPC workers")
    if not rpc_timeout_s > 0:
        raise ValueError(f"rpc_timeout_s={rpc_timeout_s!r} is invalid: must be > 0 seconds")
    interface_for(bind_address)  # fails here, before any process starts
    warn_if_exposed(bind_address)
    threads = threads or shared_threads(len(names))
    out = launch(_worker_main, len(names), args=(fn, names, rpc_timeout_s, bind_address, record, threads, args),
                 backend="gloo", device="cpu", timeout_s=timeout_s, progress=progress, record=False, stop=stop)
    return RpcLaunchResult([o["value"] for o in out], out.logs, out.wall_s,
                           events=[e for o in out for e in o["events"]], names=names,
                           phases=[p for o in out for p in o["phases"]])
