"""Placement drawings: the slices each rank holds, checked against torch.chunk, and the figures that draw them."""

from __future__ import annotations

import math

import pytest
import torch
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from dtlab import plots
from dtlab.plots.placement import SHARED_COLOR, chunk_slice, shard_dim

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def reported(specs: dict[str, tuple[list[int], list[str]]], mesh: tuple[int, ...]) -> list[dict]:
    """Per rank, a shard table like the tp tiers' ``strategy["shards"]``, local shapes from ``held_slices``."""
    out: list[dict] = [{} for _ in range(math.prod(mesh))]
    for name, (shape, placements) in specs.items():
        for rank, (_, size) in enumerate(plots.held_slices(shape, placements, mesh)):
            out[rank][name] = {"placements": placements, "global_shape": shape, "local_shape": list(size)}
    return out


def pieces(ax) -> list[Rectangle]:
    # the filled rectangles: one per distinct slice (the outline is drawn unfilled)
    return [p for p in ax.patches if p.get_fill()]


def texts(ax) -> list[str]:
    return [t.get_text() for t in ax.texts]


def new_ax():
    return Figure().subplots()


# -- the slices ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, parts", [(53, 2), (64, 4), (3, 4), (10, 3)])
def test_chunk_slice_is_torch_chunk(n, parts):
    got = [chunk_slice(n, parts, i) for i in range(parts)]
    sizes = [len(c) for c in torch.arange(n).chunk(parts)]
    assert [size for _, size in got] == sizes + [0] * (parts - len(sizes))
    assert [start for start, size in got if size] == [int(c[0]) for c in torch.arange(n).chunk(parts)]


def test_shard_dim_reads_dtensor_placements():
    assert shard_dim("S(0)", 2) == 0
    assert shard_dim("S(-1)", 2) == 1
    assert shard_dim("_S(0, 2)", 2) == 0
    assert shard_dim("Shard(1)", 2) == 1
    assert shard_dim("R", 2) is None and shard_dim("whole", 1) is None


def test_held_slices_1d():
    assert plots.held_slices([53, 64], ["S(0)"], (2,)) == [((0, 0), (27, 64)), ((27, 0), (26, 64))]
    assert plots.held_slices([64, 256], ["S(1)"], (2,)) == [((0, 0), (64, 128)), ((0, 128), (64, 128))]
    assert plots.held_slices([64], ["R"], (2,)) == [((0,), (64,))] * 2


def test_held_slices_2d_strided_cuts_the_tp_slice():
    # FSDP2's _S(0, 2) over dp cuts each tp rank's rows again: tp first, then dp
    got = plots.held_slices([64, 64], ["_S(0, 2)", "S(0)"], (2, 2))
    assert [start[0] for start, _ in got] == [0, 32, 16, 48]  # ranks 0..3 = (dp, tp) (0,0) (0,1) (1,0) (1,1)
    plain = plots.held_slices([64, 64], ["S(0)", "S(0)"], (2, 2))
    assert [start[0] for start, _ in plain] == [0, 16, 32, 48]


def test_held_slices_fewer_placements_replicate_the_inner_mesh_dims():
    got = plots.held_slices([32, 64], ["S(0)"], (2, 2))
    assert got == [((0, 0), (16, 64))] * 2 + [((16, 0), (16, 64))] * 2


@pytest.mark.parametrize("shape, placements, mesh, match", [
    ([64, 64], ["S(2)"], (2,), "shards dimension 2, but the tensor has 2 dimensions"),
    ([64], ["S(1)"], (2,), "tensor has 1 dimension"),
    ([64, 64], ["S(0)", "S(1)"], (4,), "2 placements .* for a 1-D mesh"),
    ([64, 64], ["Partial"], (2,), "unknown placement"),
    ([64, 64], ["S(0)"], (2, 2, 2), "one or two dimensions"),
    ([64, 64], ["S(0)"], (0,), "one or two dimensions"),
])
def test_held_slices_rejects_bad_input(shape, placements, mesh, match):
    with pytest.raises(ValueError, match=match):
        plots.held_slices(shape, placements, mesh)


def test_held_slices_checks_the_reported_local_shapes():
    plots.held_slices([53, 64], ["S(0)"], (2,), local_shapes=[[27, 64], [26, 64]])
    with pytest.raises(ValueError, match="rank 1 reports a local shape \\[27, 64\\]"):
        plots.held_slices([53, 64], ["S(0)"], (2,), local_shapes=[[27, 64], [27, 64]])
    with pytest.raises(ValueError, match="3 local shapes for a mesh \\(2,\\) of 2 ranks"):
        plots.held_slices([53, 64], ["S(0)"], (2,), local_shapes=[[27, 64]] * 3)


# -- the axes -----------------------------------------------------------------------------------------
def test_draw_placement_shard0_on_2x2_labels_four_blocks_by_rank():
    ax = plots.draw_placement(new_ax(), [64, 64], ["S(0)", "S(1)"], (2, 2))
    assert len(pieces(ax)) == 4
    assert sorted(texts(ax)) == ["0", "1", "2", "3"]
    assert sorted(p.get_label() for p in pieces(ax)) == ["rank 0", "rank 1", "rank 2", "rank 3"]
    # rank 1 = (dp 0, tp 1): the top rows, the right columns
    rank1 = next(p for p in pieces(ax) if p.get_label() == "rank 1")
    assert (rank1.get_x(), rank1.get_y(), rank1.get_width(), rank1.get_height()) == (32, 0, 32, 32)
    assert ax.get_title() == "64x64 S(0), S(1)"
    assert ax.get_xlabel() == "dim 1 (64)" and ax.get_ylabel() == "dim 0 (64)"


def test_draw_placement_replicate_shows_every_rank_on_the_whole_matrix():
    ax = plots.draw_placement(new_ax(), [32, 64], ["R", "R"], (2, 2), title="pos")
    (whole,) = pieces(ax)
    assert (whole.get_width(), whole.get_height()) == (64, 32)
    assert whole.get_facecolor()[:3] == pytest.approx((0.75, 0.75, 0.75))
    assert texts(ax) == ["0,1,2,3"]
    assert ax.get_title() == "pos"


def test_draw_matrix_draws_a_vector_as_one_row():
    ax = plots.draw_matrix(new_ax(), [64], plots.held_slices([64], ["S(0)"], (2,)), "ln")
    assert [(p.get_x(), p.get_width()) for p in pieces(ax)] == [(0, 32), (32, 32)]
    assert {p.get_y() for p in pieces(ax)} == {0}
    assert ax.get_xlabel() == "dim 0 (64)" and ax.get_ylabel() == ""
    with pytest.raises(ValueError, match="a vector or a matrix"):
        plots.draw_matrix(new_ax(), [2, 3, 4], [((0, 0, 0), (2, 3, 4))])


def test_draw_matrix_skips_ranks_left_empty():
    ax = plots.draw_placement(new_ax(), [3, 8], ["S(0)"], (4,))
    assert sorted(texts(ax)) == ["0", "1", "2"]


def test_draw_mesh_numbers_the_ranks_row_by_row():
    ax = plots.draw_mesh(new_ax(), (2, 2), ("dp", "tp"))
    assert texts(ax) == [f"rank {r}\ndp {r // 2}\ntp {r % 2}" for r in range(4)]
    assert ax.get_xlabel() == "tp index" and ax.get_ylabel() == "dp index"
    assert "tp group" in ax.get_title()
    with pytest.raises(ValueError, match="1 names"):
        plots.draw_mesh(new_ax(), (2, 2), ("tp",))


# -- the figures --------------------------------------------------------------------------------------
TP = {"tok.weight": ([53, 64], ["S(0)"]), "pos.weight": ([32, 64], ["whole"]), "blocks.0.ln1.weight": ([64], ["whole"]),
      "blocks.0.attn.out.weight": ([64, 64], ["S(1)"]), "blocks.0.mlp.0.weight": ([256, 64], ["S(0)"]),
      "head.weight": ([53, 64], ["S(0)"])}
MESH = {"blocks.0.attn.q.weight": ([64, 64], ["_S(0, 2)", "S(0)"]),
        "blocks.0.attn.out.weight": ([64, 64], ["S(0)", "S(1)"]), "pos.weight": ([32, 64], ["S(0)"])}


def test_weight_placements_1d(tmp_path):
    fig = plots.weight_placements(reported(TP, (2,)), list(TP), strip="blocks.0.", ncols=3, title="tp, 2 ranks")
    assert isinstance(fig, Figure)
    assert len(fig.axes) == len(TP)
    assert [ax.get_title().split("\n")[0] for ax in fig.axes] == [n.removeprefix("blocks.0.") for n in TP]
    assert fig.axes[0].get_title() == "tok.weight\n53x64 S(0)"
    assert all(ax.get_xlabel().startswith("dim ") for ax in fig.axes)
    assert fig.get_suptitle() == "tp, 2 ranks"
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["rank 0", "rank 1", "same part on several ranks"]
    out = plots.save(fig, tmp_path / "tp.png")
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_weight_placements_2d_draws_the_mesh_first():
    fig = plots.weight_placements(reported(MESH, (2, 2)), list(MESH), mesh_shape=(2, 2), strip="blocks.0.")
    mesh_ax, q, out, pos = fig.axes
    assert len(mesh_ax.texts) == 4 and mesh_ax.get_xlabel() == "tp index"
    assert q.get_title() == "attn.q.weight\n64x64 _S(0, 2), S(0)"
    assert [t.get_text() for t in sorted(q.texts, key=lambda t: t.get_position()[1])] == ["0", "2", "1", "3"]  # rows
    assert sorted(texts(out)) == ["0", "1", "2", "3"]
    # pos: FSDP alone splits it, so a tp group (a mesh row) shares each half
    assert texts(pos) == ["0,1", "2,3"]
    assert all(p.get_facecolor()[:3] == pytest.approx((0.75,) * 3) for p in pieces(pos))
    assert SHARED_COLOR == "0.75"
    assert "4 ranks" in fig.get_suptitle()


@pytest.mark.parametrize("kwargs, match", [
    ({"mesh_shape": (2, 3)}, "mesh shape \\(2, 3\\) has 6 ranks, but 4 reported"),
    ({"mesh_shape": (4,), "names": ["nope"]}, "no placements reported for \\['nope'\\]"),
])
def test_weight_placements_rejects_a_mismatch(kwargs, match):
    args = {"names": list(MESH), **kwargs}
    with pytest.raises(ValueError, match=match):
        plots.weight_placements(reported(MESH, (2, 2)), **args)


def test_weight_placements_rejects_local_shapes_that_disagree():
    shards = reported(TP, (2,))
    shards[1]["tok.weight"]["local_shape"] = [27, 64]
    with pytest.raises(ValueError, match="rank 1 reports a local shape"):
        plots.weight_placements(shards, ["tok.weight"])


STAGES = [{"tok.weight": ([53, 64], ["S(0)", "S(0)"]), "blocks.0.attn.q.weight": ([64, 64], ["_S(0, 2)", "S(0)"])},
          {"blocks.1.attn.q.weight": ([64, 64], ["_S(0, 2)", "S(0)"]), "head.weight": ([53, 64], ["_S(0, 2)", "S(0)"]),
           "ln.weight": ([64], ["S(0)"])}]


def test_draw_mesh_and_matrix_name_a_sub_meshs_global_ranks():
    ax = plots.draw_mesh(new_ax(), (2, 2), ("dp", "tp"), ranks=[4, 5, 6, 7])
    assert texts(ax) == [f"rank {r}\ndp {(r - 4) // 2}\ntp {r % 2}" for r in range(4, 8)]
    ax = plots.draw_placement(new_ax(), [64, 64], ["S(0)", "S(1)"], (2, 2), ranks=[4, 5, 6, 7])
    assert sorted(texts(ax)) == ["4", "5", "6", "7"]
    assert sorted(p.get_label() for p in pieces(ax)) == ["rank 4", "rank 5", "rank 6", "rank 7"]


def test_stage_placements_draws_each_stage_as_its_own_2d_mesh(tmp_path):
    shards = [*reported(STAGES[0], (2, 2)), *reported(STAGES[1], (2, 2))]  # pp=2 x dp=2 x tp=2
    names = ["tok.weight", "blocks.0.attn.q.weight", "blocks.1.attn.q.weight", "head.weight", "ln.weight"]
    fig = plots.stage_placements(shards, names, (2, 2, 2))
    mesh0, tok, q0, mesh1, q1, head, ln = fig.axes  # stage 0 holds two of the names: its spare panel removed
    assert mesh0.get_title() == "pp 0: ranks 0-3" and mesh1.get_title() == "pp 1: ranks 4-7"
    assert texts(mesh1)[0] == "rank 4\ndp 0\ntp 0"
    assert tok.get_title() == "tok.weight\n53x64 S(0), S(0)"
    assert sorted(texts(q1)) == ["4", "5", "6", "7"] and sorted(texts(q0)) == ["0", "1", "2", "3"]
    assert texts(ln) == ["4,5", "6,7"]  # FSDP alone splits it: a tp row shares each half
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [*[f"rank {r}" for r in range(8)],
                                                          "same part on several ranks"]
    assert "2 x 2 x 2 mesh (pp x dp x tp)" in fig.get_suptitle()
    assert plots.save(fig, tmp_path / "nd.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize("mesh, names, match", [
    ((2, 2), ["ln.weight"], "a 3-D mesh"),
    ((2, 2, 1), ["ln.weight"], "has 4 ranks, but 8 reported"),
    ((2, 2, 2), ["nope"], "no stage reports placements for \\['nope'\\]"),
])
def test_stage_placements_rejects_a_mismatch(mesh, names, match):
    shards = [*reported(STAGES[0], (2, 2)), *reported(STAGES[1], (2, 2))]
    with pytest.raises(ValueError, match=match):
        plots.stage_placements(shards, names, mesh)


# -- the byte formulas set beside the placements (dtlab.read.tp) ---------------------
def test_sent_bytes_per_step_uses_the_ring_factors():
    import pandas as pd

    from dtlab.cost.tp import sent_bytes_per_step

    table = pd.DataFrame({"op": ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"],
                          "calls": [2, 1, 1], "bytes": [100, 100, 100]})
    assert sent_bytes_per_step(table, 2) == 2 * 100 * 1.0 + 100 * 0.5 + 100 * 0.5
    assert sent_bytes_per_step(table, 4) == 2 * 100 * 1.5 + 100 * 0.75 + 100 * 0.75


def test_bytes_by_formula_for_ddp_fsdp_and_tp():
    from dtlab import RunConfig
    from dtlab.core import models
    from dtlab.cost.tp import bytes_by_formula, textbook_collectives, tp_bytes_per_step

    cfg = RunConfig(tier="tp", world_size=2, model="charformer", dataset="text", model_size=64, model_depth=2,
                    global_batch_size=16)
    got = bytes_by_formula(cfg, vocab=53)
    p = sum(t.numel() * 4 for t in models.build("charformer", (32,), 53, 64, 2).parameters())
    assert got["ddp"] == (p, p)
    assert got["fsdp"] == (3 * p, p / 2)
    assert got["tp"][0] == tp_bytes_per_step(textbook_collectives(cfg, vocab=53))
    assert p / 2 < got["tp"][1] < 0.55 * p  # half, plus what stays whole (norms, pos, the row-split biases)
    with pytest.raises(ValueError, match="a tp job's config, not tier 'ddp'"):
        bytes_by_formula(cfg.replace(tier="ddp"), vocab=53)
