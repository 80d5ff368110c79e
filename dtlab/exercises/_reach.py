"""What a learner's code holds: every tensor it can reach, judged by storage and values, not by identity.

A check that follows one tensor object is fooled by ``full.detach()``, ``full.data`` or a view (other
Python objects over the same storage) and by ``full.clone()`` (other storage, the same size and values).
So these helpers collect every tensor the learner's code can reach -- through the objects it was handed
(their attributes, recursively through containers), the module globals and closure cells its functions
use, its running frames, and the autograd graphs of what it keeps -- and an exercise judges what was
found by the storage (``untyped_storage()``: its size, whether another tensor's) and by the values.

``reachable_tensors`` walks from named roots; ``tensors_made`` finds every tensor created since a moment and
still alive, wherever it is referenced; ``Fingerprints`` finds given tensors' values among what was found;
``HeldWatch`` calls a probe at every line the learner's code runs, with what it holds at that moment.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
import sysconfig
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.utils.deterministic
from torch.autograd.graph import Node

_LIBRARIES = tuple(sorted({os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)),
                           *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib"))}))
_LEAVES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, torch.dtype, torch.device,
           weakref.ReferenceType, types.ModuleType, types.BuiltinFunctionType, types.CodeType)
_learner_code: dict[types.CodeType, bool] = {}


@dataclass(frozen=True)
class Found:
    """A tensor the learner's code can reach, and the shortest way found to it (``where``: "unit.cache[0]")."""

    where: str
    tensor: torch.Tensor


def is_learner_code(code: types.CodeType) -> bool:
    """Whether ``code`` is the learner's: not torch's, dtlab's, the standard library's or an installed package's.

    A notebook cell, a test module or the learner's own file is; ``<frozen ...>`` modules are not."""
    known = _learner_code.get(code)
    if known is None:
        name = code.co_filename
        known = _learner_code[code] = not (name.startswith(_LIBRARIES) or name.startswith("<frozen"))
    return known


def count_as_learner(fn: Any) -> None:
    """Treat ``fn``'s code as the learner's wherever it lives: the function a check runs is, even a reference
    solution inside dtlab."""
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        _learner_code[code] = True


def reachable_tensors(roots: Mapping[str, Any], *, skip: frozenset[int] = frozenset(),
                      limit: int = 20_000) -> list[Found]:
    """Every tensor reachable from ``roots`` (a name for each object), once each, breadth first.

    It follows containers (dict keys and values, lists, tuples, sets), objects' attributes (``__dict__``
    and ``__slots__``: an nn.Module's parameters, an optimizer's state), the learner's functions (their
    closure cells, defaults and the module globals their code names), bound methods, generators' frames,
    a tensor's ``.grad`` and its autograd graph (the tensors saved for backward, the leaves). It skips
    modules, library functions and classes, and the objects whose ``id`` is in ``skip``; it stops after
    ``limit`` objects. A NumPy array is found as the tensor sharing its memory (``torch.from_numpy``).
    """
    queue: deque[tuple[str, Any]] = deque(roots.items())
    seen, keep, found = set(skip), [], []  # keep: what was visited stays alive, so no id is reused meanwhile
    while queue and len(keep) < limit:
        where, obj = queue.popleft()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        keep.append(obj)
        if isinstance(obj, np.ndarray):
            obj = _from_numpy(obj)
            if obj is None:
                continue
        if isinstance(obj, torch.Tensor):
            found.append(Found(where, obj))
            queue.extend(_tensor_links(where, obj))
        else:
            queue.extend(_links(where, obj))
    return found


def _from_numpy(array: np.ndarray) -> torch.Tensor | None:
    while isinstance(array.base, np.ndarray):  # the whole buffer a view keeps alive
        array = array.base
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError):
        return None


def _tensor_links(where: str, t: torch.Tensor) -> Iterator[tuple[str, Any]]:
    if (t.is_leaf or t.retains_grad) and t.grad is not None:  # a non-leaf's .grad is None, and warns
        yield f"{where}.grad", t.grad
    if t.grad_fn is not None:
        yield f"{where} (through its autograd graph)", t.grad_fn


def _links(where: str, obj: Any) -> Iterator[tuple[str, Any]]:
    """The objects ``obj`` refers to that may lead to tensors, each with its path."""
    if isinstance(obj, Mapping):
        for key, value in list(obj.items()):
            yield f"{where}[{key!r}]", value
            yield f"{where} (a key)", key
    elif isinstance(obj, list | tuple | set | frozenset | deque):
        yield from ((f"{where}[{i}]", item) for i, item in enumerate(list(obj)))
    elif isinstance(obj, types.CellType):
        try:
            yield where, obj.cell_contents
        except ValueError:  # an empty cell
            pass
    elif isinstance(obj, types.FunctionType):
        yield from _function_links(where, obj)
    elif isinstance(obj, types.MethodType):
        yield f"{where}.__self__", obj.__self__
        yield where, obj.__func__
    elif isinstance(obj, types.GeneratorType | types.CoroutineType | types.AsyncGeneratorType):
        frame = getattr(obj, "gi_frame", None) or getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
        if frame is not None:
            yield from frame_links(frame)
    elif isinstance(obj, types.FrameType):
        yield from frame_links(obj)
    elif isinstance(obj, type):
        if _is_learner_class(obj):
            yield from ((f"{obj.__name__}.{k}", v) for k, v in list(vars(obj).items()))
    elif isinstance(obj, Node):
        yield from _graph_links(where, obj)
    else:
        yield from _attribute_links(where, obj)


def _function_links(where: str, fn: types.FunctionType) -> Iterator[tuple[str, Any]]:
    code = fn.__code__
    if not is_learner_code(code):
        return
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        yield f"{fn.__name__}'s closure variable {name}", cell
    for i, value in enumerate(fn.__defaults__ or ()):
        yield f"{fn.__name__}'s default argument {i}", value
    yield f"{fn.__name__}'s keyword defaults", fn.__kwdefaults__ or {}
    names = fn.__globals__
    for name in sorted(global_names(code)):
        if name in names:
            yield f"global {name}", names[name]


def global_names(code: types.CodeType) -> set[str]:
    """The names ``code`` and the code nested in it (inner functions, lambdas, comprehensions) may look up as
    globals: a function reaches the module globals it names, not the whole module."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= global_names(const)
    return names


def frame_links(frame: types.FrameType) -> Iterator[tuple[str, Any]]:
    """A running (or suspended) frame's local variables, each named as the learner wrote it."""
    code = frame.f_code
    for name, value in list(frame.f_locals.items()):
        yield f"{code.co_name}'s {'closure variable' if name in code.co_freevars else 'local'} {name}", value


def _is_learner_class(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    return cls.__module__ == "__main__" or (path is not None and not path.startswith(_LIBRARIES))


def _graph_links(where: str, node: Any) -> Iterator[tuple[str, Any]]:
    """An autograd node's saved tensors, its leaf (AccumulateGrad), what its Function's ctx keeps, the next
    nodes. Saved tensors freed by backward raise when read: they are gone, so nothing is found."""
    for name in dir(node):
        if name.startswith("_saved_") or name in ("variable", "saved_tensors"):
            try:
                yield where, getattr(node, name)
            except RuntimeError:
                pass
    if hasattr(node, "__dict__"):  # a custom Function's ctx: what the learner stored on it
        yield from ((where, v) for v in list(vars(node).values()))
    yield from ((where, nxt) for nxt, _ in node.next_functions if nxt is not None)


def _attribute_links(where: str, obj: Any) -> Iterator[tuple[str, Any]]:
    try:
        attrs = vars(obj)
    except TypeError:
        attrs = {}
    for name, value in list(attrs.items()):
        yield f"{where}.{name}", value
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if isinstance(name, str) and not name.startswith("__") and hasattr(obj, name):
                yield f"{where}.{name}", getattr(obj, name)


def fold(where: str) -> str:
    """A path with its list indices folded: "kept[0]" and "kept[1]" are both "kept[…]"."""
    return re.sub(r"\[\d+\]", "[…]", where)


def places(wheres: list[str], most: int = 4) -> str:
    """Paths for feedback: indices folded (``fold``), each once, at most ``most`` of them."""
    folded = list(dict.fromkeys(fold(w) for w in wheres))
    more = f" and {len(folded) - most} more" if len(folded) > most else ""
    return ", ".join(folded[:most]) + more


# -- by storage and by value ----------------------------------------------------------------------------------
def storage_bytes(t: torch.Tensor) -> int:
    """The bytes of the memory ``t`` keeps alive: its whole storage, however small a view of it ``t`` is."""
    return t.untyped_storage().nbytes()


def storage_key(t: torch.Tensor) -> int:
    """The same number for every tensor over the same memory (views, ``.detach()``, ``.data``)."""
    return t.untyped_storage().data_ptr()


def storage_values(t: torch.Tensor) -> torch.Tensor:
    """All the values in ``t``'s storage, as a flat tensor of ``t``'s dtype (a view's neighbours too)."""
    storage = t.untyped_storage()
    count = storage.nbytes() // t.element_size()
    return torch.empty(0, dtype=t.dtype).set_(storage, 0, (count,)) if count else torch.empty(0, dtype=t.dtype)


def held_values(found: list[Found]) -> dict[torch.dtype, torch.Tensor]:
    """Every value stored in the memory of the tensors found, per floating dtype (each storage once)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    storages = set()
    for f in found:
        t = f.tensor
        if not t.is_floating_point() or t.device.type != "cpu" or storage_bytes(t) == 0:
            continue
        key = (storage_key(t), t.dtype)
        if key not in storages:
            storages.add(key)
            by_dtype.setdefault(t.dtype, []).append(storage_values(t).detach())
    return {dtype: torch.cat(parts) for dtype, parts in by_dtype.items()}


class Fingerprints:
    """Tensors to look for among held values, each by ``points`` of its values spread over it: random floats do not
    coincide, so those values present mean the tensor is there. Built once, asked at every line: it must be quick.

    ``shares(values)`` gives, per tensor, the share of its points present among ``values`` (``held_values``) in
    any floating dtype: 1.0 when a rank holds it, or a copy, a transpose, a wider or narrower dtype of it.

    It keeps the tensors (and every copy it makes of their values) alive while it is used: freed, their memory
    could come back in the learner's ``torch.empty`` with those values still in it, and be taken for a copy."""

    def __init__(self, tensors: list[torch.Tensor], points: int = 8) -> None:
        self.tensors = [t.detach() for t in tensors]
        self._flat = [t.reshape(-1) for t in self.tensors]  # a copy where t is not contiguous: kept too
        picks = [f[torch.linspace(0, f.numel() - 1, min(points, f.numel())).long()] for f in self._flat]
        self._picks = picks
        self.sizes = np.array([p.numel() for p in picks])
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.intp)
        self.flat = torch.cat(picks) if picks else torch.empty(0)
        self._as: dict[torch.dtype, tuple[torch.Tensor, np.ndarray]] = {}

    def shares(self, values: dict[torch.dtype, torch.Tensor]) -> np.ndarray:
        best = np.zeros(len(self.sizes))
        if not self.flat.numel():
            return best
        for dtype, held in values.items():
            known = np.sort(held.double().numpy())
            if not known.size:
                continue
            if dtype not in self._as:  # each tensor rounded to the dtype it is looked for in, as a copy in it would be
                rounded = self.flat.to(dtype)
                self._as[dtype] = (rounded, rounded.double().numpy())
            wanted = self._as[dtype][1]
            present = known[np.minimum(np.searchsorted(known, wanted), known.size - 1)] == wanted
            best = np.maximum(best, np.add.reduceat(present, self.starts) / np.maximum(self.sizes, 1))
        return best


@contextlib.contextmanager
def tensors_made() -> Iterator[Callable[[frozenset[int]], list[torch.Tensor]]]:
    """Inside ``with tensors_made() as made:``, ``made(skip)`` lists every tensor created since the block began that
    is still alive, wherever it is held (a module attribute of torch's, a class, a builtin), but those whose id is
    in ``skip``. Everything older is frozen out of the garbage collector's view (``gc.freeze``), so the scan sees
    only what is new: quick in a process of half a million objects. A reference cycle among the new objects is
    collected first (only a collection frees one)."""

    def made(skip: frozenset[int] = frozenset()) -> list[torch.Tensor]:
        found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in skip]
        if found:
            gc.collect()  # what only a cycle holds goes now; the frozen old objects are not examined
            found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and id(o) not in skip]
        return found

    gc.freeze()
    try:
        yield made
    finally:
        gc.unfreeze()


# -- while the learner's code runs -----------------------------------------------------------------------------
class HeldWatch:
    """While inside ``with HeldWatch(probe, fn):``, ``probe(found, moment)`` runs at every line of the learner's
    code (``fn``'s and any other outside the libraries) and as each of its functions returns, with every tensor
    it holds then (``found``) and when that was (``moment``: "at line 12 of my_fn", "as my_fn returned"): the
    tensors reachable from its running frames' local variables, from the globals and closure cells ``fn`` uses,
    and from what those refer to (``reachable_tensors``).

    Lines are the finest moments Python offers: the line that issues a transfer and the one after it returns,
    the one after a wait. It traces only the learner's frames (``is_learner_code``); torch's run untraced.
    A probe that raises ends the tracing, and the error is raised again when the block ends.

    Inside, ``torch.empty`` and its kin fill what they return with NaN (torch's deterministic mode, warnings
    only): the allocator hands back freed memory as it was, so a buffer not yet written would otherwise show
    the values of whatever was freed before -- a block the learner let go, taken for one it still holds.
    """

    def __init__(self, probe: Callable[[list[Found], str], None], fn: Any) -> None:
        self.probe, self.roots = probe, {"fn": fn}
        count_as_learner(fn)
        self._base: types.FrameType | None = None
        self._previous: Any = None
        self._determinism: tuple[bool, bool, bool] = (False, False, True)
        self._error: BaseException | None = None

    def __enter__(self) -> HeldWatch:
        self._base = sys._getframe(1)
        self._previous = sys.gettrace()
        self._determinism = (torch.are_deterministic_algorithms_enabled(),
                             torch.is_deterministic_algorithms_warn_only_enabled(),
                             torch.utils.deterministic.fill_uninitialized_memory)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
        sys.settrace(self._on_call)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.settrace(self._previous)
        enabled, warn_only, fill = self._determinism
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
        self._base = None
        if self._error is not None and exc[0] is None:
            raise RuntimeError(f"the held-tensor probe failed: {self._error!r}") from self._error

    def _on_call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event == "call" and self._error is None and is_learner_code(frame.f_code):
            return self._on_line
        return None

    def _on_line(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if self._error is not None:
            return None
        if event in ("line", "return"):
            name = frame.f_code.co_name
            moment = f"at line {frame.f_lineno} of {name}" if event == "line" else f"as {name} returned"
            try:
                self.probe(reachable_tensors({**self._frame_roots(frame), **self.roots}, limit=5000), moment)
            except Exception as err:  # noqa: BLE001 - kept, and raised when the watch ends
                self._error = err
                return None
        return self._on_line

    def _frame_roots(self, frame: types.FrameType) -> dict[str, Any]:
        """The learner's frames on the stack, from ``frame`` out to the one that opened the watch."""
        roots: dict[str, Any] = {}
        current: types.FrameType | None = frame
        for _ in range(200):
            if current is None or current is self._base:
                break
            if is_learner_code(current.f_code):
                roots.update(frame_links(current))
            current = current.f_back
        return roots
