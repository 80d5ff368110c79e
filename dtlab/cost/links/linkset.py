"""One link per collective: on loopback gloo the collectives' costs differ too much for one alpha-beta pair."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from dtlab.cost.links.alpha_beta import LinkModel, calibrate, check_op

__all__ = ["LinkSet", "calibrate_ops"]


@dataclass(frozen=True)
class LinkSet:
    """One calibrated ``LinkModel`` per collective, for predicting a mix of them.

    On loopback gloo the ops' per-byte costs differ (reduction arithmetic, extra
    copies, reduce_scatter's whole all-reduce), so a step that runs several ops
    is predicted best with each op on a link fitted on that op's own sweep.
    ``predict(op, ...)`` uses ``links[op]`` and falls back to ``default`` for an
    op without one. ``busy_s`` is what a collective costs beyond its price between
    the compute of a step, for every op alike (``costmodel.calibrate_busy``).
    """

    links: dict[str, LinkModel]
    default: LinkModel
    busy_s: float = 0.0  # a collective's extra cost inside a busy step (``costmodel.calibrate_busy``)
    busy_short_s: float = float("nan")  # the same after little compute (``costmodel.busy_at``); NaN: not measured

    def __post_init__(self) -> None:
        for op in self.links:
            check_op(op)

    @property
    def label(self) -> str:
        return "; ".join(f"{op}: {m.bandwidth_gbps:.2g} GB/s, alpha {m.alpha_s * 1e6:.3g} us"
                         for op, m in self.links.items()) or self.default.label

    def predict(self, op: str, nbytes: Any, world_size: int | None = None) -> Any:
        return self.links.get(op, self.default).predict(op, nbytes, world_size)

    def describe(self) -> str:
        return "\n".join(m.describe() for m in self.links.values()) or self.default.describe()


def calibrate_ops(sweep_df: pd.DataFrame, ops: Sequence[str], *, default: str = "all_reduce",
                  **kwargs: Any) -> LinkSet:
    """A ``LinkSet``: each of ``ops`` calibrated on its own rows of the sweep (``calibrate``'s keywords apply);
    ``default`` (one of ``ops``) answers for any other op."""
    if default not in ops:
        raise ValueError(f"calibrate_ops: default={default!r} is not among ops {tuple(ops)}")
    label = kwargs.pop("label", "")
    links = {op: calibrate(sweep_df, op, label=f"{label} ({op})" if label else "", **kwargs) for op in ops}
    return LinkSet(links, links[default])
