"""Where the recorder listens: a Python kernel at the dispatcher's ``BackendSelect`` key for every ``c10d`` op.

Every ``ProcessGroup`` method calls its op through the dispatcher (``c10d::allreduce_``, ``c10d::send``, ...:
see ``ProcessGroup.hpp``), whether the call came from ``torch.distributed``'s Python functions under any
name, from ``P2POp``, from a functional collective (DTensor, tensor parallelism) or from C++ (DDP's
reducer, ``_broadcast_coalesced``). ``BackendSelect`` is in every call's key set and has no kernel of its
own for these ops (a fallthrough), so a kernel registered there sees each call once, below autograd and
above the backend, and hands it on unchanged with ``redispatch``. Nothing of torch's Python is replaced,
so identity checks inside torch (``P2POp`` accepts only ``isend``/``irecv``) and names bound before
recording started are untouched. Registering is ``torch.library``'s public API; the registration is undone when
recording stops.

``Work.wait`` is patched on the class while recording, to time how long a caller blocks on a handle; a
functional collective's caller blocks in ``_c10d_functional::wait_tensor`` instead, another dispatcher
op, which a kernel at the same key times.

One path stays unseen: a collective method called from Python on a *backend* object
(``pg._get_backend(device).allreduce(...)``) runs the backend directly, below the dispatcher. torch
itself never does this; while recording, such a call is reported once per method (``Sink.unseen``,
which the launcher turns into a one-line warning) rather than missed silently.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from dtlab.core.compat import backend_class, unregister_library
from dtlab.instrument.ops import C10D_OPS, OpRule, argument_names, bind, check_schemas, overload, schema_defaults

Work = dist.distributed_c10d.Work
_C10D_MODULE = "torch.distributed.distributed_c10d"
_PASS_THROUGH = ("torch.distributed.c10d_logger",)  # decorators between a user's call and c10d's function


class Sink(Protocol):
    """What the kernels report to (the CommRecorder)."""

    def listening(self) -> bool: ...

    def begin(self, rule: OpRule, bound: dict[str, Any], api: str, from_engine: bool) -> Any: ...

    def issued(self, call: Any, out: Any) -> None: ...

    def failed(self, call: Any) -> None: ...

    def wait(self, work: Any, original: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any: ...

    def unseen(self, path: str) -> None: ...

    def tensor_wait(self, tensor: Any, wait: Callable[[], Any]) -> Any: ...


Backend = backend_class()
# The collective methods of a backend object, which bypass the dispatcher when called on it directly.
BACKEND_METHODS = ("allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
                   "allgather_coalesced", "gather", "scatter", "reduce_scatter", "_reduce_scatter_base",
                   "alltoall_base", "alltoall", "send", "recv", "recv_anysource", "barrier", "monitored_barrier")


def caller_api(frame: Any) -> tuple[str, bool]:
    """The outermost ``torch.distributed`` function the call went through (``send``, ``isend``,
    ``batch_isend_irecv``, ``all_reduce``, ...), and whether autograd's engine issued it from C++ with no
    Python in between (``from_engine``: DDP's reducer launching a bucket, a C++ autograd function)."""
    api = ""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == _C10D_MODULE:
            api = frame.f_code.co_name
        elif module not in _PASS_THROUGH:
            break
        frame = frame.f_back
    if api:
        return api, False
    # No Python frame at all: a thread of the engine's own (a device's); else the engine's Python entry point.
    return "", frame is None or str(frame.f_globals.get("__name__", "")).startswith("torch.autograd")


def _kernel(name: str, sink: Sink) -> Callable[..., Any]:
    op, rule = overload(name), C10D_OPS[name]
    arguments, defaults = argument_names(name), schema_defaults(name)
    below = torch._C.DispatchKey.BackendSelect

    def kernel(keyset: Any, *args: Any, **kwargs: Any) -> Any:
        keys = keyset.remove(below)
        if not sink.listening():
            return op.redispatch(keys, *args, **kwargs)
        api, from_engine = caller_api(sys._getframe(0).f_back)
        call = sink.begin(rule, bind(arguments, defaults, args, kwargs), api, from_engine)
        try:
            out = op.redispatch(keys, *args, **kwargs)
        except BaseException:
            sink.failed(call)
            raise
        sink.issued(call, out)
        return out

    return kernel


def _wait_tensor_kernel(sink: Sink) -> Callable[..., Any]:
    op = torch.ops._c10d_functional.wait_tensor.default
    below = torch._C.DispatchKey.BackendSelect

    def kernel(keyset: Any, tensor: Any) -> Any:
        keys = keyset.remove(below)
        return sink.tensor_wait(tensor, lambda: op.redispatch(keys, tensor))

    return kernel


class Interceptor:
    """The kernels and the ``Work.wait`` patch of one process, installed and removed as a whole."""

    def __init__(self) -> None:
        self.library: Any = None
        self.functional_library: Any = None
        self.original_wait: Callable[..., Any] | None = None
        self.original_backend: dict[str, Callable[..., Any]] = {}

    @property
    def installed(self) -> bool:
        return self.library is not None

    def install(self, sink: Sink) -> None:
        library = torch.library.Library("c10d", "IMPL")
        functional = torch.library.Library("_c10d_functional", "IMPL")
        try:
            for name in check_schemas():
                library.impl(name, _kernel(name, sink), "BackendSelect", with_keyset=True)
            functional.impl("wait_tensor", _wait_tensor_kernel(sink), "BackendSelect", with_keyset=True)
        except BaseException:
            unregister_library(library)
            unregister_library(functional)
            raise
        self.library, self.functional_library = library, functional
        original = self.original_wait = Work.wait

        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            return sink.wait(work, original, args, kwargs)

        Work.wait = wait
        for method in BACKEND_METHODS:
            original_method = getattr(Backend, method, None)
            if original_method is not None:
                self.original_backend[method] = original_method
                setattr(Backend, method, _noted(original_method, f"Backend.{method}", sink))

    def remove(self) -> None:
        if self.library is not None:
            unregister_library(self.library)
            unregister_library(self.functional_library)
            self.library = self.functional_library = None
        if self.original_wait is not None:
            Work.wait = self.original_wait
            self.original_wait = None
        for method, original in self.original_backend.items():
            setattr(Backend, method, original)
        self.original_backend.clear()


def _noted(method: Callable[..., Any], path: str, sink: Sink) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        sink.unseen(path)
        return method(*args, **kwargs)

    return call
