"""ipywidgets panels: pick a strategy, run it in the background, compare runs from the history.

No training logic lives here: the panel builds a RunConfig, calls ``dtlab.run``
in a thread and shows what comes back. Controls are kept apart from output,
and every callback's error is shown in the panel's log instead of vanishing.
Widgets are updated from the run's thread only through their values
(progress bars, images, HTML), which is safe across threads.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import io
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as w

from dtlab import plots, tiers
from dtlab.app.guard import guarded
from dtlab.app.history import HISTORY, SavedRun, load_history, new_run_folder, read_runs
from dtlab.app.planner import planner as planner  # re-exported: dtlab.widgets.planner()
from dtlab.core import options
from dtlab.core.config import MODELS, PRECISIONS, TEXT_MODELS, RunConfig
from dtlab.core.registry import TierSpec
from dtlab.launch import netns
from dtlab.launch.local import LaunchStopped
from dtlab.read.elastic import timeline
from dtlab.read.frames import breakdown_frame
from dtlab.tiers.elastic import FAULT_KINDS
from dtlab.train import preflight, run

FAULTS = ["none", *FAULT_KINDS]
JOB_DEFAULTS = ("tier", "world_size", "model", "model_size", "global_batch_size", "steps", "fault", "precision",
                "activation_checkpointing")
OPTION_STYLE = {"description_width": "170px"}
KIND_WIDGETS = {"bool": w.Checkbox, "int": w.IntText, "float": w.FloatText}  # str and tuple: w.Text


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _compare_table(runs: dict[str, SavedRun]) -> str:
    rows = "".join(f"<tr><td>{html.escape(name)}</td><td>{r.summary['median_step_s'] * 1e3:.2f} ms</td>"
                   f"<td>{r.summary['samples_per_s']:.0f}</td><td>{r.summary['final_loss']:.4f}</td></tr>"
                   for name, r in runs.items())
    return ("<table><tr><th>run</th><th>median step</th><th>samples/s</th><th>final loss</th></tr>"
            + rows + "</table>")


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(f"<tr><td>{k}</td><td><b>{v}</b></td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def option_controls(spec: TierSpec) -> dict[str, w.Widget]:
    """One control per field of the tier's Options, by kind: a Dropdown where the spec lists choices for it,
    else Checkbox, IntText, FloatText, or Text (str, and tuples written comma-separated)."""
    controls: dict[str, w.Widget] = {}
    defaults = spec.options()
    for name, kind in options.fields(spec.options).items():
        value, choices = getattr(defaults, name), list(spec.choices.get(name, ()))
        common = {"description": name, "style": OPTION_STYLE, "tooltip": f"{spec.name} tier option {name} ({kind})"}
        if choices:
            controls[name] = w.Dropdown(options=choices if value in choices else [value, *choices], value=value,
                                        **common)
        elif kind in KIND_WIDGETS:
            controls[name] = KIND_WIDGETS[kind](value=value, **common)
        else:
            controls[name] = w.Text(value=options.format(value), **common,
                                    placeholder="comma-separated values" if kind == "tuple" else "")
    return controls


class Lab:
    """The strategy picker, Run/Stop, live progress, the result, and the comparison panel.

    The job's knobs are common to every tier; each tier's own knobs are built from
    its Options dataclass (``option_controls``) and shown while that tier is picked.
    Keyword arguments set the first values: ``tier``, ``world_size``, ``model``,
    ``model_size``, ``global_batch_size``, ``steps``, ``fault`` and any option of the tier.
    """

    def __init__(self, history: Path | str = HISTORY, **defaults: Any) -> None:
        self.history = Path(history)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._running = False
        style = {"description_width": "110px"}
        self.tier = w.Dropdown(options=list(tiers.TIERS), value=defaults.get("tier", "ddp"), description="tier",
                               style=style)
        self.world_size = w.IntSlider(value=defaults.get("world_size", 2), min=1, max=4, description="world size",
                                      style=style)
        self.model = w.Dropdown(options=list(MODELS), value=defaults.get("model", "mlp"), description="model",
                                style=style)
        self.model_size = w.Dropdown(options=[16, 32, 64, 128, 256, 512, 1024], value=defaults.get("model_size", 64),
                                     description="model width", style=style)
        self.batch = w.IntText(value=defaults.get("global_batch_size", 64), description="global batch", style=style)
        self.steps = w.IntSlider(value=defaults.get("steps", 40), min=5, max=500, step=5, description="steps",
                                 style=style)
        self.precision = w.Dropdown(options=list(PRECISIONS), value=defaults.get("precision", "fp32"),
                                    description="precision", style=style)
        self.recompute = w.Checkbox(value=defaults.get("activation_checkpointing", False),
                                    description="activation checkpointing", style=style)
        # Every tier's own knobs, from its Options; only the picked tier's are shown.
        self.option_controls = {name: option_controls(tiers.get(name)) for name in tiers.TIERS}
        # The elastic tier's quick fault: one of these halfway through the run, on the last rank.
        self.fault = w.Dropdown(options=FAULTS, value=defaults.get("fault", "none"), description="fault",
                                style=OPTION_STYLE)
        self._set_option_defaults(defaults)
        self.options_box, self._shown = w.VBox(_dom_classes=("dtlab-options",)), ""
        # Simulated hosts need network namespaces (root); elsewhere multinode runs on loopback, and why is shown.
        self._netns, self._netns_reason = netns.available()
        self.last_result: Any = None  # the latest finished run's RunResult
        self.message = w.HTML()
        self.run_button = w.Button(description="Run", button_style="success", icon="play", _dom_classes=("dtlab-run",))
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True,
                                    _dom_classes=("dtlab-stop",))
        self.bars = w.VBox()
        self.live = w.Image(format="png")
        self.status = w.HTML(_dom_classes=("dtlab-status",))
        self.result = w.VBox(_dom_classes=("dtlab-result",))
        self.log = w.Output(layout={"border": "1px solid #ddd", "max_height": "200px", "overflow": "auto"})
        self.compare_pick = w.SelectMultiple(description="runs", rows=6, style=style, layout={"width": "95%"})
        self.compare_button = w.Button(description="Compare selected", icon="line-chart")
        self.refresh_button = w.Button(description="Refresh", icon="refresh")
        self.compare_out = w.VBox()
        every_option = [c for controls in self.option_controls.values() for c in controls.values()]
        for control in (*self._job_controls, self.fault, *every_option):
            control.observe(self._guard(self._validate), names="value")
        self.run_button.on_click(self._guard(self._start))
        self.stop_button.on_click(self._guard(lambda _b: self._stop.set()))
        self.compare_button.on_click(self._guard(self._compare))
        self.refresh_button.on_click(self._guard(lambda _b: self._refresh_history()))
        self._refresh_history()
        self._validate()

    @property
    def _job_controls(self) -> tuple[w.Widget, ...]:
        return (self.tier, self.world_size, self.model, self.model_size, self.batch, self.steps, self.precision,
                self.recompute)

    def _set_option_defaults(self, defaults: dict[str, Any]) -> None:
        """Keyword arguments that are options of the first tier set its controls (ValueError for unknown ones)."""
        controls = self.option_controls[self.tier.value]
        for key in set(defaults) - set(JOB_DEFAULTS) - set(controls):
            raise ValueError(f"lab({key}=...): the {self.tier.value!r} tier's panel has no such setting; choose from "
                             f"{', '.join([*JOB_DEFAULTS, *controls])}")
        for key in set(defaults) & set(controls):
            value = defaults[key]
            controls[key].value = options.format(value) if isinstance(controls[key], w.Text) else value

    # -- layout --------------------------------------------------------------------
    @property
    def widget(self) -> w.Widget:
        knobs = w.VBox([*self._job_controls, self.options_box])
        run_tab = w.VBox([knobs, self.message, w.HBox([self.run_button, self.stop_button]), self.bars,
                          self.status, self.live, self.result, w.HTML("<b>log</b>"), self.log])
        compare_tab = w.VBox([self.compare_pick, w.HBox([self.compare_button, self.refresh_button]),
                              self.compare_out])
        tabs = w.Tab(children=[run_tab, compare_tab])
        tabs.set_title(0, "run")
        tabs.set_title(1, "compare history")
        return tabs

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def _show_options(self, tier: str) -> None:
        controls = list(self.option_controls[tier].values())
        if tier == "elastic":
            controls.insert(0, self.fault)
        header = w.HTML(f"<b>{tier} options</b>" if controls else f"<i>the {tier} tier has no options</i>")
        grid = w.GridBox(controls, layout={"grid_template_columns": "repeat(2, 1fr)"})
        self.options_box.children = [header, grid] if controls else [header]
        self._shown = tier

    # -- callbacks -----------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return guarded(self.log, fn)

    def tier_options(self, tier: str | None = None) -> Any:
        """The tier's Options as its controls set them (ValueError naming the field if one does not fit)."""
        tier = tier or self.tier.value
        spec = tiers.get(tier)
        values = {name: control.value for name, control in self.option_controls[tier].items()}
        try:
            opts = options.build(spec.options, values)
        except options.OptionError as exc:
            raise ValueError(f"{tier} tier_options.{exc}") from None
        if tier == "elastic" and self.fault.value != "none":
            opts = dataclasses.replace(opts, faults=(*opts.faults, self.fault_spec()))
        return opts

    def config(self) -> RunConfig:
        """The RunConfig the controls describe (raises ValueError naming what is wrong)."""
        tier = self.tier.value
        text = self.model.value in TEXT_MODELS
        return RunConfig(tier=tier, world_size=1 if tier == "single" else self.world_size.value,
                         model=self.model.value, model_size=self.model_size.value,
                         dataset="text" if text else "digits", global_batch_size=self.batch.value,
                         steps=self.steps.value, lr=0.003 if text else 0.01, precision=self.precision.value,
                         activation_checkpointing=self.recompute.value, tier_options=self.tier_options(tier))

    def _checked(self, probe: bool = False) -> RunConfig:
        """``config()``, plus what the runner would refuse here (namespaces asked for where there are none);
        with ``probe`` the tier's preflight too (files, snapshots), as ``run`` will: only when Run is pressed."""
        cfg = self.config()
        spec = tiers.get(cfg.tier)
        if spec.agents is not None and spec.agents(cfg).network == "netns" and not self._netns:
            raise ValueError(f"tier_options.network='netns' cannot run here: {self._netns_reason.split(':')[0]}")
        if probe:
            preflight(cfg)
        return cfg

    def fault_spec(self) -> str:
        """The picked fault as the elastic tier's "KIND:STEP:RANK": halfway through, on the last rank."""
        return f"{self.fault.value}:{max(1, self.steps.value // 2)}:{self.world_size.value - 1}"

    def _notes(self, tier: str) -> str:
        note = tiers.get(tier).summary
        if tier == "multinode":
            note += ("; each node its own network namespace, its link capped by link_mbit" if self._netns
                     else f"; loopback nodes only (link_mbit needs namespaces): {self._netns_reason}")
        elif tier == "elastic":
            note += (f"; fault {self.fault_spec()} (kind:step:rank): the run restarts from its last snapshot"
                     if self.fault.value != "none" else "; pick a fault to watch the run restart from a snapshot")
        return f"<i>{html.escape(note)}</i>"

    def _error(self, exc: Exception, tier: str) -> None:
        line = html.escape(" ".join(str(exc).split()))
        self.message.value = f"<span style='color:#b00'>cannot run this: {line}</span><br>" + self._notes(tier)
        self.run_button.disabled = True

    def _validate(self, _change: Any = None) -> None:
        tier = self.tier.value
        self.world_size.disabled = tier == "single"
        self.fault.disabled = tier != "elastic"
        if tier != self._shown:
            self._show_options(tier)
            models = tiers.get(tier).models
            if models and self.model.value not in models:  # e.g. cp needs a sequence: pick a model it has
                self.model.value = models[0]  # observed: validates again
                return
        try:
            cfg = self._checked()
        except ValueError as exc:
            self._error(exc, tier)
            return
        procs = tiers.get(tier).processes(cfg)
        self.message.value = (f"<span style='color:#070'>ready: {tier}, {cfg.world_size} rank(s) in {procs} "
                              f"process(es), per-rank batch {cfg.per_rank_batch}</span><br>" + self._notes(tier))
        self.run_button.disabled = self._running

    def _start(self, _button: Any = None) -> None:
        if self._running:
            return
        try:
            cfg = self._checked(probe=True)
        except ValueError as exc:  # e.g. a resume_from that is not there: said in the panel, nothing started
            self._error(exc, self.tier.value)
            return
        self._running = True
        self._stop.clear()
        bars = [w.IntProgress(value=0, max=cfg.steps, description=f"rank {r}") for r in range(cfg.world_size)]
        self.bars.children = bars
        self.result.children = []
        self.status.value = f"running {cfg.tier} on {cfg.world_size} rank(s)..."
        self.run_button.disabled, self.stop_button.disabled = True, False
        self._thread = threading.Thread(target=self._guard(self._run), args=(cfg, bars), daemon=True)
        self._thread.start()

    def run_and_wait(self, timeout_s: float = 300.0) -> Any:
        """Press Run and wait for the run to end (for scripts and notebooks run top to bottom)."""
        if self._running:
            raise RuntimeError("a run is already in progress: wait for it or press Stop")
        self._checked(probe=True)  # a bad combination raises its ValueError here rather than only in the panel
        self.last_result = None
        self.run_button.click()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self._stop.set()
                self._thread.join(30)
                raise TimeoutError(f"the run did not finish within {timeout_s:g} s and was stopped")
        return self.last_result

    def _run(self, cfg: RunConfig, bars: list[w.IntProgress]) -> None:
        live: dict[int, float] = {}
        throughput: dict[int, float] = {}
        last_draw = [0.0]

        def on_progress(info: dict[str, Any]) -> None:
            rank = info.get("rank", 0)
            if rank < len(bars):
                bars[rank].value = info["step"]
            if rank == 0:
                live[info["step"]] = info["loss"]
                throughput[info["step"]] = info.get("samples_per_s", 0.0)
                now = datetime.datetime.now().timestamp()
                if now - last_draw[0] > 0.5:
                    self.live.value = _png(self._live_figure(live, throughput))
                    last_draw[0] = now

        try:
            result = run(cfg, progress=self._guard(on_progress), stop=self._stop)
        except LaunchStopped as exc:
            self.status.value = f"<b>stopped</b>: {exc}; every rank process was ended"
            return
        except Exception as exc:
            self.status.value = f"<b style='color:#b00'>failed</b>: {str(exc).splitlines()[0]}"
            self.log.append_stderr(str(exc) + "\n")
            return
        finally:
            self._running, self.stop_button.disabled = False, True
            self._validate()  # Run again, unless the controls changed to something invalid meanwhile
        if live:
            self.live.value = _png(self._live_figure(live, throughput))  # the last points too
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = self._save(result, f"{stamp}-{cfg.tier}-w{cfg.world_size}")
        self.last_result = result
        self._show_result(result, folder)
        self._refresh_history()

    def _save(self, result: Any, name: str) -> Path:
        """Save into the history; a finished run is never lost to a failing save: a temporary folder then."""
        folder = self.history / name
        try:
            folder = new_run_folder(self.history, name)
            return result.save(folder)
        except OSError as exc:
            fallback = result.save(tempfile.mkdtemp(prefix="dtlab-results-"))
            self.log.append_stderr(f"could not save in {folder} ({exc.strerror or exc}); saved in {fallback}\n")
            return fallback

    def _live_figure(self, loss: dict[int, float], throughput: dict[int, float]) -> Any:
        from matplotlib.figure import Figure

        fig = Figure(figsize=(7, 2.4), layout="constrained")
        a, b = fig.subplots(1, 2)
        steps = sorted(loss)
        a.plot(steps, [loss[s] for s in steps], marker=".")
        a.set(title="live: training loss (rank 0)", xlabel="step", ylabel="loss (cross-entropy)")
        b.plot(steps, [throughput[s] for s in steps], marker=".", color="tab:green")
        b.set(title="live: throughput", xlabel="step", ylabel="samples/s")
        return fig

    def _show_result(self, result: Any, folder: Path) -> None:
        s = result.summary()
        rows = {"tier": s["tier"], "world size": s["world_size"], "median step": f"{s['median_step_s'] * 1e3:.2f} ms",
                "throughput": f"{s['samples_per_s']:.0f} samples/s", "final loss": f"{s['final_loss']:.4f}",
                "test accuracy": f"{s.get('test_accuracy', float('nan')):.3f}",
                "collectives per step": f"{sum(v['calls_per_step'] for v in s['comm'].values()):.1f}",
                "saved in": str(folder)}
        images = [w.Image(value=_png(plots.loss_curves({result.label: result.loss_curve()})), format="png"),
                  w.Image(value=_png(plots.step_breakdown(breakdown_frame([result]))), format="png")]
        if result.config.tier == "elastic":
            images.append(w.Image(value=_png(plots.elastic_timeline(timeline(result))), format="png"))
        self.result.children = [w.HTML(_table(rows)), *images]
        # "finished" only once the result is on screen: whoever waits for it may read the result at once
        self.status.value = f"<b>finished</b>: {result.label} in {result.wall_s:.1f} s"

    def _refresh_history(self) -> None:
        runs = load_history(self.history)
        self.compare_pick.options = list(runs)

    def _compare(self, _button: Any = None) -> None:
        runs = load_history(self.history)
        picked = [name for name in self.compare_pick.value if name in runs]
        if not picked:
            self.compare_out.children = [w.HTML("<i>pick one or more saved runs above</i>")]
            return
        readable, broken = read_runs({name: runs[name] for name in picked})
        shown: list[w.Widget] = []
        if readable:
            shown += [w.HTML(_compare_table(readable)),
                      w.Image(value=_png(plots.loss_curves({n: r.loss for n, r in readable.items()})), format="png")]
        if broken:  # named, not fatal: the readable runs are still compared
            lines = "".join(f"<br>{html.escape(name)}: {html.escape(why)}" for name, why in broken.items())
            shown.append(w.HTML(f"<span style='color:#b00'>left out, cannot be read:{lines}</span>"))
        self.compare_out.children = shown


def lab(**defaults: Any) -> Lab:
    """The dtlab panel; display it by leaving it as a cell's last expression."""
    return Lab(**defaults)
