"""CommRecorder: every c10d collective and point-to-point call of a process as an event.

The one facade for recording. ``start()`` installs the dispatcher kernels
(``dtlab.instrument.dispatch``) that see every call whichever path it took;
``stop()`` removes them, and torch runs as if dtlab were not there. A tier
declares the channels it wants (``Strategy.comm_channels``: ``modules``,
``ddp_buckets``, ``fsdp_units``, ...; see ``dtlab.instrument.channels``), which the training loop
opens with ``recorder.channels(...)``. Tags and the suppression of recording
are per thread: DDP's reducer and torchft's recovery run on threads of their own.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch.distributed as dist

from dtlab.core.comm import events_frame
from dtlab.core.timing import StepClock
from dtlab.instrument.channels import CHANNELS, Channel
from dtlab.instrument.dispatch import Interceptor
from dtlab.instrument.events import Event
from dtlab.instrument.ops import ASYNC_NAMES, OP_CODES, OpRule, dtype_name, tensor_nbytes
from dtlab.instrument.unseen import note_unseen

_active: CommRecorder | None = None
_interceptor = Interceptor()
_install_lock = threading.Lock()


class CommRecorder:
    """Records communication events (and compute phases) of one process.

    Use as a context manager, or ``start()`` / ``stop()``. While started, every
    collective in the process is recorded, whoever calls it and however.

    ``live`` is an optional shared array of 5 doubles per process that the
    launcher reads to say which op a hung rank is waiting in.
    """

    def __init__(self, rank: int | None = None, live: Any = None) -> None:
        self.rank = rank
        self.events: list[Event] = []
        self.phases: list[tuple[str, float, float, int]] = []
        self._step = -1
        self._seq = itertools.count()
        self._thread = threading.local()
        self._taggers: list[Any] = []
        self._checks: list[Callable[[str, dict[str, Any], int], None]] = []  # run before each call (``checked``)
        self._in_flight: dict[int, tuple[Any, Event]] = {}  # id(Work) -> (the Work, its event), until waited
        self.unseen_paths: set[str] = set()  # calls made by a path the recorder cannot see
        # storage of a functional collective's output -> its event, until wait_tensor waits on it
        self._awaited: dict[int, Event] = {}
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
        with _install_lock:
            if _active is not None and _active is not self:
                raise RuntimeError("another CommRecorder is already recording in this process")
            if self.rank is None:
                self.rank = dist.get_rank() if dist.is_initialized() else 0
            if not _interceptor.installed:
                _interceptor.install(self)
            _active = self
        return self

    def stop(self) -> None:
        global _active
        with _install_lock:
            if _active is self:
                _interceptor.remove()
                _active = None
                self._in_flight.clear()
                self._awaited.clear()

    def __enter__(self) -> CommRecorder:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @contextlib.contextmanager
    def channels(self, names: Sequence[str]) -> Iterator[list[Channel]]:
        """Open the named channels (``dtlab.instrument.channels.CHANNELS``) for the block; it gets them."""
        unknown = [n for n in names if n not in CHANNELS]
        if unknown:
            raise ValueError(f"unknown recorder channel(s) {unknown}; known: {sorted(CHANNELS)}")
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(CHANNELS[n](self)) for n in names]
            self._taggers += opened
            try:
                yield opened
            finally:
                for channel in opened:
                    self._taggers.remove(channel)

    @contextlib.contextmanager
    def checked(self, check: Callable[[str, dict[str, Any], int], None]) -> Iterator[None]:
        """Run ``check(op, arguments, group_size)`` before each call of the block is issued, its arguments bound by
        name to the c10d op's schema. What it raises the caller gets, and the call is never made: an exercise's
        checker refuses there a call that would bring the backend down (gloo aborts a process whose all-to-all
        sizes disagree with a peer's, with no Python error to name)."""
        self._checks.append(check)
        try:
            yield
        finally:
            self._checks.remove(check)

    # -- what the training loop and the tiers tell it -------------------------
    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a compute phase (forward, backward, ...) for the timeline."""
        t0 = self.now()
        try:
            yield
        finally:
            self.phases.append((name, t0, self.now(), self.step))

    @property
    def tag(self) -> str:
        """This thread's tag for the calls it makes ("" if none)."""
        return getattr(self._thread, "tag", "")

    @contextlib.contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        """Tag the calls this thread makes in the block."""
        previous, self._thread.tag = self.tag, tag
        try:
            yield
        finally:
            self._thread.tag = previous

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Record nothing this thread calls in the block (dtlab's own bookkeeping collectives)."""
        previous, self._thread.quiet = getattr(self._thread, "quiet", False), True
        try:
            yield
        finally:
            self._thread.quiet = previous

    def now(self) -> float:
        """A timestamp: ``time.perf_counter()``, or on CUDA a mark of the step's clock (resolved after it)."""
        return self.clock.mark() if self.clock is not None else time.perf_counter()

    def retime(self, times: dict[float, float], events_from: int = 0, phases_from: int = 0) -> None:
        """Move timestamps taken since these positions to the device's clock (``StepClock.resolve``)."""
        if not times:
            return
        for ev in self.events[events_from:]:
            ev.start = times.get(ev.start, ev.start)
            if ev.end is not None:
                ev.end = times.get(ev.end, ev.end)
        self.phases[phases_from:] = [(n, times.get(a, a), times.get(b, b), s) for n, a, b, s in
                                     self.phases[phases_from:]]

    # -- what the dispatcher's kernels report (dtlab.instrument.dispatch.Sink) --
    def listening(self) -> bool:
        return not getattr(self._thread, "quiet", False)

    def begin(self, rule: OpRule, bound: dict[str, Any], api: str, from_engine: bool) -> tuple[Event, Any]:
        group = _unbox_group(bound.get(rule.group))
        size, name = _group_size(group), _group_name(group)
        for check in list(self._checks):
            check(rule.op, bound, size)
        peer = bound.get(rule.peer) if rule.peer else None
        if peer is not None and peer >= 0:
            peer = _global_rank(group, peer)
        op = rule.op
        if rule.async_arg is None:  # send/isend, recv/irecv: one op each; only c10d's send and recv block
            is_async = api not in ("send", "recv")
            op = ASYNC_NAMES.get(op, op) if is_async else op
        else:
            is_async = bool(bound.get(rule.async_arg, True))
        payload = bound.get(rule.payload) if rule.payload else None
        extra = rule.extra(bound, size) if rule.extra is not None else None
        tag = self.tag or ("batched" if api == "batch_isend_irecv" else "") or self._channel_tag(op, from_engine)
        self._enter(OP_CODES.get(op, 0), new_call=True)
        event = self.add(op, tensor_nbytes(payload), dtype_name(payload), size, peer, self.now(), is_async,
                         tag=tag, group=name, extra=extra)
        return event, bound.get(rule.output) if rule.output and is_async and api == "" else None

    def issued(self, call: tuple[Event, Any], out: Any) -> None:
        self._leave()
        event, outputs = call
        if outputs is not None:  # perhaps a functional collective's result: its wait_tensor ends the wait
            for tensor in outputs if isinstance(outputs, (list, tuple)) else [outputs]:
                self._awaited[_storage(tensor)] = event
        work = _unbox_work(out[1] if isinstance(out, tuple) else out)
        if work is None:
            event.finish(self.now())
            return
        key = id(work)
        self._in_flight[key] = (work, event)  # until waited on or complete: the Work holds the call's tensors
        try:
            future = work.get_future()
        except RuntimeError:  # gloo's send/recv works have no future: their wait() ends them
            return

        def done(_: Any) -> None:
            event.finish(time.perf_counter())
            self._in_flight.pop(key, None)  # a wait() after this one blocks on nothing

        future.add_done_callback(done)

    def failed(self, call: tuple[Event, Any]) -> None:
        """The call raised: the event stays open, and the op "in flight" for the launcher's report."""

    def wait(self, work: Any, original: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        found = self._in_flight.pop(id(work), None)
        if found is None:
            return original(work, *args, **kwargs)
        event = found[1]
        self._enter(OP_CODES.get(event.op, 0))
        t0 = self.now()
        result = original(work, *args, **kwargs)
        t1 = self.now()  # on CUDA: where the stream is once it waits for the op (see dtlab.core.timing)
        self._leave()
        event.wait_s += t1 - t0
        event.finish(t1)
        return result

    def tensor_wait(self, tensor: Any, wait: Callable[[], Any]) -> Any:
        event = self._awaited.pop(_storage(tensor), None)
        if event is None:
            return wait()
        self._enter(OP_CODES.get(event.op, 0))
        t0 = self.now()
        result = wait()
        t1 = self.now()
        self._leave()
        event.wait_s += t1 - t0
        event.finish(t1)
        return result

    def unseen(self, path: str) -> None:
        """A call the recorder cannot see was made: say so once per path (``dtlab.instrument.unseen``)."""
        if path not in self.unseen_paths:
            self.unseen_paths.add(path)
            note_unseen(path)

    def _channel_tag(self, op: str, from_engine: bool) -> str:
        for channel in self._taggers:
            tag = channel.tag(op, from_engine, self._step)
            if tag:
                return tag
        return ""

    def _enter(self, code: int, new_call: bool = False) -> None:
        """Tell the launcher this thread is now inside ``code``'s call (a new one, or a wait on one)."""
        live = self.live
        if live is not None:
            live[0] += new_call
            live[1] = code
            live[2] = 1.0
            live[3] = time.time()

    def _leave(self) -> None:
        if self.live is not None:
            self.live[2] = 0.0

    def add(self, op: str, nbytes: int, dtype: str, group_size: int, peer: Any, start: float, is_async: bool,
            tag: str = "", group: str = "", extra: dict[str, Any] | None = None) -> Event:
        """A new event (for the kernels, and for callers that record an exchange of their own)."""
        event = Event(self.rank, next(self._seq), op, nbytes, dtype, group_size, group, peer, start, is_async,
                      tag, self._step, extra)
        self.events.append(event)
        return event

    # -- results ---------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        return [ev.row(self.clock_offset) for ev in self.events]

    def phase_rows(self) -> list[dict[str, Any]]:
        return [
            {"rank": self.rank, "phase": n, "start": a + self.clock_offset, "end": b + self.clock_offset, "step": s}
            for n, a, b, s in self.phases
        ]

    def frame(self) -> Any:
        return events_frame(self.rows())


def _storage(tensor: Any) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return id(tensor)


def _unbox_group(obj: Any) -> Any:
    if obj is None or isinstance(obj, dist.ProcessGroup):
        return obj
    try:
        return dist.ProcessGroup.unbox(obj)
    except RuntimeError:
        return None


def _unbox_work(obj: Any) -> Any:
    if obj is None:
        return None
    try:
        return dist.distributed_c10d.Work.unbox(obj)
    except (RuntimeError, TypeError):
        return None


def _group_size(group: Any) -> int:
    try:
        return int(group.size())
    except Exception:  # not configured yet (torchft before its first quorum)
        return 0


def _group_name(group: Any) -> str:
    try:
        return str(group.group_name)
    except Exception:  # a group torch never named (built by hand, as torchft does)
        return ""


def _global_rank(group: Any, rank: int) -> int:
    """A rank within ``group`` as a global rank; the group's own rank for groups c10d does not know."""
    try:
        return int(dist.get_global_rank(group, rank))
    except (ValueError, RuntimeError, KeyError, AttributeError):
        return rank


def active() -> CommRecorder | None:
    return _active


def tagged(tag: str) -> contextlib.AbstractContextManager[Any]:
    """Tag this thread's calls in the block, if a recorder is running (a no-op otherwise)."""
    rec = _active
    return rec.tagged(tag) if rec is not None else contextlib.nullcontext()


def timed_phase(name: str) -> contextlib.AbstractContextManager[Any]:
    """Time a compute phase for the timeline, if a recorder is running (a no-op otherwise)."""
    rec = _active
    return rec.phase(name) if rec is not None else contextlib.nullcontext()


def installed() -> bool:
    """Whether the dispatcher kernels are in place (only while a recorder runs)."""
    return _interceptor.installed


def tag_methods(obj: Any, tags: dict[str, str]) -> None:
    """Tag the calls made inside ``obj``'s named methods (``{"allreduce": "ft_cross_replica"}``): for an
    object whose calls reach c10d through methods of its own, as torchft's process group does."""
    for method, tag in tags.items():
        original = getattr(obj, method)
        if getattr(original, "__dtlab_tag__", None) == tag:
            continue

        def wrapper(*args: Any, _original: Callable[..., Any] = original, _tag: str = tag, **kwargs: Any) -> Any:
            with tagged(_tag):
                return _original(*args, **kwargs)

        wrapper.__dtlab_tag__ = tag  # type: ignore[attr-defined]
        setattr(obj, method, wrapper)


def tag_ddp_hook(inner: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A DDP comm hook whose calls are tagged with the bucket they reduce (``ddp_bucket:<index>``)."""

    @functools.wraps(inner)
    def hook(state: Any, bucket: Any) -> Any:
        with tagged(f"ddp_bucket:{bucket.index()}"):
            return inner(state, bucket)

    return hook
