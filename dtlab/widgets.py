"""ipywidgets panels: pick a strategy, run it in the background, compare runs from the history.

No training logic lives here: the panel builds a RunConfig, calls ``dtlab.run``
in a thread and shows what comes back. Controls are kept apart from output,
and every callback's error is shown in the panel's log instead of vanishing.
Widgets are updated from the run's thread only through their values
(progress bars, images, HTML), which is safe across threads.
"""

from __future__ import annotations

import datetime
import functools
import io
import json
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ipywidgets as w

from dtlab import netns, tiers
from dtlab.config import MODELS, RunConfig

BUCKETED = {"ddp", "zero", "multinode", "elastic"}  # tiers with DDP's knobs
LINK_CAPS = [("loopback nodes", 0.0), ("10 Gbit/s", 10_000.0), ("1 Gbit/s", 1_000.0), ("200 Mbit/s", 200.0)]
FAULTS = ["none", "exception", "sigkill", "oom"]
HISTORY = Path("results/history")


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    return buf.getvalue()


def _table(rows: dict[str, Any]) -> str:
    cells = "".join(f"<tr><td>{k}</td><td><b>{v}</b></td></tr>" for k, v in rows.items())
    return f"<table>{cells}</table>"


def load_history(folder: Path = HISTORY) -> dict[str, Path]:
    """Saved runs, newest first: label -> folder (each holds result.json and steps.csv)."""
    runs = sorted((p for p in folder.glob("*/result.json")), reverse=True) if folder.exists() else []
    return {p.parent.name: p.parent for p in runs}


def saved_loss_curve(folder: Path) -> Any:
    import pandas as pd

    return pd.read_csv(folder / "steps.csv").groupby("step")["loss"].mean()


class Lab:
    """The strategy picker, Run/Stop, live progress, the result, and the comparison panel."""

    def __init__(self, history: Path | str = HISTORY, **defaults: Any) -> None:
        self.history = Path(history)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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
        self.bucket = w.FloatLogSlider(value=25.0, base=10, min=-4, max=2, step=0.1, readout_format=".3g",
                                       description="bucket MB", style=style)
        self.hook = w.Dropdown(options=["allreduce", "fp16", "bf16", "powersgd"], description="comm hook", style=style)
        # Link caps need network namespaces (root); elsewhere only loopback nodes are offered, and why is shown.
        self._netns, self._netns_reason = netns.available()
        self.link = w.Dropdown(options=LINK_CAPS if self._netns else LINK_CAPS[:1], value=0.0,
                               description="link cap", style=style)
        self.fault = w.Dropdown(options=FAULTS, value=defaults.get("fault", "none"), description="fault",
                                style=style)
        self.last_result: Any = None  # the latest finished run's RunResult
        self.message = w.HTML()
        self.run_button = w.Button(description="Run", button_style="success", icon="play")
        self.stop_button = w.Button(description="Stop", button_style="danger", icon="stop", disabled=True)
        self.run_button.add_class("dtlab-run")
        self.stop_button.add_class("dtlab-stop")
        self.bars = w.VBox()
        self.live = w.Image(format="png")
        self.status = w.HTML()
        self.status.add_class("dtlab-status")
        self.result = w.VBox()
        self.result.add_class("dtlab-result")
        self.log = w.Output(layout={"border": "1px solid #ddd", "max_height": "200px", "overflow": "auto"})
        self.compare_pick = w.SelectMultiple(description="runs", rows=6, style=style, layout={"width": "95%"})
        self.compare_button = w.Button(description="Compare selected", icon="line-chart")
        self.refresh_button = w.Button(description="Refresh", icon="refresh")
        self.compare_out = w.VBox()
        for control in (self.tier, self.world_size, self.model, self.model_size, self.batch, self.steps,
                        self.bucket, self.hook, self.link, self.fault):
            control.observe(self._guard(self._validate), names="value")
        self.run_button.on_click(self._guard(self._start))
        self.stop_button.on_click(self._guard(lambda _b: self._stop.set()))
        self.compare_button.on_click(self._guard(self._compare))
        self.refresh_button.on_click(self._guard(lambda _b: self._refresh_history()))
        self._refresh_history()
        self._validate()

    # -- layout --------------------------------------------------------------------
    @property
    def widget(self) -> w.Widget:
        knobs = w.VBox([self.tier, self.world_size, self.model, self.model_size, self.batch, self.steps,
                        self.bucket, self.hook, self.link, self.fault])
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

    # -- callbacks -----------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Errors in a callback go to the panel's log (ipywidgets would drop them)."""

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except Exception:
                self.log.append_stderr(traceback.format_exc())
                return None

        return wrapped

    def config(self) -> RunConfig:
        """The RunConfig the controls describe (raises ValueError naming what is wrong)."""
        tier = self.tier.value
        options = None
        world = 1 if tier == "single" else self.world_size.value
        if tier in BUCKETED:
            knobs: dict[str, Any] = {"bucket_cap_mb": self.bucket.value, "comm_hook": self.hook.value}
            if tier == "multinode":
                knobs.update(nnodes=2 if world % 2 == 0 else 1, link_mbit=self.link.value,
                             network="netns" if self.link.value else "loopback")
            if tier == "elastic" and self.fault.value != "none":
                knobs["faults"] = (self.fault_spec(),)
            options = tiers.get(tier).Options(**knobs)
        text = self.model.value == "charformer"
        return RunConfig(tier=tier, world_size=world,
                         model=self.model.value, model_size=self.model_size.value,
                         dataset="text" if text else "digits", global_batch_size=self.batch.value,
                         steps=self.steps.value, lr=0.003 if text else 0.01, tier_options=options)

    def fault_spec(self) -> str:
        """The picked fault as the elastic tier's "KIND:STEP:RANK": halfway through, on the last rank."""
        return f"{self.fault.value}:{max(1, self.steps.value // 2)}:{self.world_size.value - 1}"

    def _notes(self, tier: str) -> str:
        if tier == "multinode":
            note = ("each node its own network namespace, its link capped with tc tbf" if self._netns
                    else f"link caps unavailable: {self._netns_reason}")
        elif tier == "elastic":
            note = (f"fault {self.fault_spec()} (kind:step:rank): the run restarts from its last snapshot"
                    if self.fault.value != "none" else "pick a fault to watch the run restart from a snapshot")
        else:
            note = "link cap: multinode tier only; fault: elastic tier only"
        return f"<i>{note}</i>"

    def _validate(self, _change: Any = None) -> None:
        tier = self.tier.value
        self.world_size.disabled = tier == "single"
        self.bucket.disabled = self.hook.disabled = tier not in BUCKETED
        self.link.disabled = tier != "multinode"
        self.fault.disabled = tier != "elastic"
        try:
            cfg = self.config()
        except ValueError as exc:
            self.message.value = f"<span style='color:#b00'>cannot run this: {exc}</span><br>" + self._notes(tier)
            self.run_button.disabled = True
            return
        procs = tiers.get(tier).processes(cfg)
        self.message.value = (f"<span style='color:#070'>ready: {tier}, {cfg.world_size} rank(s) in {procs} "
                              f"process(es), per-rank batch {cfg.per_rank_batch}</span><br>" + self._notes(tier))
        self.run_button.disabled = self._thread is not None and self._thread.is_alive()

    def _start(self, _button: Any = None) -> None:
        cfg = self.config()
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
        self.config()  # a bad combination raises its ValueError here rather than only in the panel
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
        from dtlab.launcher import LaunchStopped
        from dtlab.train import run

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
            self.run_button.disabled, self.stop_button.disabled = False, True
        if live:
            self.live.value = _png(self._live_figure(live, throughput))  # the last points too
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        folder = result.save(self.history / f"{stamp}-{cfg.tier}-w{cfg.world_size}")
        self.last_result = result
        self._show_result(result, folder)
        self._refresh_history()

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
        from dtlab import plots
        from dtlab.analysis import breakdown_frame

        s = result.summary()
        rows = {"tier": s["tier"], "world size": s["world_size"], "median step": f"{s['median_step_s'] * 1e3:.2f} ms",
                "throughput": f"{s['samples_per_s']:.0f} samples/s", "final loss": f"{s['final_loss']:.4f}",
                "test accuracy": f"{s.get('test_accuracy', float('nan')):.3f}",
                "collectives per step": f"{sum(v['calls_per_step'] for v in s['comm'].values()):.1f}",
                "saved in": str(folder)}
        images = [w.Image(value=_png(plots.loss_curves({result.label: result.loss_curve()})), format="png"),
                  w.Image(value=_png(plots.step_breakdown(breakdown_frame([result]))), format="png")]
        if result.config.tier == "elastic":
            from dtlab.tiers.elastic import timeline

            images.append(w.Image(value=_png(plots.elastic_timeline(timeline(result))), format="png"))
        self.result.children = [w.HTML(_table(rows)), *images]
        # "finished" only once the result is on screen: whoever waits for it may read the result at once
        self.status.value = f"<b>finished</b>: {result.label} in {result.wall_s:.1f} s"

    def _refresh_history(self) -> None:
        runs = load_history(self.history)
        self.compare_pick.options = list(runs)

    def _compare(self, _button: Any = None) -> None:
        from dtlab import plots

        runs = load_history(self.history)
        picked = [name for name in self.compare_pick.value if name in runs]
        if not picked:
            self.compare_out.children = [w.HTML("<i>pick one or more saved runs above</i>")]
            return
        curves = {name: saved_loss_curve(runs[name]) for name in picked}
        rows = []
        for name in picked:
            s = json.loads((runs[name] / "result.json").read_text())
            rows.append(f"<tr><td>{name}</td><td>{s['median_step_s'] * 1e3:.2f} ms</td>"
                        f"<td>{s['samples_per_s']:.0f}</td><td>{s['final_loss']:.4f}</td></tr>")
        table = ("<table><tr><th>run</th><th>median step</th><th>samples/s</th><th>final loss</th></tr>"
                 + "".join(rows) + "</table>")
        self.compare_out.children = [w.HTML(table), w.Image(value=_png(plots.loss_curves(curves)), format="png")]


def lab(**defaults: Any) -> Lab:
    """The dtlab panel; display it by leaving it as a cell's last expression."""
    return Lab(**defaults)
