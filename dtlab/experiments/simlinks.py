"""Runs on simulated hosts over capped, delayed links: the configs, and how a link is written.

Shared by the link sweep (``experiments.linksweep``) and the cost model's link
validation (``experiments.ddp_steps``); it imports neither, so the two
stay one-way (the sweep reads the cost model, the cost model reads this).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from dtlab.core.config import RunConfig
from dtlab.launch import netns
from dtlab.tiers import ddp, multinode

__all__ = ["link_configs", "link_label", "mbit_label"]


def link_configs(base: RunConfig, caps_mbit: Sequence[float], hooks: Sequence[str], *, nnodes: int = 2,
                 delays_ms: Sequence[float] = (0.0,)) -> list[RunConfig]:
    """The multinode configs of a sweep, link-major: every hook at each (cap, delay) (all validated here)."""
    if not caps_mbit or any(not c > 0 for c in caps_mbit):
        raise ValueError(f"caps_mbit={tuple(caps_mbit)!r} is invalid: give one or more link caps > 0 Mbit/s")
    if not delays_ms or any(not 0 <= d <= 1000 for d in delays_ms):
        raise ValueError(f"delays_ms={tuple(delays_ms)!r} is invalid: give one or more delays from 0 to 1000 ms")
    unknown = [h for h in hooks if h not in ddp.COMM_HOOKS]
    if not hooks or unknown:
        raise ValueError(f"hooks={tuple(hooks)!r} is invalid: choose from {', '.join(ddp.COMM_HOOKS)}")
    ok, reason = netns.available()
    if not ok:
        raise ValueError(f"the link sweep needs simulated hosts: {reason.split(':')[0]}")
    opts = base.tier_options if isinstance(base.tier_options, ddp.Options) else ddp.Options()
    ddp_fields = {f.name: getattr(opts, f.name) for f in dataclasses.fields(ddp.Options)}
    world = base.world_size if base.world_size % nnodes == 0 and base.world_size >= nnodes else nnodes
    return [base.replace(tier="multinode", world_size=world, tier_options=multinode.Options(
        **{**ddp_fields, "comm_hook": hook}, nnodes=nnodes, network="netns", link_mbit=float(cap),
        link_delay_ms=float(delay)))
        for cap in caps_mbit for delay in delays_ms for hook in hooks]


def mbit_label(mbit: float) -> str:
    """A link speed as people write it: 10 Gbit/s, 200 Mbit/s."""
    return f"{mbit / 1000:g} Gbit/s" if mbit >= 1000 else f"{mbit:g} Mbit/s"


def link_label(mbit: float, delay_ms: float = 0.0) -> str:
    """A link as people write it, its one-way delay added when there is one: 200 Mbit/s + 2 ms."""
    return mbit_label(mbit) + (f" + {delay_ms:g} ms" if delay_ms else "")
