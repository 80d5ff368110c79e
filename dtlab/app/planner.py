"""The planner panel: a model, a global batch and a cluster in; the layouts that fit, ranked, out.

``planner()`` shows the controls, the top layouts of ``dtlab.cost.planner.search``
(a projection, labelled as one) with a memory bar per layout against the GPU's
memory line, and **Run it here, scaled down**: the chosen layout's strategies as a
small charformer job on this machine's ranks, its measured bytes per kind drawn
beside ``dtlab.estimate``'s prediction for that job. ``run_scaled(row)`` does the
same without a panel (scripts, tests).
"""

from __future__ import annotations

import dataclasses
import html
import io
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ipywidgets as w
import pandas as pd
from matplotlib.figure import Figure

from dtlab.app.guard import guarded
from dtlab.core.config import RunConfig
from dtlab.core.results import RunResult
from dtlab.cost import planner as plan_lib
from dtlab.cost.estimate import KINDS, Estimate, compare, estimate
from dtlab.cost.planner import Cluster, TransformerSpec
from dtlab.train import run

KIND_COLORS = {"parameters": "tab:blue", "gradients": "tab:orange", "optimizer_state": "tab:green",
               "activations": "tab:red", "comm_buffers": "tab:purple"}
SHOWN = 8  # layouts in the table and the memory figure
STYLE = {"description_width": "150px"}
MODEL_FIELDS = ("layers", "hidden", "heads", "kv_heads", "ffn", "seq", "vocab")
CLUSTER_FIELDS = {  # control -> (Cluster field, scale from the control's unit to the field's)
    "GPU memory (GB)": ("gpu_memory_bytes", 1e9), "GPUs per node": ("gpus_per_node", 1),
    "bf16 peak (TFLOP/s)": ("peak_flops", 1e12), "intra-node bus (GB/s)": ("intra_bus_bandwidth", 1e9),
    "intra latency (us)": ("intra_latency_s", 1e-6), "inter-node bus per GPU (GB/s)": ("inter_bus_bandwidth", 1e9),
    "inter latency (us)": ("inter_latency_s", 1e-6)}


def layout_label(row: Mapping[str, Any]) -> str:
    return (f"#{int(row['rank'])} dp{int(row['dp'])} tp{int(row['tp'])} pp{int(row['pp'])} ZeRO-{int(row['zero'])} "
            f"ckpt {row['checkpointing']} b{int(row['micro_batch'])} {row['precision']}")


def memory_bars(table: pd.DataFrame, gpu_memory_bytes: float, title: str = "") -> Figure:
    """One stacked bar per layout (GB per GPU, by kind) and the GPU's memory line."""
    fig = Figure(figsize=(7.5, 0.45 * len(table) + 1.8), layout="constrained")
    ax = fig.subplots()
    labels = [layout_label(r) for _, r in table.iterrows()][::-1]
    left = [0.0] * len(table)
    for kind in plan_lib.KINDS:
        values = (table[kind] / 1e9).tolist()[::-1]
        ax.barh(labels, values, left=left, color=KIND_COLORS[kind], label=kind.replace("_", " "))
        left = [a + b for a, b in zip(left, values)]
    ax.axvline(gpu_memory_bytes / 1e9, color="black", linestyle="--", linewidth=1.2,
               label=f"GPU memory {gpu_memory_bytes / 1e9:.0f} GB")
    ax.set_xlabel("predicted memory per GPU (GB)")
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title(title or "PROJECTION: memory per GPU by kind, against the device's memory", fontsize=9)
    fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    return fig


def _unit(values: pd.Series) -> tuple[str, float]:
    return ("MB", 1e6) if values.max() >= 1e6 else ("kB", 1e3)


def measured_vs_predicted(frame: pd.DataFrame, title: str = "") -> Figure:
    """Predicted and measured bytes per kind (the rank that holds the most of each), side by side."""
    by_kind = frame.groupby("kind")[["predicted", "measured"]].max().reindex(
        [k for k in KINDS if k in set(frame["kind"])])
    unit, scale = _unit(by_kind.max(axis=1))
    fig = Figure(figsize=(7.5, 3.0), layout="constrained")
    ax = fig.subplots()
    xs = range(len(by_kind))
    ax.bar([x - 0.2 for x in xs], by_kind["predicted"] / scale, width=0.4, label="predicted (dtlab.estimate)",
           color="0.6")
    ax.bar([x + 0.2 for x in xs], by_kind["measured"] / scale, width=0.4, label="measured (the run)",
           color=[KIND_COLORS[k] for k in by_kind.index])
    ax.set_xticks(list(xs), [k.replace("_", " ") for k in by_kind.index], fontsize=8)
    ax.set_ylabel(f"bytes per rank ({unit})")
    ax.set_title(title or "scaled-down run: measured against predicted, per kind", fontsize=9)
    ax.legend(fontsize=8)
    return fig


@dataclass
class ScaledRun:
    """A plan row run here: its job, the result, the estimate for that job and the two lined up."""

    row: dict[str, Any]
    config: RunConfig
    note: str
    result: RunResult
    estimate: Estimate
    frame: pd.DataFrame

    def figure(self) -> Figure:
        return measured_vs_predicted(self.frame, f"{self.config.tier} at world size {self.config.world_size} "
                                                 f"(from {layout_label(self.row)}): measured vs predicted")


def run_scaled(row: Mapping[str, Any], *, steps: int = 5, progress: Any = False,
               stop: threading.Event | None = None) -> ScaledRun:
    """Run a plan row's strategies at charformer size on this machine and line memory up with the estimate."""
    row = dict(row)
    cfg = plan_lib.scaled_down(row, steps=steps)
    _, _, note = plan_lib.scaled_tier(row)
    est = estimate(cfg)
    result = run(cfg, progress=progress, stop=stop)
    return ScaledRun(row, cfg, note, result, est, compare(est, result))


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def table_html(table: pd.DataFrame) -> str:
    rows = []
    for _, r in table.iterrows():
        ok = "<span style='color:#070'>fits</span>" if r["feasible"] else "<span style='color:#b00'>too big</span>"
        rows.append(f"<tr><td>{int(r['rank'])}</td><td>{int(r['dp'])}×{int(r['tp'])}×{int(r['pp'])}</td>"
                    f"<td>{int(r['zero'])}</td><td>{r['checkpointing']}</td><td>{int(r['micro_batch'])} × "
                    f"{int(r['micro_batches'])}</td><td>{r['precision']}</td><td>{r['peak_bytes'] / 1e9:.1f}</td>"
                    f"<td>{ok}</td><td>{r['step_s']:.2f}</td><td>{r['mfu']:.0%}</td><td>{r['hfu']:.0%}</td></tr>")
    head = ("<tr><th>rank</th><th>dp×tp×pp</th><th>ZeRO</th><th>checkpointing</th><th>micro-batch × count</th>"
            "<th>precision</th><th>GB per GPU</th><th></th><th>step (s)</th><th>MFU</th><th>HFU</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


class Planner:
    """Model, batch and cluster controls; the ranked layouts; a scaled-down run of the chosen one.

    Keyword arguments set the first values: ``model`` ("7B", "70B"), ``global_batch``,
    ``cluster`` ("H100", "H200", "A100") and ``gpus``. MFU and HFU are outputs, never settings.
    """

    def __init__(self, **defaults: Any) -> None:
        unknown = set(defaults) - {"model", "global_batch", "cluster", "gpus"}
        if unknown:
            raise ValueError(f"planner({sorted(unknown)[0]}=...): no such setting; choose from model, global_batch, "
                             f"cluster, gpus")
        self._syncing = False
        self.plan: plan_lib.Plan | None = None
        self.last_run: ScaledRun | None = None
        self._thread: threading.Thread | None = None
        self.preset = w.Dropdown(options=[*plan_lib.MODELS, "custom"], value=defaults.get("model", "7B"),
                                 description="model", style=STYLE)
        self.model_fields = {name: w.IntText(description=name.replace("_", " "), style=STYLE) for name in MODEL_FIELDS}
        self.batch = w.IntText(value=defaults.get("global_batch", 1024), description="global batch (seqs)", style=STYLE)
        self.cluster_preset = w.Dropdown(options=[*plan_lib.CLUSTERS, "custom"], value=defaults.get("cluster", "H100"),
                                         description="cluster", style=STYLE)
        self.cluster_fields = {label: w.FloatText(description=label, style=STYLE) for label in CLUSTER_FIELDS}
        self.gpus = w.IntText(value=defaults.get("gpus", 64), description="GPUs", style=STYLE)
        self.plan_button = w.Button(description="Plan", button_style="info", icon="calculator")
        self.pick = w.Dropdown(description="layout to run", style=STYLE, layout={"width": "95%"})
        self.run_button = w.Button(description="Run it here, scaled down", button_style="success", icon="play",
                                   layout={"width": "240px"})
        self.message, self.table, self.note, self.status = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        self.bars_image, self.run_image = w.Image(format="png"), w.Image(format="png")
        self.progress = w.VBox()
        self.assumptions = w.HTML()
        self.log = w.Output(layout={"border": "1px solid #ddd", "max_height": "160px", "overflow": "auto"})
        self.preset.observe(self._guard(self._fill_model), names="value")
        self.cluster_preset.observe(self._guard(self._fill_cluster), names="value")
        for control in self.model_fields.values():
            control.observe(self._guard(self._edited(self.preset)), names="value")
        for control in self.cluster_fields.values():
            control.observe(self._guard(self._edited(self.cluster_preset)), names="value")
        self.plan_button.on_click(self._guard(lambda _b: self.update()))
        self.run_button.on_click(self._guard(self._start))
        self._fill_model()
        self._fill_cluster()
        self.update()

    # -- the model and the cluster the controls describe -----------------------------
    def _fill_model(self, _change: Any = None) -> None:
        if self.preset.value == "custom":
            return
        spec = plan_lib.MODELS[self.preset.value]
        self._syncing = True
        try:
            for name, control in self.model_fields.items():
                control.value = getattr(spec, name)
        finally:
            self._syncing = False

    def _fill_cluster(self, _change: Any = None) -> None:
        if self.cluster_preset.value == "custom":
            return
        cluster = plan_lib.CLUSTERS[self.cluster_preset.value]
        self._syncing = True
        try:
            for label, (name, scale) in CLUSTER_FIELDS.items():
                self.cluster_fields[label].value = round(getattr(cluster, name) / scale, 6)
        finally:
            self._syncing = False

    def _edited(self, preset: w.Dropdown) -> Callable[[Any], None]:
        def on_change(_change: Any) -> None:
            if not self._syncing:  # a typed value: the figures are no longer the preset's
                preset.value = "custom"
        return on_change

    def model(self) -> TransformerSpec:
        if self.preset.value != "custom":
            return plan_lib.MODELS[self.preset.value]
        values = {name: control.value for name, control in self.model_fields.items()}
        return TransformerSpec("custom", **values)

    def cluster(self) -> Cluster:
        """The preset, or the typed figures (line rates taken equal to the typed bus bandwidths; the H100's
        peaks per dtype and efficiency curves scaled to the typed bf16 peak)."""
        if self.cluster_preset.value != "custom":
            return plan_lib.CLUSTERS[self.cluster_preset.value]
        values = {name: self.cluster_fields[label].value * scale for label, (name, scale) in CLUSTER_FIELDS.items()}
        values["gpus_per_node"] = int(values["gpus_per_node"])
        base = plan_lib.H100_SXM
        factor = values.pop("peak_flops") / base.peak_flops
        if not factor > 0:
            raise ValueError("bf16 peak (TFLOP/s) is invalid: must be > 0")
        device = dataclasses.replace(base.device, name="custom GPU",
                                     peak_flops={k: v * factor for k, v in base.device.peak_flops.items()})
        return dataclasses.replace(base, name="custom cluster", intra_line_rate=values["intra_bus_bandwidth"],
                                   inter_line_rate=values["inter_bus_bandwidth"], device=device,
                                   source="figures typed into the planner (the H100's other figures)", **values)

    # -- planning ------------------------------------------------------------------------
    def update(self) -> plan_lib.Plan | None:
        """Plan with the controls' values; a bad value is named in the panel, nothing else changes."""
        try:
            cluster = self.cluster()
            self.plan = plan_lib.search(self.model(), cluster, self.gpus.value, self.batch.value)
        except ValueError as exc:
            self.message.value = f"<span style='color:#b00'>cannot plan this: {html.escape(str(exc))}</span>"
            self.run_button.disabled = True
            return None
        p = self.plan
        top = p.table.head(SHOWN)
        fits = len(p.feasible())
        self.message.value = (f"<b>PROJECTION</b> (not a measurement): {html.escape(p.model.name)}, "
                              f"{p.model.parameters() / 1e9:.3g} B parameters, on {p.gpus} GPU(s) of "
                              f"{html.escape(cluster.name)}: {fits} of {len(p.table)} layouts fit in "
                              f"{cluster.gpu_memory_bytes / 1e9:.0f} GB")
        self.table.value = table_html(top)
        self.bars_image.value = _png(memory_bars(top, cluster.gpu_memory_bytes))
        self.pick.options = [(layout_label(r), i) for i, (_, r) in enumerate(top.iterrows())]
        items = "".join(f"<li>{html.escape(a)}</li>" for a in p.assumptions)
        self.assumptions.value = f"<details><summary><b>assumptions</b></summary><ul>{items}</ul></details>"
        self.run_button.disabled = self._thread is not None and self._thread.is_alive()
        return p

    # -- running ---------------------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return guarded(self.log, fn)

    def chosen(self) -> dict[str, Any]:
        if self.plan is None or self.pick.value is None:
            raise ValueError("nothing planned yet: press Plan")
        return dict(self.plan.table.iloc[self.pick.value])

    def _start(self, _button: Any = None) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        row = self.chosen()
        cfg = plan_lib.scaled_down(row)
        bars = [w.IntProgress(value=0, max=cfg.steps, description=f"rank {r}") for r in range(cfg.world_size)]
        self.progress.children = bars
        self.note.value = f"<i>{html.escape(plan_lib.scaled_tier(row)[2])}</i>"
        self.status.value = f"running {cfg.tier} on {cfg.world_size} rank(s)..."
        self.run_button.disabled = True
        self._thread = threading.Thread(target=self._guard(self._run), args=(row, bars), daemon=True)
        self._thread.start()

    def _run(self, row: dict[str, Any], bars: list[w.IntProgress]) -> None:
        def on_progress(info: dict[str, Any]) -> None:
            rank = info.get("rank", 0)
            if rank < len(bars):
                bars[rank].value = info["step"]

        try:
            done = run_scaled(row, progress=self._guard(on_progress))
        except Exception as exc:
            self.status.value = f"<b style='color:#b00'>failed</b>: {html.escape(str(exc).splitlines()[0])}"
            self.log.append_stderr(str(exc) + "\n")
            return
        finally:
            self.run_button.disabled = False
        self.run_image.value = _png(done.figure())
        self.last_run = done
        self.status.value = (f"<b>finished</b>: {done.result.label} in {done.result.wall_s:.1f} s — measured on this "
                             f"machine; the planner's numbers above stay a projection")

    def run_and_wait(self, timeout_s: float = 300.0) -> ScaledRun | None:
        """Press the run button and wait (for notebooks run top to bottom)."""
        self.last_run = None
        self.run_button.click()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"the scaled-down run did not finish within {timeout_s:g} s")
        return self.last_run

    # -- layout ------------------------------------------------------------------------------
    @property
    def widget(self) -> w.Widget:
        model_box = w.VBox([w.HTML("<b>model</b>"), self.preset, *self.model_fields.values(), self.batch])
        cluster_box = w.VBox([w.HTML("<b>cluster</b>"), self.cluster_preset, *self.cluster_fields.values(),
                              self.gpus])
        return w.VBox([w.HBox([model_box, cluster_box]), self.plan_button, self.message, self.table,
                       self.bars_image, self.assumptions, w.HTML("<b>run one here</b>"), self.pick, self.run_button,
                       self.note, self.progress, self.status, self.run_image, w.HTML("<b>log</b>"), self.log])

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)


def planner(**defaults: Any) -> Planner:
    """The planner panel; display it by leaving it as a cell's last expression."""
    return Planner(**defaults)
