"""More texts the pages quote (``dtlab.app.quoted`` registers them in ``QUOTES``): goodput, busy notebooks, the
fresh clone's timings.

Each function reads a result under ``docs/figures/`` beneath the checkout's root it is given; goodput's are
computed with the experiment's own functions (``python -m dtlab.experiments.goodput``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from dtlab.app.quoted_docs import span
from dtlab.cost import goodput as model
from dtlab.experiments.goodput import PER_STEP, costs

GOODPUT = Path("docs/figures/goodput.csv")
RESTART, TUNED, TORCHFT = "restart, DCP save", "ft (timeouts=tuned)", "ft (timeouts=torchft)"

__all__ = ["GOODPUT", "MORE"]


def _goodput(root: Path) -> tuple[pd.DataFrame, dict[str, float], dict[str, Any]]:
    """The runs (one row per run), the checkpoint costs and the costs fitted on every run, as the experiment."""
    frame = pd.read_csv(root / GOODPUT)
    ckpt = frame[frame["kind"] == "checkpoint"].set_index("variant")["seconds"].to_dict()
    runs = frame[frame["kind"] == "point"]
    return runs, ckpt, costs(runs, ckpt)



def _sig(x: float) -> str:
    """Three significant figures, keeping a trailing zero (11.0, not 11)."""
    return f"{x:.{max(0, 2 - math.floor(math.log10(abs(x))))}f}"


def _break_even(fitted: dict[str, Any], name: str) -> tuple[float | None, float | None]:
    """The MTBF (training seconds) below which ``name`` beats the restart, and its steps there."""
    m = model.break_even_mtbf(fitted[name], fitted[RESTART])
    return m, (m / fitted[name].step_s if m else None)


def _overhead(root: Path) -> float:
    """At Llama 3's fault rate (assumed costs): the per-step overhead below which per-step recovery pays."""
    frame = pd.read_csv(root / GOODPUT)
    at = frame[(frame["kind"] == "projection") & (frame["gpus"] == model.LLAMA3.gpus)].set_index("variant")
    return model.break_even_overhead(at.loc["restart, async save", "fraction"], at.loc[PER_STEP, "fraction"])


def goodput(root: Path) -> str:
    """One line: the measured points against the model, the break-even MTBFs, and the projection's overhead."""
    runs, _, fitted = _goodput(root)
    faulted = runs[runs["faults"] > 0]
    (tuned, steps), (slow, _) = _break_even(fitted, TUNED), _break_even(fitted, TORCHFT)
    ratio = fitted[TUNED].step_s / fitted[RESTART].step_s
    return (f"{len(faulted)} measured points within {span(faulted['ratio'], '{:.2f}')} of the model's predictions "
            f"(MTBF {span(faulted['mtbf_s'], '{:.2f}')} s); `ft` with tuned timeouts beats the restart below an "
            f"MTBF of {tuned:.1f} s of training ({steps:,.0f} of its steps; a restart costs "
            f"{fitted[RESTART].restart_s:.1f} s here, its step {ratio:.2f}× `elastic`'s), with torchft's timeouts "
            f"only below {slow:.2f} s. At Llama 3's published fault rate (a projection with assumed costs, not "
            f"measured) per-step recovery pays while its overhead per step stays under {100 * _overhead(root):.1f} %")


def goodput_table(root: Path) -> str:
    """Per run that met a fault: its MTBF, measured and predicted goodput, and its cost per fault."""
    runs, _, _ = _goodput(root)
    names = {TUNED: "`ft`, tuned timeouts", TORCHFT: "`ft`, torchft's timeouts"}
    lines = ["| variant | faults | MTBF (s) | measured (steps/s) | predicted | measured / predicted | cost per fault |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs[runs["faults"] > 0].sort_values(["variant", "seed"], key=_order).itertuples():
        if r.tier == "elastic":
            name = f"restart, DCP save (k = {r.options.split('snapshot_every=')[1]})"
            cost = f"restart {r.restart_s:.2f} s"
        else:
            name = names[r.variant] if r.variant in names else f"DiLoCo, H = {r.options.split('sync_every=')[1]}"
            cost = f"{r.lost_per_fault_s:.2f} s"
        lines.append(f"| {name} | {r.faults:.0f} | {r.mtbf_s:.2f} | {_sig(r.goodput)} | {_sig(r.predicted)} | "
                     f"{r.ratio:.2f} | {cost} |")
    return "\n".join(lines)


def _order(column: pd.Series) -> pd.Series:
    """The table's order: the restart, ft tuned, ft torchft, DiLoCo; seeds in order."""
    ranks = {RESTART: 0, TUNED: 1, TORCHFT: 2}
    return column.map(lambda v: ranks.get(v, 3)) if column.name == "variant" else column


def goodput_findings(root: Path) -> str:
    """One paragraph: the points against their predictions, the fault-free steps and the break-even MTBFs."""
    runs, _, fitted = _goodput(root)
    faulted, clean = runs[runs["faults"] > 0], runs[runs["faults"] == 0]
    (tuned, steps), (slow, slow_steps) = _break_even(fitted, TUNED), _break_even(fitted, TORCHFT)
    return (f"Every measured point lies within {span(faulted['ratio'], '{:.2f}')} of its prediction; the "
            f"{len(clean)} runs that drew no fault stand as fault-free references "
            f"({span(clean['ratio'], '{:.2f}')} of their prediction), and the points cover MTBFs of "
            f"{span(faulted['mtbf_s'], '{:.2f}')} s only. Fault-free, `ft`'s step took "
            f"{1e3 * fitted[TUNED].step_s:.1f} ms against `elastic`'s {1e3 * fitted[RESTART].step_s:.1f} ms "
            f"(medians over runs, {fitted[TUNED].step_s / fitted[RESTART].step_s:.2f}×: the quorum every step). "
            f"With torchft's timeouts `ft` loses {fitted[TORCHFT].lost_s:.1f} s per fault against the restart's "
            f"{fitted[RESTART].restart_s:.1f} s. The curves cross (`break_even_mtbf`) at an MTBF of "
            f"**{tuned:.1f} s** of training for `ft` with tuned timeouts ({steps:,.0f} of its steps: below that `ft` "
            f"wins) and at {slow:.2f} s ({slow_steps:,.0f} steps) with torchft's")


def goodput_checkpoint(root: Path) -> str:
    """One line: what DCP's save, async_save and load took in the run's micro-benchmark."""
    _, ckpt, _ = _goodput(root)
    return (f"synchronous `save` {1e3 * ckpt['save_s']:.1f} ms, `async_save` {1e3 * ckpt['async_block_s']:.1f} ms "
            f"blocking and durable after {1e3 * ckpt['async_total_s']:.1f} ms, `load` {1e3 * ckpt['load_s']:.1f} ms")


def goodput_projection(root: Path) -> str:
    """One line: the projection's fraction of fault-free throughput per answer, and the overhead it allows."""
    frame = pd.read_csv(root / GOODPUT)
    at = frame[(frame["kind"] == "projection") & (frame["gpus"] == model.LLAMA3.gpus)].set_index("variant")
    f = at["fraction"]
    return (f"At {model.LLAMA3.gpus:,} GPUs the model keeps {f['restart, sync save']:.3f} of fault-free throughput "
            f"with synchronous saves, {f['restart, async save']:.3f} with asynchronous ones and {f[PER_STEP]:.3f} "
            f"with per-step recovery before its own per-step cost, so per-step recovery pays off there only while "
            f"its overhead per step stays under **{100 * _overhead(root):.1f} %**")


BUSY = Path("docs/figures/busy_notebooks.csv")


def busy_notebooks(root: Path) -> str:
    """One line: the notebooks run beside CPU hogs (``python -m dtlab.app.busy``): passed, slowest, summed."""
    runs = pd.read_csv(root / BUSY)
    slowest = runs.loc[runs["seconds"].idxmax()]
    number, name = str(slowest["notebook"]).split("_", 1)
    passed = "all" if runs["passed"].all() else f"{int(runs['passed'].sum())} of"
    return (f"load average {runs['load_1min'].min():.1f} to {runs['load_1min'].max():.1f} as the notebooks ended: "
            f"{passed} {len(runs)} notebooks passed, the slowest in {slowest['seconds']:.0f} s ({number}, "
            f"{name.replace('_', ' ')}), {runs['seconds'].sum():,.0f} s summed over the notebooks")


FRESH_CLONE = Path("docs/figures/fresh_clone.csv")
SUITE_AIM_S = 20 * 60  # the suite's aim on 2 cores


def fresh_clone(root: Path) -> str:
    """One line: the last fresh clone's ``make demo`` and ``make test`` (``tools: fresh-clone-check``), against
    the suite's aim; every earlier clone stays a row of the file."""
    runs = pd.read_csv(root / FRESH_CLONE)
    last = runs[runs["commit"] == runs["commit"].iloc[-1]].set_index("command")
    demo, test = last.loc["make demo"], last.loc["make test"]
    aim = "within" if test["seconds"] <= SUITE_AIM_S else "over"
    failed = [c for c, row in last.iterrows() if row["exit_code"] != 0]
    return (f"in a fresh clone of {demo['commit']} on {demo['date']}, `make demo` took "
            f"{demo['seconds'] / 60:.0f} minutes ({demo['seconds']:,.0f} s, installation included) and `make test` "
            f"{test['seconds'] / 60:.0f} minutes ({test['seconds']:,.0f} s, {aim} the suite's aim of "
            f"{SUITE_AIM_S // 60} minutes)" + (f"; failed: {', '.join(failed)}" if failed else ""))


MORE: dict[str, Callable[[Path], str]] = {
    "busy-notebooks": busy_notebooks,
    "fresh-clone": fresh_clone,
    "goodput": goodput,
    "goodput-checkpoint": goodput_checkpoint,
    "goodput-findings": goodput_findings,
    "goodput-projection": goodput_projection,
    "goodput-table": goodput_table,
}
