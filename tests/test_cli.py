"""The command line writes the four result files, and refuses bad input in one line."""

from __future__ import annotations

import dataclasses
import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from dtlab import tiers
from dtlab.app import commands, flags, saving
from dtlab.app.cli import main
from dtlab.core import options
from dtlab.core.results import RunResult, load_params
from dtlab.cost import estimate as estimate_module

pytestmark = pytest.mark.usefixtures("no_survivors")


def test_single_tier_writes_all_files_and_they_load(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "dtlab", "run", "--tier", "single", "--world-size", "1",
                           "--steps", "12", "--out", str(out), "--quiet"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "result.json").read_text())
    assert summary["tier"] == "single" and summary["world_size"] == 1 and summary["steps"] == 12
    for key in ("median_step_s", "samples_per_s", "final_loss", "test_accuracy", "comm", "memory_rank0"):
        assert key in summary
    assert {"parameters", "gradients", "optimizer_state", "activations", "peak_rss"} <= set(summary["memory_rank0"])
    assert summary["provenance"]["torch"] == torch.__version__
    events = pd.read_csv(out / "events.csv")
    assert list(events.columns[:4]) == ["rank", "seq", "op", "bytes"]
    trace = json.loads((out / "trace.json").read_text())
    assert any(e.get("name") == "forward" for e in trace["traceEvents"])
    params = load_params(out / "params.pt")
    assert set(params) == {"1.weight", "1.bias", "3.weight", "3.bias", "5.weight", "5.bias"}
    assert not list(out.glob("*.tmp"))


def test_ddp_tier_options_and_comm_counts(tmp_path, capsys):
    out = tmp_path / "ddp"
    code = main(["run", "--tier", "ddp", "--world-size", "2", "--steps", "5", "--out", str(out), "--quiet",
                 "--opt", "bucket_cap_mb=0.01", "--threads", "1"])
    assert code == 0
    summary = json.loads((out / "result.json").read_text())
    assert summary["config"]["tier_options"]["bucket_cap_mb"] == 0.01
    buckets = summary["strategy"]["num_buckets"]
    assert buckets > 1
    # steps 1-4 reduce every bucket once; step 0 runs before DDP rebuilds its buckets (one bucket)
    assert summary["comm"]["all_reduce"]["calls"] == 1 + 4 * buckets
    assert "ddp x2" in capsys.readouterr().out


@pytest.fixture
def nothing_runs(monkeypatch):
    """Any attempt to start a rank fails the test: bad input must be refused before."""
    def refuse(*_args, **_kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(commands, "run", refuse)
    monkeypatch.setattr(commands, "compare", refuse)


@pytest.mark.parametrize("argv,message", [
    (["run", "--tier", "ddp", "--world-size", "0"], "--world-size: RunConfig.world_size=0 is invalid"),
    (["run", "--tier", "ddp", "--world-size", "3"], "--batch-size: RunConfig.global_batch_size=64"),
    (["run", "--tier", "ddp", "--opt", "bucket_cap_mb=-1"], "--opt bucket_cap_mb=-1: ddp tier_options.bucket_cap_mb"),
    (["run", "--tier", "ddp", "--opt", "bucket_cap_mb=abc"], "--opt bucket_cap_mb=abc: expected a number (float)"),
    (["run", "--tier", "ddp", "--opt", "accumulation_steps=1.5"], "--opt accumulation_steps=1.5: expected an integer"),
    (["run", "--tier", "ddp", "--opt", "broadcast_buffers=maybe"], "--opt broadcast_buffers=maybe: expected a boolean"),
    (["run", "--tier", "ddp", "--opt", "no_such=1"], "--opt no_such=1: tier 'ddp' has no option 'no_such'; "
                                                    "it takes: bucket_cap_mb, gradient_as_bucket_view"),
    (["run", "--tier", "ddp", "--opt", "bucket_cap_mb"], "--opt bucket_cap_mb: is not KEY=VALUE"),
    (["run", "--opt", "x=1"], "it takes: no options"),
    (["run", "--tier", "elastic", "--world-size", "2", "--steps", "20", "--opt", "faults=sigkill:7:1,bogus:3"],
     "--opt faults=sigkill:7:1,bogus:3: elastic tier_options.faults entry 'bogus:3' is invalid"),
    (["run", "--tier", "elastic", "--world-size", "2", "--steps", "20", "--opt", "faults=sigkill:70:1"],
     "step 70 is beyond the run"),
    (["run", "--tier", "ddp", "--opt", f"resume_from={Path('/nonexistent/dtlab-ckpt')}"],
     "--opt resume_from=/nonexistent/dtlab-ckpt: ddp tier_options.resume_from"),  # preflight
    (["run", "--model", "nowhere.module:factory"], "--model: RunConfig.model"),
    (["run", "--out", "/proc/nope/run"], "--out /proc/nope/run: cannot create or write this folder"),
    (["compare", "--tiers", "single,teleport"], "--tiers single,teleport: unknown tier 'teleport'"),
    (["compare", "--world-sizes", "2,x"], "--world-sizes 2,x: 'x' is not an integer"),
    (["compare", "--world-sizes", ","], "--world-sizes ',': give one or more"),
    (["compare", "--tiers", "ddp", "--world-sizes", "3"], "--batch-size: RunConfig.global_batch_size=64"),
    (["compare", "--out", "/proc/nope"], "--out /proc/nope: cannot create or write this folder"),
])
def test_bad_input_is_one_line_and_exit_code_2_before_any_run(argv, message, capsys, nothing_runs):
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["run", "--device", "cuda"], "--device: RunConfig.device='cuda' is invalid on this machine"),
    (["run", "--backend", "nccl"], "--backend: RunConfig.backend='nccl' is invalid on this machine"),
    (["compare", "--tiers", "ddp", "--device", "cuda"], "--device: RunConfig.device='cuda' is invalid"),
])
def test_cuda_on_a_machine_without_it_is_one_line_before_any_process(argv, message, monkeypatch, capsys,
                                                                      nothing_runs):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA, on whatever machine runs this
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}"), err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_bad_flag_value_is_one_line_too(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--steps", "x"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: argument --steps: invalid int value: 'x'") and err.count("\n") == 1


def test_a_good_out_folder_is_checked_without_a_trace(tmp_path):
    folder = tmp_path / "a" / "b" / "run"
    assert saving.check_writable(folder, "--out") == folder
    assert not (tmp_path / "a").exists()  # the probe's folders are removed again
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="--out .*file/run: cannot create"):
        saving.check_writable(blocker / "run", "--out")


def test_a_failing_save_keeps_the_finished_run(tmp_path, monkeypatch, capsys):
    saved = []

    class Result:
        def save(self, out):
            if str(out).startswith(str(tmp_path)):
                raise PermissionError(13, "Permission denied")
            saved.append(Path(out))
            return Path(out)

    folder, ok = saving.save_result(Result(), tmp_path / "run")
    assert not ok and saved == [folder] and folder.is_dir()
    err = capsys.readouterr().err
    assert f"could not write --out {tmp_path / 'run'} (Permission denied)" in err and str(folder) in err
    folder.rmdir()


def test_a_run_whose_save_fails_is_saved_elsewhere(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real_save = RunResult.save

    def save(self, folder):
        if Path(folder) == out:
            raise OSError(28, "No space left on device")
        return real_save(self, folder)

    monkeypatch.setattr(RunResult, "save", save)
    assert main(["run", "--steps", "4", "--out", str(out), "--quiet", "--threads", "1"]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert err.count("\n") == 1 and f"could not write --out {out} (No space left on device)" in err
    fallback = Path(err.rsplit(" saved in ", 1)[1].split(" instead")[0])
    assert (fallback / "result.json").exists() and f"wrote {fallback}/result.json" in captured.out
    shutil.rmtree(fallback)


def _option_values(default):
    """The default and another value of the same kind, to write on the command line and read back."""
    if isinstance(default, bool):
        return [default, not default]
    if isinstance(default, int | float):
        return [default, type(default)(default * 2 + 3)]
    if isinstance(default, tuple):
        return [default, ("sigkill:7:1", "exception:12:0"), ("one",)]
    return [default, "other"]


@pytest.mark.parametrize("tier", tiers.TIERS)
def test_every_option_of_every_tier_can_be_given_on_the_command_line(tier):
    spec = tiers.get(tier)
    defaults = spec.options()
    for field in dataclasses.fields(spec.options):
        for value in _option_values(getattr(defaults, field.name)):
            given = flags.tier_options(tier, [f"{field.name}={options.format(value)}"])
            assert getattr(given, field.name) == value and type(getattr(given, field.name)) is type(value), field
    for raw in ("true", "True", "1", "yes", "false", "0", "no", "NO"):  # every bool spelling
        assert options.parse("bool", raw) is (raw.lower() in ("true", "1", "yes"))


def test_a_tuple_option_adds_up_over_repeated_opts():
    o = flags.tier_options("elastic", ["faults=sigkill:7:1", "faults=exception:12:0,oom:3"])
    assert o.faults == ("sigkill:7:1", "exception:12:0", "oom:3")
    assert flags.tier_options("elastic", ["faults="]).faults == ()


def test_compare_reports_parity_for_each_tier(tmp_path, capsys):
    code = main(["compare", "--tiers", "single,ddp-naive,ddp", "--world-sizes", "2", "--steps", "6", "--out",
                 str(tmp_path), "--quiet", "--threads", "1"])
    assert code == 0
    table = pd.read_csv(tmp_path / "compare.csv")
    assert list(table["tier"]) == ["single", "ddp-naive", "ddp"]
    assert (table["max_param_diff_vs_single"] <= 1e-5).all()
    assert (tmp_path / "ddp-w2" / "result.json").exists()
    # each figure with the data it draws beside it
    assert pd.read_csv(tmp_path / "speedup.csv")["tier"].tolist() == ["single", "ddp-naive", "ddp"]
    losses = pd.read_csv(tmp_path / "loss.csv")
    assert losses.groupby("run")["step"].count().tolist() == [6, 6, 6]
    for name in ("breakdown", "memory"):
        assert (tmp_path / f"{name}.png").exists() and len(pd.read_csv(tmp_path / f"{name}.csv")) > 0


def test_exercises_are_listed_and_described_from_the_shell(capsys):
    assert main(["exercises"]) == 0
    listed = capsys.readouterr().out
    assert all(name in listed for name in ("ring_allreduce", "naive_ddp", "zero1_step"))
    assert main(["exercises", "ring_allreduce"]) == 0
    assert "(r + 1) % n" in capsys.readouterr().out
    assert main(["exercises", "nope"]) == 2
    assert "no exercise named 'nope'" in capsys.readouterr().err


def test_estimate_passes_compute_and_refuses_it_without_a_link(monkeypatch, capsys):
    seen = {}

    def fake(cfg, link, compute="timed"):
        seen.update(link=link, compute=compute)
        raise ValueError("stop here")

    monkeypatch.setattr(estimate_module, "estimate", fake)
    assert main(["estimate", "--tier", "ddp", "--world-size", "2", "--link", "200", "--compute", "predicted"]) == 2
    assert seen["compute"] == "predicted" and seen["link"] is not None
    capsys.readouterr()
    seen.clear()
    assert main(["estimate", "--compute", "predicted"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --compute predicted: the compute is priced only with --link") and not seen


FRONT_DOOR = """
import sys
from dtlab.app import cli
import dtlab
lines = [["--help"], ["run", "--help"], ["run", "--no-such-flag"], ["run", "--tier", "no-such-tier"],
         ["run", "--tier", "ddp", "--steps", "0"], ["compare", "--tiers", "ddp,nope"], ["cluster", "--help"],
         ["trace", "--help"]]
for argv in lines:
    try:
        code = cli.main(argv)
    except SystemExit as stop:
        code = stop.code
    print("@@", argv[-1], code, sorted(m for m in sys.modules if m == "torch" or m.startswith("dtlab.tiers.")))
"""


def test_help_and_a_bad_flag_are_answered_before_torch_or_a_tier_is_imported():
    done = subprocess.run([sys.executable, "-c", FRONT_DOOR], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    answers = [line.split(" ", 3)[1:] for line in done.stdout.splitlines() if line.startswith("@@ ")]
    assert [(flag, code) for flag, code, _ in answers] == [
        ("--help", "0"), ("--help", "0"), ("--no-such-flag", "2"), ("no-such-tier", "2"), ("0", "2"),
        ("ddp,nope", "2"), ("--help", "0"), ("--help", "0")]
    assert {loaded for *_, loaded in answers} == {"[]"}, done.stdout
    assert "--tiers ddp,nope: unknown tier 'nope'" in done.stderr


def test_the_registry_names_every_tier_without_importing_one_and_each_module_declares_its_name():
    from dtlab import tiers
    from dtlab.core import registry

    assert tiers.TIERS == registry.COURSE and len(set(registry.COURSE)) == len(registry.COURSE)
    for name in registry.COURSE:
        module = importlib.import_module(registry.module_name(name))
        assert module.SPEC.name == name and registry.get(name) is module.SPEC
    assert set(registry.CLUSTER) <= set(registry.COURSE)
    with pytest.raises(ValueError, match="unknown tier 'nope': choose one of single, dp"):
        registry.get("nope")


def test_the_tiers_folder_lists_the_course_and_its_parts_live_below_it():
    from dtlab import tiers

    folder = Path(tiers.__file__).parent
    modules = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    assert modules == {name.replace("-", "_") for name in tiers.TIERS}, "a helper belongs in dtlab/tiers/parts/"
    assert (folder / "parts" / "base.py").is_file()


def test_fault_tolerance_goes_by_one_name_in_every_layer():
    """A learner looking for ft finds it by its name: no replica(s) module beside it in any layer."""
    from dtlab import tiers

    package = Path(tiers.__file__).parents[1]
    assert sorted(str(p.relative_to(package)) for p in package.rglob("ft.py")) == [
        "core/ft.py", "launch/ft.py", "read/ft.py", "tiers/ft.py", "tiers/parts/ft.py", "train/ft.py"]
    assert not [p for p in package.rglob("replica*.py")]


def test_no_tier_reaches_into_another_or_builds_its_strategy_and_one_place_builds_meshes():
    import ast

    from dtlab import tiers

    folder = Path(tiers.__file__).parent
    names = {name.replace("-", "_") for name in tiers.TIERS}
    borrowed = []
    for path in sorted(folder.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names \
                    and node.value.id != path.stem and (node.attr.startswith("_") or node.attr == "Strategy") \
                    and not any(isinstance(b, ast.ClassDef) and node in b.bases for b in ast.walk(tree)):
                borrowed.append(f"{path.name}:{node.lineno} {node.value.id}.{node.attr}")
    assert not borrowed, f"compose through public functions, not another tier's privates or Strategy: {borrowed}"
    calls = [str(p.relative_to(folder.parents[1])) for p in folder.parents[1].joinpath("dtlab").rglob("*.py")
             if "init_device_mesh(" in p.read_text()]
    assert calls == ["dtlab/core/mesh.py"], calls


def test_the_front_door_figures_the_docs_quote_are_the_committed_results():
    root = Path(__file__).resolve().parents[1]
    rows = pd.read_csv(root / "docs" / "figures" / "front_door.csv")
    medians = rows[rows["round"] >= 0].groupby("variant")["seconds"].median()
    torch_free = medians.drop(["python -c pass", "a bad --opt (imports the tier)"])
    page = (root / "docs" / "measurement.md").read_text()
    assert torch_free.max() <= 1.0 and rows["round"].max() + 1 >= 10
    assert f"the slowest of them, `{torch_free.idxmax()}`, answered in a median of {torch_free.max():.3f} s" in page
    assert f"`python -c pass`\n{medians['python -c pass']:.3f} s" in page
    assert f"so torch and that tier: {medians['a bad --opt (imports the tier)']:.2f} s" in page
