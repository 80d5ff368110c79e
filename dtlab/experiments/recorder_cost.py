"""What recording a collective costs, and where: the recorder's time per call, by part, from a profile.

    python -m dtlab.experiments.recorder_cost [--calls N] [--rounds N] [--out DIR] [--docs]

Two ranks (gloo, one thread each) run the same loop of synchronous 4 KB all-reduces -- the size
where a per-call cost shows most -- in interleaved rounds: ``plain`` (no recorder started, so no
dispatcher kernel is registered) and ``recorded`` (a fresh ``CommRecorder``). Their difference per
call is what recording costs. A third pass, on rank 0 only while rank 1 runs the recorded loop,
runs under ``cProfile``, and the self-time of each function dtlab adds to a call is summed into the
parts below; each part's share of the profiled dtlab time is applied to the measured difference
(a profiler slows Python calls, so its absolute times are not the unprofiled cost, but its shares are).

Writes ``recorder_cost_rounds.csv`` (seconds per call, per round and variant) and ``recorder_cost.csv``
(one row per part: calls per collective, profiled self-time per collective, its share, the
attributed microseconds). ``--docs`` rewrites the table in docs/measurement.md between its markers.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import torch.distributed as dist

from dtlab.instrument.recorder import CommRecorder
from dtlab.launch.local import launch

__all__ = ["PARTS", "attribute", "main", "markdown", "measure"]

# A function dtlab adds to a call (its file and name in the profile) -> the part it belongs to.
PARTS: dict[tuple[str, str], str] = {
    ("dispatch.py", "kernel"): "the Python kernel at the dispatcher (entry, redispatch call)",
    ("dispatch.py", "caller_api"): "which torch.distributed function called (a walk up the frames)",
    ("ops.py", "bind"): "binding the op's arguments to its schema",
    ("recorder.py", "listening"): "the per-thread quiet check",
    ("recorder.py", "begin"): "the event's fields: op, async, tag",
    ("recorder.py", "_unbox_group"): "the group: its size and name",
    ("recorder.py", "_group_size"): "the group: its size and name",
    ("recorder.py", "_group_name"): "the group: its size and name",
    ("recorder.py", "_channel_tag"): "the event's fields: op, async, tag",
    ("recorder.py", "tag"): "the event's fields: op, async, tag",
    ("recorder.py", "add"): "making and storing the event",
    ("events.py", "__init__"): "making and storing the event",
    ("ops.py", "tensor_nbytes"): "the payload's bytes and dtype",
    ("ops.py", "dtype_name"): "the payload's bytes and dtype",
    ("recorder.py", "issued"): "after the call: the Work's future and its callback",
    ("recorder.py", "done"): "after the call: the Work's future and its callback",
    ("recorder.py", "_unbox_work"): "after the call: the Work's future and its callback",
    ("events.py", "finish"): "after the call: the Work's future and its callback",
    ("recorder.py", "_enter"): "the launcher's live slots (which op a hung rank is in)",
    ("recorder.py", "_leave"): "the launcher's live slots (which op a hung rank is in)",
    ("recorder.py", "now"): "clock reads",
    ("dispatch.py", "wait"): "the Work.wait patch",
    ("recorder.py", "wait"): "the Work.wait patch",
}
# torch's own calls that only the recorded path makes, as the profiler names a pybind method (file "~").
TORCH_CALLS = ("<built-in method torch._C._distributed_c10d.get_future>",
               "<built-in method torch._C.add_done_callback>")
PARTS.update({("~", name): "after the call: the Work's future and its callback" for name in TORCH_CALLS})
DOC = Path(__file__).resolve().parents[2] / "docs" / "measurement.md"
BEGIN, END = "<!-- recorder-cost:begin -->", "<!-- recorder-cost:end -->"


def _loop(calls: int) -> float:
    t = torch.ones(1024)  # 4 KB of float32
    start = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.perf_counter() - start) / calls


def rank_main(info: Any, calls: int, rounds: int) -> dict[str, Any]:
    """On each rank: interleaved plain and recorded loops, then the profiled pass on rank 0."""
    torch.set_num_threads(1)
    rows = []
    for r in range(-1, rounds):  # round -1 warms both up
        for variant in ("plain", "recorded") if r % 2 == 0 else ("recorded", "plain"):
            if variant == "plain":
                seconds = _loop(calls)
            else:
                with CommRecorder(info.rank):
                    seconds = _loop(calls)
            rows.append({"rank": info.rank, "round": r, "variant": variant, "seconds_per_call": seconds})
    profile = cProfile.Profile() if info.rank == 0 else None
    with CommRecorder(info.rank) as recorder:
        if profile is not None:
            profile.enable()
        _loop(calls)
        if profile is not None:
            profile.disable()
    if profile is None:
        return {"rows": rows, "profile": []}
    stats = pstats.Stats(profile).stats  # (file, line, name) -> (primitive calls, calls, self s, cumulative, callers)
    funcs = [{"file": Path(f).name, "name": n, "calls": c, "self_s": tt}
             for (f, _, n), (_, c, tt, _, _) in stats.items() if "dtlab" in f or n in TORCH_CALLS]
    # The patched wait's self time holds the blocking wait itself (torch's Work.wait is not a call the profiler
    # sees apart), which the plain loop spends too; the recorder timed it, so it is taken out here.
    blocked = sum(event.wait_s for event in recorder.events)
    for row in funcs:
        if (row["file"], row["name"]) == ("recorder.py", "wait"):
            row["self_s"] = max(0.0, row["self_s"] - blocked)
    return {"rows": rows, "profile": funcs}


def measure(calls: int = 2000, rounds: int = 5) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(rounds, profile): every rank's seconds per call by round and variant; rank 0's profiled dtlab functions."""
    out = launch(rank_main, 2, args=(calls, rounds), record=False, progress=False).values
    rounds_frame = pd.DataFrame([row for value in out for row in value["rows"]])
    return rounds_frame, pd.DataFrame(out[0]["profile"])


def attribute(rounds: pd.DataFrame, profile: pd.DataFrame, calls: int) -> pd.DataFrame:
    """One row per part: profiled calls and self-time per collective, its share, and the measured cost it explains.

    The measured cost per call is the median over rounds of rank 0's (recorded - plain) seconds per call.
    """
    rank0 = rounds[(rounds["rank"] == 0) & (rounds["round"] >= 0)].pivot(index="round", columns="variant",
                                                                       values="seconds_per_call")
    extra_s = statistics.median(rank0["recorded"] - rank0["plain"])
    parts = profile.assign(part=[PARTS.get((f, n), f"other dtlab code ({f}: {n})")
                                 for f, n in zip(profile["file"], profile["name"])])
    table = parts.groupby("part", as_index=False).agg(calls=("calls", "sum"), self_s=("self_s", "sum"))
    table = table[table["calls"] >= calls]  # what runs once per collective or more, not the set-up around the loop
    table["calls_per_collective"] = table["calls"] / calls
    table["profiled_us"] = table["self_s"] / calls * 1e6
    table["share"] = table["self_s"] / table["self_s"].sum()
    table["attributed_us"] = table["share"] * extra_s * 1e6
    table = table.sort_values("attributed_us", ascending=False, ignore_index=True)
    table.attrs.update(extra_us=extra_s * 1e6, plain_us=float(rank0["plain"].median() * 1e6),
                       recorded_us=float(rank0["recorded"].median() * 1e6), rounds=len(rank0))
    return table[["part", "calls_per_collective", "profiled_us", "share", "attributed_us"]]


def markdown(table: pd.DataFrame, extra_us: float, plain_us: float, recorded_us: float, rounds: int) -> str:
    """The table docs/measurement.md shows, from ``recorder_cost.csv``'s rows and its summary numbers."""
    lines = [f"A 4 KB all-reduce at world 2 took {plain_us:.1f} us plain and {recorded_us:.1f} us recorded "
             f"(medians of {rounds} interleaved rounds, rank 0): recording adds {extra_us:.1f} us per call, "
             "attributed below by the profile's shares.", "",
             "| part | calls per collective | profiled us | share | attributed us |",
             "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r.part} | {r.calls_per_collective:.0f} | {r.profiled_us:.2f} | {r.share:.0%} "
              f"| {r.attributed_us:.2f} |" for r in table.itertuples()]
    return "\n".join(lines) + "\n"


def summary(table: pd.DataFrame) -> dict[str, float]:
    """The numbers the table's heading states, stored as rows of their own in the CSV (part ``_summary``)."""
    return {k: float(table.attrs[k]) for k in ("extra_us", "plain_us", "recorded_us", "rounds")}


def write_doc(text: str, page: Path = DOC) -> None:
    body = page.read_text()
    if BEGIN not in body or END not in body:
        raise ValueError(f"{page}: no {BEGIN} ... {END} markers to write the table between")
    head, rest = body.split(BEGIN, 1)
    page.write_text(f"{head}{BEGIN}\n{text}{END}{rest.split(END, 1)[1]}")


def from_csv(path: Path) -> str:
    """The docs' table made again from a committed ``recorder_cost.csv`` (tests compare it with the page)."""
    frame = pd.read_csv(path)
    numbers = frame[frame["part"] == "_summary"].iloc[0]
    table = frame[frame["part"] != "_summary"]
    return markdown(table, numbers["attributed_us"], numbers["profiled_us"], numbers["share"],
                    int(numbers["calls_per_collective"]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="all-reduces per loop")
    p.add_argument("--rounds", type=int, default=10, help="interleaved rounds of plain and recorded loops")
    p.add_argument("--out", type=Path, default=Path("results/recorder_cost"), help="folder for the CSV files")
    p.add_argument("--docs", action="store_true", help="rewrite the table in docs/measurement.md")
    args = p.parse_args(argv)
    if args.calls < 1 or args.rounds < 1:
        p.error(f"--calls {args.calls} / --rounds {args.rounds}: both must be >= 1")
    rounds, profile = measure(args.calls, args.rounds)
    table = attribute(rounds, profile, args.calls)
    numbers = summary(table)
    args.out.mkdir(parents=True, exist_ok=True)
    rounds.to_csv(args.out / "recorder_cost_rounds.csv", index=False)
    # The heading's numbers ride along as one row (part "_summary"), so the page is made from this file alone.
    row = {"part": "_summary", "calls_per_collective": numbers["rounds"], "profiled_us": numbers["plain_us"],
           "share": numbers["recorded_us"], "attributed_us": numbers["extra_us"]}
    pd.concat([table, pd.DataFrame([row])]).to_csv(args.out / "recorder_cost.csv", index=False)
    text = from_csv(args.out / "recorder_cost.csv")
    print(text)
    print(f"wrote {args.out}/recorder_cost.csv and recorder_cost_rounds.csv")
    if args.docs:
        write_doc(text)
        print(f"rewrote the table in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
