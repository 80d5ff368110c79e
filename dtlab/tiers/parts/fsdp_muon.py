"""Muon under FSDP2: each rank owns whole matrices, gathers their gradients, and sends back the orthogonalised rows.

FSDP2 leaves every rank holding rows of each gradient (dim-0 shards), but Muon's Newton–Schulz iteration needs
the whole matrix: orthogonalising each rank's rows alone would be another optimiser. So the matrices are dealt
out whole to owners (``assign_owners``: largest first, to the least loaded rank, as ZeRO deals out
parameters), and per step:

1. ``muon:gradients``: one ``all_to_all`` sends each rank's rows of every matrix to that matrix's owner;
2. the owner adds the whole gradient into the matrix's momentum (kept whole, on the owner only) and
   orthogonalises it;
3. ``muon:updates``: one ``all_to_all`` sends each owner's orthogonalised updates back, each rank receiving
   the rows it holds (the all-gather of the updates, cut to what each rank keeps: a rank needs only its rows);
4. every rank applies its rows. The other parameters (biases, norms) take AdamW on their shards, as before.

Nothing partial is orthogonalised, and every element gets the arithmetic it gets on one device.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from dtlab.core.config import RunConfig
from dtlab.core.muon import Muon, apply_matrix_update_, assign_owners, local, momentum_direction, newton_schulz
from dtlab.instrument.recorder import tagged

__all__ = ["LayerwiseMuon", "check", "rows_on"]


def check(cfg: RunConfig, name: str) -> None:
    """What Muon under fsdp does not do yet, named."""
    o = cfg.tier_options
    if o.replicate != 1:
        raise ValueError(f"{name}.replicate={o.replicate} is invalid with RunConfig.optimizer='muon': the "
                         "layer-wise Muon step shards over one group; use replicate=1")
    if o.checkpoint_dir or o.resume_from:
        raise ValueError(f"{name}.checkpoint_dir/resume_from are invalid with RunConfig.optimizer='muon': its "
                         "momentum lives whole on each matrix's owner, which DCP's optimizer state does not describe")


def rows_on(rows: int, world: int, rank: int) -> int:
    """Rows of a ``rows``-row matrix that FSDP2's dim-0 shard puts on ``rank`` (torch.chunk: the last may hold
    fewer, or none)."""
    chunk = math.ceil(rows / world)
    return max(0, min(chunk, rows - rank * chunk))


class LayerwiseMuon(Muon):
    """``Muon`` over FSDP2's DTensor shards: matrices orthogonalised whole by their owners."""

    def step_matrices(self, matrices: list[torch.Tensor], group: dict[str, Any]) -> None:
        if not matrices:
            return
        pg = matrices[0].device_mesh.get_group()
        world, me = dist.get_world_size(pg), dist.get_rank(pg)
        owners = assign_owners([p.numel() for p in matrices], world)
        width = [p.numel() // max(p.shape[0], 1) for p in matrices]  # elements per row

        def counts(owner_of: int, rank: int) -> int:  # elements of matrices owned by owner_of that rank holds
            return sum(rows_on(p.shape[0], world, rank) * w for p, w, o in zip(matrices, width, owners)
                       if o == owner_of)

        mine = [i for i, o in enumerate(owners) if o == me]
        # 1. my rows of each matrix to its owner (ordered by owner, then by matrix)
        sent = torch.cat([local(matrices[i].grad).reshape(-1) for o in range(world)
                          for i, owner in enumerate(owners) if owner == o])
        into = [counts(me, r) for r in range(world)]
        outof = [counts(o, me) for o in range(world)]
        if sent.numel() != sum(outof):
            raise RuntimeError(f"muon under fsdp: this rank holds {sent.numel()} gradient elements of the matrices, "
                               f"not the {sum(outof)} that dim-0 shards of torch.chunk would hold")
        got = sent.new_empty(sum(into))
        with tagged("muon:gradients"):
            dist.all_to_all_single(got, sent, into, outof, group=pg)
        # 2. whole gradients of my matrices: from each rank, its rows of each of mine in order
        pieces: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        offset = 0
        for r in range(world):
            for i in mine:
                n = rows_on(matrices[i].shape[0], world, r) * width[i]
                pieces[i].append(got[offset:offset + n])
                offset += n
        updates = {}
        for i in mine:
            p = matrices[i]
            whole = torch.cat(pieces[i]).view(p.shape)
            direction = momentum_direction(whole, self.state[p], group["momentum"], group["nesterov"])
            updates[i] = newton_schulz(direction, group["ns_steps"])
        # 3. each rank's rows of my updates back to it
        back = [updates[i][self._rows(matrices[i].shape[0], world, r)].reshape(-1) for r in range(world)
                for i in mine]
        returned = sent.new_empty(sent.numel())
        with tagged("muon:updates"):
            dist.all_to_all_single(returned, torch.cat(back) if back else sent.new_empty(0), outof, into, group=pg)
        # 4. apply my rows, in the order they were sent (by owner, then matrix)
        offset = 0
        for o in range(world):
            for i, owner in enumerate(owners):
                if owner != o:
                    continue
                shard = local(matrices[i])
                n = shard.numel()
                apply_matrix_update_(shard, returned[offset:offset + n].view(shard.shape), matrices[i].shape,
                                     group["lr"], group["weight_decay"])
                offset += n

    @staticmethod
    def _rows(rows: int, world: int, rank: int) -> slice:
        start = min(rows, rank * math.ceil(rows / world))
        return slice(start, start + rows_on(rows, world, rank))
