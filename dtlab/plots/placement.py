"""Who holds what: a tensor's placements on a 1-D or 2-D device mesh, drawn as the slices each rank keeps;
a 3-D mesh (the ``nd`` tier's pp x dp x tp) as one 2-D dp x tp mesh per pipeline stage.

A placement is written as ``DTensor`` prints it: ``S(d)`` (``Shard(d)``: each rank along that mesh
dimension holds a slice of tensor dimension d), ``R`` (``Replicate()``: each holds all of it),
``_S(d, k)`` (a strided shard, as FSDP2 writes its cut of a tensor-parallel slice) and ``whole``
(an ordinary tensor, kept in full by every rank). Slices follow ``torch.chunk``, as DTensor does:
ceil(size / n) per rank, so the last ranks may hold less. Ranks fill the mesh row by row
(rank = row index * columns + column index), as ``init_device_mesh`` numbers them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlab.plots.style import TIER_PALETTE, WIDTH

__all__ = ["RANK_COLORS", "SHARED_COLOR", "chunk_slice", "draw_matrix", "draw_mesh", "draw_placement", "held_slices",
           "shard_dim", "stage_placements", "weight_placements"]

RANK_COLORS = TIER_PALETTE  # rank r in RANK_COLORS[r % 8]
SHARED_COLOR = "0.75"  # a part that several ranks hold: grey, with the ranks written on it
SHARED_LABEL = "same part on several ranks"

Slice = tuple[tuple[int, ...], tuple[int, ...]]  # (start, size) per tensor dimension

_SHARD = re.compile(r"^_?S(?:hard)?\((-?\d+)")
_WHOLE = {"R", "Replicate()", "whole"}


def shard_dim(placement: str, ndim: int) -> int | None:
    """The tensor dimension that ``placement`` splits (``S(d)``, ``_S(d, k)``, ``Shard(d)``); None if it keeps
    the tensor whole (``R``, ``Replicate()``, ``whole``). ``ndim``: the tensor's number of dimensions."""
    found = _SHARD.match(placement)
    if found is None:
        if placement in _WHOLE:
            return None
        raise ValueError(f"unknown placement {placement!r}: expected S(d), _S(d, k), R or whole")
    dim = int(found[1])
    if not -ndim <= dim < ndim:
        raise ValueError(f"placement {placement!r} shards dimension {dim}, but the tensor has {ndim} "
                         f"dimension{'s' if ndim != 1 else ''}")
    return dim % ndim


def chunk_slice(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of ``torch.chunk``'s piece ``index`` of ``n`` elements cut in ``parts``."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"chunk_slice: piece {index} of {parts} does not exist")
    size = -(-n // parts)
    start = min(index * size, n)
    return start, min(size, n - start)


def _mesh(mesh_shape: Sequence[int]) -> tuple[int, ...]:
    mesh = tuple(int(m) for m in mesh_shape)
    if not 1 <= len(mesh) <= 2 or any(m < 1 for m in mesh):
        raise ValueError(f"mesh shape {mesh}: expected one or two dimensions of at least 1 rank")
    return mesh


def held_slices(shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
                local_shapes: Sequence[Sequence[int]] | None = None) -> list[Slice]:
    """Per rank, the (start, size) of the part of a tensor of ``shape`` that it holds.

    ``placements``: one per mesh dimension, outermost first; fewer leave the remaining (inner) mesh dimensions
    replicated, as a tensor that FSDP2 shards over the ``dp`` rows of a 2-D mesh and TP left whole reports
    only its ``dp`` placement. A strided shard ``_S(d, k)`` cuts the slice the other placements give (FSDP2
    shards a TP slice again), so it is applied last. ``local_shapes``: the shapes the ranks reported; a rank
    whose shape disagrees with the placements raises ValueError.
    """
    mesh, shape = _mesh(mesh_shape), [int(s) for s in shape]
    if len(placements) > len(mesh):
        raise ValueError(f"{len(placements)} placements {list(placements)} for a {len(mesh)}-D mesh {mesh}: "
                         "give at most one per mesh dimension")
    placements = [*placements, *["R"] * (len(mesh) - len(placements))]
    dims = [shard_dim(p, len(shape)) for p in placements]
    order = sorted(range(len(mesh)), key=lambda i: placements[i].startswith("_"))
    out = []
    for rank in range(math.prod(mesh)):
        coords = np.unravel_index(rank, mesh)
        start, size = [0] * len(shape), list(shape)
        for i in order:
            if dims[i] is not None:
                offset, size[dims[i]] = chunk_slice(size[dims[i]], mesh[i], int(coords[i]))
                start[dims[i]] += offset
        out.append((tuple(start), tuple(size)))
    if local_shapes is not None:
        _check_local(out, local_shapes, placements, mesh)
    return out


def _check_local(slices: list[Slice], local_shapes: Sequence[Sequence[int]], placements: list[str],
                 mesh: tuple[int, ...]) -> None:
    if len(local_shapes) != len(slices):
        raise ValueError(f"{len(local_shapes)} local shapes for a mesh {mesh} of {len(slices)} ranks")
    for rank, ((_, size), local) in enumerate(zip(slices, local_shapes)):
        if tuple(int(s) for s in local) != size:
            raise ValueError(f"rank {rank} reports a local shape {list(local)}, but {placements} on the mesh "
                             f"{mesh} give it {list(size)}")


def _as_matrix(values: Sequence[int], fill: int = 1) -> tuple[int, int]:
    # a vector is drawn as one row: its size is (1, n), its start (0, i)
    return (int(values[0]), int(values[1])) if len(values) == 2 else (fill, int(values[0]))


def _holders(slices: Sequence[Slice]) -> dict[Slice, list[int]]:
    """The ranks that hold each distinct slice; empty slices (a rank left nothing by torch.chunk) dropped."""
    same: dict[Slice, list[int]] = {}
    for rank, piece in enumerate(slices):
        if all(piece[1]):
            same.setdefault(piece, []).append(rank)
    return same


def draw_matrix(ax: Axes, shape: Sequence[int], slices: Sequence[Slice], title: str | None = None,
                colors: Sequence[str] = RANK_COLORS, ranks: Sequence[int] | None = None) -> Axes:
    """Draw a vector or matrix of ``shape`` with the slice each rank holds (``slices[rank]`` = (start, size)).

    Rows run top to bottom (dim 0), columns left to right (dim 1); a vector is one row, drawn thicker to be
    seen. A slice held by one rank has that rank's colour, one held by several is grey; each is labelled
    with its rank numbers: ``ranks[i]`` for ``slices[i]`` (default: i; a sub-mesh's global ranks).
    """
    if len(shape) not in (1, 2):
        raise ValueError(f"draw_matrix: a vector or a matrix, not a tensor of shape {list(shape)}")
    rows, cols = _as_matrix(shape)
    tall = 1 if len(shape) == 2 else max(1, cols // 6)
    for piece, held in _holders(slices).items():
        who = held if ranks is None else [ranks[i] for i in held]
        (r0, c0), (nr, nc) = _as_matrix(piece[0], fill=0), _as_matrix(piece[1])
        one = len(who) == 1
        color = colors[who[0] % len(colors)] if one else SHARED_COLOR
        ax.add_patch(Rectangle((c0, r0 * tall), nc, nr * tall, facecolor=color, edgecolor="white", linewidth=1.2,
                               label=f"rank {who[0]}" if one else SHARED_LABEL))
        ax.text(c0 + nc / 2, (r0 + nr / 2) * tall, ",".join(map(str, who)), ha="center", va="center",
                fontsize=7, color="white" if one else "black", clip_on=True)
    ax.add_patch(Rectangle((0, 0), cols, rows * tall, fill=False, edgecolor="black", linewidth=0.8))
    ax.set_xlim(-0.5, cols + 0.5)
    ax.set_ylim(rows * tall + 0.5, -0.5)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"dim {len(shape) - 1} ({cols})", fontsize=7, labelpad=1)
    if len(shape) == 2:
        ax.set_ylabel(f"dim 0 ({rows})", fontsize=7, labelpad=1)
    if title:
        ax.set_title(title, fontsize=8)
    return ax


def draw_placement(ax: Axes, shape: Sequence[int], placements: Sequence[str], mesh_shape: Sequence[int],
                   title: str | None = None, local_shapes: Sequence[Sequence[int]] | None = None,
                   ranks: Sequence[int] | None = None) -> Axes:
    """Draw which rank of a mesh of ``mesh_shape`` holds which part of a tensor of ``shape`` placed by
    ``placements`` (see ``held_slices``); the title defaults to the shape and the placements. ``ranks``:
    the global rank at each mesh position (default: the position)."""
    slices = held_slices(shape, placements, mesh_shape, local_shapes)
    if title is None:
        title = f"{'x'.join(map(str, shape))} {', '.join(placements)}"
    return draw_matrix(ax, shape, slices, title, ranks=ranks)


def draw_mesh(ax: Axes, mesh_shape: Sequence[int], dim_names: Sequence[str] = ("dp", "tp"),
              title: str | None = None, colors: Sequence[str] = RANK_COLORS,
              ranks: Sequence[int] | None = None) -> Axes:
    """Draw a 1-D or 2-D device mesh: one square per rank, with its rank and its index on each mesh dimension.

    ``dim_names``: one per mesh dimension, outermost first (a 1-D mesh is one row). ``ranks``: the global
    rank at each position (default: the position; a pipeline stage's mesh starts further on).
    """
    mesh = _mesh(mesh_shape)
    if len(dim_names) != len(mesh):
        raise ValueError(f"draw_mesh: {len(dim_names)} names {list(dim_names)} for a {len(mesh)}-D mesh {mesh}")
    rows, cols = (1, *mesh)[-2:]
    for index in range(math.prod(mesh)):
        i, j = divmod(index, cols)
        rank = index if ranks is None else ranks[index]
        where = "\n".join(f"{n} {c}" for n, c in zip(dim_names, np.unravel_index(index, mesh)))
        ax.add_patch(Rectangle((j + 0.08, i + 0.08), 0.84, 0.84, facecolor=colors[rank % len(colors)], alpha=0.8))
        ax.text(j + 0.5, i + 0.5, f"rank {rank}\n{where}", ha="center", va="center", fontsize=7, color="white")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_aspect("equal")
    ax.set_xticks([j + 0.5 for j in range(cols)], [str(j) for j in range(cols)])
    ax.set_yticks([i + 0.5 for i in range(rows)], [str(i) for i in range(rows)] if len(mesh) == 2 else [""])
    ax.tick_params(labelsize=8)
    ax.set_xlabel(f"{dim_names[-1]} index", fontsize=8)
    if len(mesh) == 2:
        ax.set_ylabel(f"{dim_names[0]} index", fontsize=8)
        default = f"mesh {rows} x {cols}: each row a {dim_names[1]} group,\neach column a {dim_names[0]} group"
    else:
        default = f"mesh of {cols} ranks: one {dim_names[0]} group"
    ax.set_title(default if title is None else title, fontsize=8)
    return ax


def _panels(fig: Figure, count: int, ncols: int, ratios: list[float], mesh_first: bool) -> list[Axes]:
    """A grid of ``count`` panels, ``ncols`` wide, row heights by ``ratios``; spare cells removed."""
    nrows = len(ratios)
    widths = [1.4, *[1.0] * (ncols - 1)] if mesh_first else [1.0] * ncols
    axes = fig.subplots(nrows, ncols, squeeze=False, gridspec_kw={"height_ratios": ratios, "width_ratios": widths})
    for ax in axes.flat[count:]:
        ax.remove()
    return list(axes.flat[:count])


def _row_ratios(shapes: list[Sequence[int] | None], ncols: int) -> list[float]:
    # a row of panels is as tall as its tallest drawing (height over width), within 0.6 to 1.6 of its width
    aspect = [1.0 if s is None else _as_matrix(s)[0] / _as_matrix(s)[1] for s in shapes]
    return [min(1.6, max(0.6, *aspect[i:i + ncols])) for i in range(0, len(aspect), ncols)]


def _legend(fig: Figure) -> None:
    # one entry per rank, then the shared grey, whatever panel each first appears in
    handles = {p.get_label(): p for ax in fig.axes for p in ax.patches if p.get_label().startswith(("rank", "same"))}
    keys = sorted(handles, key=lambda k: (k == SHARED_LABEL, int(k.split()[1]) if k != SHARED_LABEL else 0))
    fig.legend([handles[k] for k in keys], keys, loc="outside lower center", ncol=min(len(keys), 5), frameon=False,
               fontsize=8)


def weight_placements(shards: Sequence[Mapping[str, Mapping[str, Any]]], names: Sequence[str],
                      mesh_shape: Sequence[int] | None = None, mesh_dim_names: Sequence[str] = ("dp", "tp"),
                      title: str | None = None, strip: str = "", ncols: int = 5) -> Figure:
    """Which rank holds which part of each named parameter, from the placements the ranks report.

    ``shards[rank]``: that rank's ``{name: {"placements": [...], "global_shape": [...], "local_shape": [...]}}``
    (the ``tp`` and ``fsdp-tp`` tiers report it as ``strategy["shards"]``); each slice drawn is checked
    against the reported local shape. ``mesh_shape``: defaults to 1-D over all ranks; a 2-D mesh is drawn
    first, with ``mesh_dim_names``. ``strip``: a prefix left out of the panel titles.
    """
    mesh = _mesh(mesh_shape if mesh_shape is not None else (len(shards),))
    if math.prod(mesh) != len(shards):
        raise ValueError(f"mesh shape {mesh} has {math.prod(mesh)} ranks, but {len(shards)} reported placements")
    missing = [n for n in names if any(n not in table for table in shards)]
    if missing or not names:
        raise ValueError(f"weight_placements: no placements reported for {missing or 'any name'}")
    first = len(mesh) == 2
    entries = [shards[0][n] for n in names]
    ncols = max(1, min(ncols, len(names) + first))
    fig = Figure(figsize=(WIDTH, 1.0), layout="constrained")
    ratios = _row_ratios([None] * first + [e["global_shape"] for e in entries], ncols)
    fig.set_figheight(1.0 + 1.45 * sum(ratios))  # room for titles and the legend, then the drawings
    axes = _panels(fig, len(names) + first, ncols, ratios, first)
    if first:
        draw_mesh(axes.pop(0), mesh, mesh_dim_names)
    for ax, name, entry in zip(axes, names, entries):
        shape = entry["global_shape"]
        label = f"{name.removeprefix(strip)}\n{'x'.join(map(str, shape))} {', '.join(entry['placements'])}"
        draw_placement(ax, shape, entry["placements"], mesh, label, [t[name]["local_shape"] for t in shards])
    _legend(fig)
    fig.suptitle(title or f"{len(shards)} ranks: who holds which part of each parameter "
                 "(rows = dim 0, columns = dim 1)", fontsize=9)
    return fig


def stage_placements(shards: Sequence[Mapping[str, Mapping[str, Any]]], names: Sequence[str],
                     mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] = ("pp", "dp", "tp"),
                     title: str | None = None, ncols: int = 4) -> Figure:
    """A 3-D mesh (pp x dp x tp, the ``nd`` tier's) as one row per pipeline stage: the stage's dp x tp mesh of
    global ranks, then which of its ranks holds which part of each of ``names`` that the stage holds.

    ``shards[rank]``: that rank's ``strategy["shards"]`` (its own stage's parameters), checked as in
    ``weight_placements``; rank = (stage * dp + row) * tp + column.
    """
    if len(mesh_shape) != 3 or len(mesh_dim_names) != 3:
        raise ValueError(f"stage_placements: a 3-D mesh (pp, dp, tp) and its 3 names, not {list(mesh_shape)} "
                         f"named {list(mesh_dim_names)}")
    pp, grid = int(mesh_shape[0]), _mesh(mesh_shape[1:])
    per = math.prod(grid)
    if pp * per != len(shards):
        raise ValueError(f"mesh shape {tuple(mesh_shape)} has {pp * per} ranks, but {len(shards)} reported placements")
    stages = [(list(range(s * per, (s + 1) * per)), [n for n in names if n in shards[s * per]]) for s in range(pp)]
    missing = [n for n in names if not any(n in held for _, held in stages)]
    if missing or not names:
        raise ValueError(f"stage_placements: no stage reports placements for {missing or 'any name'}")
    width = min(ncols, max(len(held) for _, held in stages)) + 1
    fig = Figure(figsize=(WIDTH, 1.0 + 1.7 * pp), layout="constrained")
    axes = fig.subplots(pp, width, squeeze=False, gridspec_kw={"width_ratios": [1.4, *[1.0] * (width - 1)]})
    for s, (ranks, held) in enumerate(stages):
        draw_mesh(axes[s][0], grid, mesh_dim_names[1:], f"{mesh_dim_names[0]} {s}: ranks {ranks[0]}-{ranks[-1]}",
                  ranks=ranks)
        for ax, name in zip(axes[s][1:], held[:width - 1]):
            entry = shards[ranks[0]][name]
            label = f"{name}\n{'x'.join(map(str, entry['global_shape']))} {', '.join(entry['placements'])}"
            draw_placement(ax, entry["global_shape"], entry["placements"], grid, label,
                           [shards[r][name]["local_shape"] for r in ranks], ranks=ranks)
        for ax in axes[s][1 + len(held):]:
            ax.remove()
    _legend(fig)
    fig.suptitle(title or f"{len(shards)} ranks on a {' x '.join(map(str, mesh_shape))} mesh "
                 f"({' x '.join(mesh_dim_names)}): each stage's parameters and who holds which part", fontsize=9)
    return fig
