"""Collective bus bandwidth against message size, next to this machine's memory-copy bandwidth.

Runs dtlab.cost.links.sweep.sweep (all_reduce, all_gather, reduce_scatter,
broadcast, send/recv ring) at world size 2 over 1 KiB ... 16 MiB and measures
``torch`` tensor-copy bandwidth in the same run. Reported: all_reduce bus
bandwidth at the largest size as a fraction of the memcpy limit (no target:
gloo over loopback copies every byte through the kernel several times).

    .venv/bin/python benchmarks/collective_bandwidth.py [--quick] [--out results/bench]
"""

from __future__ import annotations

import _common as common

from dtlab import plots
from dtlab.cost.links import sweep as collectives

NAME = "collective_bandwidth"


def main() -> None:
    args = common.parse(common.parser(__doc__))
    sizes = (1024, 65536, 1 << 20) if args.quick else collectives.DEFAULT_SIZES
    repeats = common.repeats(args, full=7, quick=1)
    limit = collectives.memcpy_bandwidth()
    df = collectives.sweep(2, sizes=sizes, repeats=repeats)
    df["memcpy_bytes_per_s"] = limit
    df["fraction_of_memcpy"] = df["busbw"] / limit
    common.write_csv(args.out / f"{NAME}.csv", df.to_dict("records"))
    fig = plots.bandwidth(df, limit_gbps=limit / 1e9, limit_label="memcpy (same run)")
    plots.save(fig, args.out / f"{NAME}.png")
    largest = df[(df["op"] == "all_reduce") & (df["bytes"] == df["bytes"].max())].iloc[0]
    small = df[(df["op"] == "all_reduce") & (df["bytes"] == df["bytes"].min())].iloc[0]
    common.result_line(NAME, float(largest["fraction_of_memcpy"]), "none: fraction of the memcpy limit",
                       quick=args.quick,
                       detail=f"all_reduce busbw {largest['busbw'] / 1e9:.2f} GB/s at {int(largest['bytes'])} B "
                              f"vs memcpy {limit / 1e9:.2f} GB/s; {small['seconds'] * 1e3:.2f} ms at "
                              f"{int(small['bytes'])} B")


if __name__ == "__main__":
    main()
