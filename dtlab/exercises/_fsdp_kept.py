"""fsdp_unit's state check: what of the whole parameter (or gradient) a rank still holds after a step, and a
collective that failed for want of padding.

By storage and by values, never by object: ``full.detach()``, ``full.data`` and views are other objects over
full's storage; a clone is other storage of the same size; a ``.half()`` copy, or the other ranks' part kept
in pieces, is smaller but holds their values all the same. An FSDP unit keeps only its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from dtlab.exercises._check import recorder_now, torch_call
from dtlab.exercises._reach import (
    Fingerprints,
    Found,
    held_values,
    places,
    reachable_tensors,
    storage_bytes,
    storage_key,
)
from dtlab.exercises._weigh import settled

GATHERS = frozenset({"all_gather", "all_gather_into_tensor"})
SCATTERS = frozenset({"reduce_scatter", "reduce_scatter_tensor"})
LOOSE = "a tensor alive outside the unit and what fn refers to (e.g. another module's attribute)"
_WHAT = {"param": "the whole flat parameter", "grad": "the whole flat gradient"}


class Seen:
    """What the checker notes in one step: when forward ran and its gradient arrived, and the whole parameter and
    gradient (copies of their first ``numel`` values, and their storages), to name what a rank kept. The walk
    that looks for kept tensors skips this object: these copies are the checker's."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.forwards: list[float] = []
        self.grad_at: float | None = None
        self.copies: dict[str, torch.Tensor] = {}  # "param", "grad": the values of this step's
        self.storages: dict[int, str] = {}  # storage key: "param" or "grad"

    def forward(self, full: torch.Tensor) -> None:
        self.forwards.append(recorder_now())
        self.copies["param"] = full.detach()[:self.numel].clone()
        self.storages[storage_key(full)] = "param"

    def gradient(self, grad: torch.Tensor) -> None:
        self.grad_at = recorder_now()
        self.copies["grad"] = grad.detach()[:self.numel].clone()
        self.storages[storage_key(grad)] = "grad"


def kept_whole(unit: Any, fn: Any, made: Callable[[frozenset[int]], list[torch.Tensor]], rank: int,
               n: int) -> tuple[tuple[str, str, int], ...]:
    """What a step left alive of the whole parameter or gradient: (where, what it is, its bytes), each storage once.

    Kept is a storage of the whole parameter's bytes or more, or the values of another rank's part of the
    parameter or gradient in whatever is left. First in what the learner's code can reach -- ``unit`` (its
    ``_seen``, a ``Seen``, is the checker's), the globals and closure cells fn uses, and through them lists,
    dicts, objects and autograd graphs -- then in any tensor made since the first step and still alive anywhere
    (``made``, from ``tensors_made``: a module attribute of torch's, say)."""
    seen = unit._seen
    mine = {storage_key(t) for t in seen.copies.values()}
    whole = 4 * seen.numel
    size = unit.padded_numel // n
    parts = [(f"rank {s}'s part of {_WHAT[kind]}", copy[s * size:(s + 1) * size])
             for kind, copy in seen.copies.items() for s in range(n) if s != rank and s * size < seen.numel]

    def kept_loose() -> tuple[tuple[str, str, int], ...]:
        # views of the checker's copies (``parts``) share their storages, so they are left out with them
        loose = [Found(LOOSE, t) for t in made(frozenset()) if storage_key(t) not in mine]
        return _kept(loose, whole, parts, seen)

    reach = reachable_tensors({"unit": unit, "fn": fn}, skip=frozenset({id(seen)}))
    return _kept(reach, whole, parts, seen) or settled(kept_loose, bool)


def _kept(found: list[Found], whole: int, parts: list[tuple[str, torch.Tensor]],
          seen: Seen) -> tuple[tuple[str, str, int], ...]:
    out, storages = [], set()
    for f in found:
        if storage_bytes(f.tensor) >= whole and storage_key(f.tensor) not in storages:
            storages.add(storage_key(f.tensor))
            out.append((f.where, _what(f.tensor, seen), storage_bytes(f.tensor)))
    if out or not parts:
        return tuple(out)
    prints = Fingerprints([t for _, t in parts])
    shares = prints.shares(held_values(found))  # together: a part kept in pieces is kept
    for i, (label, _) in enumerate(parts):
        if shares[i] > 0.99:
            holding = [f for f in found if prints.shares(held_values([f]))[i] > 0]
            nbytes = sum(storage_bytes(f.tensor) for f in holding)
            return ((places([f.where for f in holding], 3), f"the values of {label} (a copy)", nbytes),)
    return ()


def _what(t: torch.Tensor, seen: Seen) -> str:
    kind = seen.storages.get(storage_key(t))
    if kind is not None:
        return f"{_WHAT[kind]} (a tensor over the storage of {'full' if kind == 'param' else 'full.grad'} itself)"
    names = list(seen.copies)
    shares = Fingerprints([seen.copies[k] for k in names]).shares(held_values([Found("", t)])) if names else []
    copied = [k for k, share in zip(names, shares) if share > 0.99]
    if copied:
        return f"a copy of {_WHAT[copied[0]]}"
    return "a tensor of the whole parameter's size"


def padding_problem(exc: BaseException, unit: Any, rank: int, n: int, step: int) -> str | None:
    """When a gather or reduce-scatter failed on sizes that are not n shards of the padded parameter: say so."""
    call = torch_call(exc)
    if call is None or call[0] not in GATHERS | SCATTERS:
        return None
    op, args = call
    gather = op in GATHERS
    names = ("output_tensor", "tensor_list", "input_tensor", "tensor") if gather else ("input", "input_list",
                                                                                          "output", "output")
    whole, part = (next((args[k] for k in names[i:i + 2] if args.get(k) is not None), None) for i in (0, 2))
    whole_n, part_n = _numel(whole), _numel(part)
    if whole_n is None or part_n is None or whole_n == n * part_n == unit.padded_numel:
        return None
    what = "output (the whole parameter)" if gather else "input (the whole gradient)"
    return (f"rank {rank}'s {op} failed in step {step}: its {what} has {whole_n} elements where n × the shard's "
            f"{part_n} = {n * part_n} fit. The flat parameter is padded to a multiple of the world size: "
            f"unit.padded_numel = {unit.padded_numel} elements at n = {n}, not unit.numel = {unit.numel} -- gather "
            "into (and reduce-scatter from) a tensor of unit.padded_numel elements, each rank's shard "
            f"unit.padded_numel / n = {unit.padded_numel // n}.")


def _numel(t: Any) -> int | None:
    if isinstance(t, torch.Tensor):
        return t.numel()
    if isinstance(t, list | tuple) and all(isinstance(x, torch.Tensor) for x in t):
        return sum(x.numel() for x in t)
    return None
