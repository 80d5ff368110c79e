"""Recording the methods of one process-group object: ``pg.allreduce``, ``pg.send``, ``pg.recv``.

CommRecorder wraps the functions of ``torch.distributed``. A library that calls a
process group's own methods passes none of them: torchft's Manager calls
``pg.allreduce([tensor], opts)`` on the gloo group it rebuilds at every quorum
change, and its checkpoint transport calls ``pg.send`` / ``pg.recv``.
``record_methods(pg, tag)`` wraps those methods on that one object, so each call
becomes an event of the active recorder, tagged, with the group's size at the
time of the call (the number of replica groups in the quorum, for torchft).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from dtlab.core.comm import END, TAG
from dtlab.instrument.calls import dtype_name, tensor_nbytes
from dtlab.instrument.recorder import active

# method name -> (the op's name in events, the position of its peer argument after the tensors)
_METHODS = {"allreduce": ("all_reduce", None), "send": ("send", 0), "recv": ("recv", 0)}


def record_methods(pg: Any, tag: str, methods: tuple[str, ...] = tuple(_METHODS)) -> None:
    """Wrap ``pg``'s ``methods`` (of allreduce, send, recv) so that a started CommRecorder records each call."""
    for method in methods:
        op, peer_pos = _METHODS[method]
        original = getattr(pg, method, None)
        if original is None or getattr(original, "__dtlab_recorded__", False):
            continue
        setattr(pg, method, _recorded(original, op, peer_pos, tag, pg))


def _size(pg: Any) -> int:
    try:
        return int(pg.size())
    except Exception:  # not configured yet (torchft before its first quorum): the call itself will say so
        return 0


def _recorded(fn: Callable[..., Any], op: str, peer_pos: int | None, tag: str, pg: Any) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        rec = active()
        if rec is None:
            return fn(tensors, *args, **kwargs)
        start = rec.now()
        work = fn(tensors, *args, **kwargs)
        peer = args[peer_pos] if peer_pos is not None and len(args) > peer_pos else None
        ev = rec.add(op, tensor_nbytes(tensors), dtype_name(tensors), _size(pg), peer, start, None, True)
        ev[TAG] = tag
        _stamp_end(work, ev)
        return work

    wrapper.__dtlab_recorded__ = True  # type: ignore[attr-defined]
    return wrapper


def _stamp_end(work: Any, event: list) -> None:
    """The event ends when the work's future completes (the caller waits on the work itself)."""
    try:
        fut = work.get_future()
    except Exception:  # a work without a future: the event keeps its start as its end
        return

    def done(_fut: Any) -> None:
        event[END] = time.perf_counter()

    fut.add_done_callback(done)
