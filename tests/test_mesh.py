"""The one mesh value: a layout's grid is torch.arange(world).view(...), coordinates are read off it, and a bad
degree is named before any process starts."""

from __future__ import annotations

import pytest
import torch

from dtlab.core.mesh import Layout


def test_the_grid_is_arange_viewed_and_coordinates_are_read_off_it():
    layout = Layout.of(pp=2, dp=3, tp=2)
    assert layout.names == ("pp", "dp", "tp") and layout.shape == (2, 3, 2) and layout.world == 12
    assert torch.equal(layout.grid(), torch.arange(12).view(2, 3, 2))
    for rank in range(12):  # rank = (stage * dp + row) * tp + column, as init_device_mesh numbers them
        c = layout.coordinates(rank)
        assert (c["pp"] * 3 + c["dp"]) * 2 + c["tp"] == rank
    assert layout.coordinates(7) == {"pp": 1, "dp": 0, "tp": 1}
    with pytest.raises(ValueError, match="rank 12 is not on a mesh of 12 ranks"):
        layout.coordinates(12)


def test_a_bad_degree_or_a_product_off_the_world_is_named():
    with pytest.raises(ValueError, match=r"^nd tier_options\.tp=0 is invalid: must be an integer >= 1$"):
        Layout.of(pp=2, dp=1, tp=0).check(2, "nd tier_options")
    with pytest.raises(ValueError, match=r"tier_options\.dp=True is invalid"):
        Layout.of(dp=True, tp=2).check(2, "x tier_options")
    with pytest.raises(ValueError, match=r"pp=2 x dp=1 x tp=2 = 4 ranks, but world_size=8: choose pp, dp and tp"):
        Layout.of(pp=2, dp=1, tp=2).check(8, "nd tier_options")
    Layout.of(pp=2, dp=2, tp=2).check(8, "nd tier_options")  # no error
