"""The front door: seconds from process start to exit for ``--help`` and bad command lines.

Each command is a fresh ``python -m dtlab ...`` process, timed from start to exit,
in interleaved rounds beside ``python -c pass`` (the interpreter's own start, which
no command can beat). The command line parses and checks every flag that needs no
tier before it imports torch or a tier, so these answer at once. Target: every one
under 1 s (the worst median is the headline). A bad ``--opt`` needs the tier's
Options and so torch; it is timed too and reported apart, with no target.

    .venv/bin/python benchmarks/front_door.py [--quick] [--out results/bench] [--repeats N]
"""

from __future__ import annotations

import subprocess
import sys
import time

import _common as common

NAME = "front_door"
TARGET_S = 1.0
# name -> arguments to python; the exit status each must give (2: a refused line)
COMMANDS = {
    "python -c pass": (["-c", "pass"], 0),
    "--help": (["-m", "dtlab", "--help"], 0),
    "run --help": (["-m", "dtlab", "run", "--help"], 0),
    "an unknown flag": (["-m", "dtlab", "run", "--no-such-flag"], 2),
    "an unknown tier": (["-m", "dtlab", "run", "--tier", "no-such-tier"], 2),
    "--steps 0": (["-m", "dtlab", "run", "--tier", "ddp", "--steps", "0"], 2),
    "--world-sizes 1,x": (["-m", "dtlab", "compare", "--tiers", "ddp", "--world-sizes", "1,x"], 2),
    "--batch-size not divisible": (["-m", "dtlab", "run", "--tier", "ddp", "--world-size", "3"], 2),
}
NEEDS_THE_TIER = {"a bad --opt (imports the tier)": (["-m", "dtlab", "run", "--tier", "ddp", "--opt", "nope=1"], 2)}


def timed(argv: list[str], status: int) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != status:
        raise RuntimeError(f"python {' '.join(argv)} exited {done.returncode}, not {status}: {done.stderr[-300:]}")
    return {"seconds": seconds}


def main() -> None:
    args = common.parse(common.parser(__doc__))
    commands = {**COMMANDS, **NEEDS_THE_TIER}
    variants = {name: (lambda _r, a=argv, s=status: timed(a, s)) for name, (argv, status) in commands.items()}
    rows = common.interleave(variants, common.repeats(args, full=10, quick=1), warmup_rounds=0 if args.quick else 1,
                            log=common.note)
    common.write_csv(args.out / f"{NAME}.csv", rows)
    medians = {name: common.median(common.per_round(rows, name, "seconds").values()) for name in commands}
    checked = {name: s for name, s in medians.items() if name in COMMANDS and name != "python -c pass"}
    worst = max(checked, key=checked.get)
    detail = "; ".join(f"{name} {s:.2f} s" for name, s in medians.items())
    common.result_line(NAME, checked[worst], f"<= {TARGET_S:g} s", quick=args.quick,
                       passed=checked[worst] <= TARGET_S, detail=f"the slowest, {worst}; medians: {detail}")


if __name__ == "__main__":
    main()
