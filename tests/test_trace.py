"""``dtlab trace``: unmodified torchrun scripts (tests/scripts) recorded, their bytes per step against the formula."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import psutil
import pytest

from dtlab import read
from dtlab.app import cli, history
from dtlab.launch import trace
from dtlab.plots import runs as run_plots
from tests.conftest import leftover_processes

SCRIPTS = Path(__file__).parent / "scripts"
F32 = 4


def _trace(tmp_path: Path, script: str, *flags: str, capsys: pytest.CaptureFixture[str] | None = None) -> Path:
    out = tmp_path / "out"
    code = cli.main(["trace", "--out", str(out), *flags, "--", "torchrun", "--standalone", "--nproc-per-node", "2",
                     str(SCRIPTS / script)])
    assert code == 0, capsys.readouterr().err if capsys else code
    return out


def _per_step(out: Path, op: str) -> set[float]:
    """Bytes of ``op`` per step on each rank (steps 0..2; -1 is set-up), as one set: every step and rank alike."""
    ev = pd.read_csv(out / "events.csv")
    ev = ev[(ev["op"] == op) & (ev["step"] >= 0)]
    return set(ev.groupby(["rank", "step"])["bytes"].sum())


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_a_plain_ddp_script_all_reduces_its_parameter_bytes_every_step(tmp_path, capsys):
    out = _trace(tmp_path, "ddp_train.py", capsys=capsys)
    params = (16 * 32 + 32 + 32 * 4 + 4) * F32
    assert _per_step(out, "all_reduce") == {params}
    summary = json.loads((out / "result.json").read_text())
    assert summary["steps"] == 3 and summary["world_size"] == 2 and summary["tier"] == "trace"
    assert summary["comm"]["all_reduce"]["bytes_per_step"] == params
    assert summary["memory_rank0"]["parameters"] == params == summary["memory_rank0"]["gradients"]
    ev = pd.read_csv(out / "events.csv")
    assert set(ev.loc[ev["step"] < 0, "op"]) >= {"broadcast"}  # DDP's set-up broadcast, before the first forward
    trace_json = json.loads((out / "trace.json").read_text())
    assert {e["pid"] for e in trace_json["traceEvents"]} == {0, 1}
    saved = history.read_run(out)  # the run panel's comparison reads it as it reads a run's folder
    assert len(saved.loss) == 3 and saved.loss.notna().all()


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_an_fsdp2_script_all_gathers_each_block_twice_and_reduce_scatters_it_once(tmp_path, capsys):
    out = _trace(tmp_path, "fsdp2_train.py", capsys=capsys)
    block = (16 * 16 + 16) * F32  # each block's parameters, evenly sharded over 2 ranks (no padding)
    # fully_shard per block: gathered in forward, resharded, gathered again in backward; gradients reduce-scattered
    assert _per_step(out, "all_gather_into_tensor") == {2 * 3 * block}
    assert _per_step(out, "reduce_scatter_tensor") == {3 * block}
    summary = json.loads((out / "result.json").read_text())
    assert summary["memory_rank0"]["parameters"] == 3 * block // 2  # a rank holds its shard


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_a_pre_bound_all_reduce_of_the_gradients_is_recorded_and_reads_like_a_run():
    result, code = trace.run(["torchrun", "--standalone", "--nproc-per-node", "2",
                              str(SCRIPTS / "custom_allreduce.py")])
    assert code == 0 and result is not None
    ev = result.events_frame()
    ev = ev[ev["step"] >= 0]
    assert set(ev["op"]) == {"all_reduce"}
    assert set(ev.groupby(["rank", "step"])["bytes"].sum()) == {(10 * 6 + 6) * F32}
    assert (ev.groupby(["rank", "step"]).size() == 2).all()  # weight and bias, one call each
    # read and plotted by the functions a run's result goes through
    assert list(read.memory_frame([result])["parameters"]) == [(10 * 6 + 6) * F32] * 2
    run_plots.memory_breakdown(read.memory_frame([result]))
    run_plots.timeline(result.events_frame(), result.phases_frame())


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_a_script_where_one_rank_skips_a_collective_is_named_by_rank_and_collective(tmp_path, capsys):
    out = tmp_path / "hang"
    code = cli.main(["trace", "--out", str(out), "--flight-recorder", "--timeout", "5", "--", "torchrun",
                     "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "hang.py")])
    err = capsys.readouterr().err
    assert code != 0
    assert "rank 1 never issued all_reduce" in err and "rank 1 skipped it" in err, err
    assert sorted(p.name for p in (out / "flight_recorder").iterdir()) == ["rank_0", "rank_1"]
    assert read.flight.diagnosis(str(out / "flight_recorder")).rank == 1


BAD = [([], "no command to trace"), (["--", "bash", "train.sh"], "traces a torchrun or python command"),
       (["--", "torchrun", "--nproc-per-node", "2", "missing.py"], "missing.py: no such script"),
       (["--", "python", "missing.py"], "missing.py: no such script"),
       (["--", "torchrun", "--nproc-per-node", "2"], "torchrun: the following arguments are required")]


@pytest.mark.parametrize("argv,said", BAD)
def test_bad_input_is_one_line_and_exit_2_with_nothing_started(tmp_path, capsys, argv, said):
    assert cli.main(["trace", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists() and not leftover_processes(wait_s=0)


def test_the_traced_command_keeps_torchruns_options_and_puts_the_recorder_before_the_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    traced = trace.command(["torchrun", "--standalone", "--nproc-per-node", "2", str(script), "--lr", "1"])
    assert traced.world_size == 2 and traced.script == str(script)
    assert traced.argv[1:] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                               "dtlab.launch.traced", str(script), "--lr", "1"]
    module = trace.command(["python", "-m", "torch.distributed.run", "--nproc-per-node=3", "-m", "pkg.train"])
    assert module.world_size == 3 and module.argv[-4:] == ["-m", "dtlab.launch.traced", "-m", "pkg.train"]


MARKED = """
import torch, torch.distributed as dist
import dtlab
dist.init_process_group("gloo")
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    for _ in range(2):  # two optimizer steps per marked step: the marker, not the optimizer, ends the step
        model(torch.ones(1, 3)).sum().backward()
        dist.all_reduce(model.weight.grad)
        opt.step()
    dtlab.trace_step()
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.usefixtures("no_survivors")
def test_with_step_marker_the_scripts_own_marks_end_the_steps(tmp_path):
    script = tmp_path / "marked.py"
    script.write_text(MARKED)
    result, code = trace.run(["torchrun", "--standalone", "--nproc-per-node", "2", str(script)], step="marker")
    assert code == 0 and result is not None and result.config.steps == 2
    ev = result.events_frame()
    assert sorted(ev.loc[ev["op"] == "all_reduce", "step"]) == [0, 0, 0, 0, 1, 1, 1, 1]


SLEEPER = """
import time, torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
if dist.get_rank() == 0:  # one line: two ranks' prints can interleave into "readyready"
    print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_every_process_the_trace_started_ends_when_it_is_killed(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    cli_proc = subprocess.Popen([sys.executable, "-m", "dtlab", "trace", "--out", str(tmp_path / "out"), "--",
                                 "torchrun", "--standalone", "--nproc-per-node", "2", str(script)],
                                stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        assert cli_proc.stdout.readline().strip() == "ready"
        family = psutil.Process(cli_proc.pid).children(recursive=True)
        assert sum("dtlab.launch.traced" in " ".join(p.cmdline()) for p in family) >= 2
    finally:
        cli_proc.kill()
        cli_proc.wait()
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]


def _sigint_as_a_shell_gives_it() -> None:
    """In the CLI's process before it starts: SIGINT at its default and not blocked, whatever the test process
    inherited from earlier tests' libraries (an ignored or blocked SIGINT is passed on to a child)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _tree(pid: int) -> list[str]:
    """``pid`` and its descendants: pid, status, threads' wait channel and command line."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            wchan = Path(f"/proc/{p.pid}/wchan").read_text() if Path(f"/proc/{p.pid}/wchan").exists() else "?"
            out.append(f"{p.pid} {p.status()} {wchan} {' '.join(p.cmdline())[:100]}")
        except (psutil.Error, OSError):
            continue
    return out


STUCK = """
import threading, time, torch, torch.distributed as dist
dist.init_process_group("gloo")
dist.all_reduce(torch.ones(4))
if dist.get_rank() == 1:
    time.sleep(600)  # never reaches the all-reduce rank 0 waits in
# rank 0 says so from a thread once it is inside its second all-reduce (one rank prints: two ranks' prints
# could interleave into "readyready")
threading.Timer(0.5, lambda: print("ready", flush=True)).start()
dist.all_reduce(torch.ones(4))
"""


@pytest.mark.slow
@pytest.mark.usefixtures("default_sigint")  # else the CLI inherits an ignored SIGINT from an earlier test's library
def test_ctrl_c_on_a_hang_saves_what_the_ranks_recorded_and_names_the_rank(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text(STUCK)
    out = tmp_path / "out"
    cli_proc = subprocess.Popen([sys.executable, "-m", "dtlab", "trace", "--out", str(out), "--flight-recorder",
                                 "--", "torchrun", "--standalone", "--nproc-per-node", "2", str(script)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=Path(__file__).parents[1], preexec_fn=_sigint_as_a_shell_gives_it)
    try:
        assert cli_proc.stdout.readline().strip() == "ready"
        family = psutil.Process(cli_proc.pid).children(recursive=True)
        cli_proc.send_signal(signal.SIGINT)
        try:
            _, err = cli_proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            alive = _tree(cli_proc.pid)  # what was still running says where it waited
            cli_proc.kill()
            pytest.fail(f"dtlab trace did not end within 120 s of Ctrl-C; still running: {alive}; "
                        f"it printed:\n{cli_proc.communicate()[1]}")
    finally:
        cli_proc.kill()
    assert cli_proc.returncode == 130, err
    assert "stopped (Ctrl-C)" in err and "rank 1 never issued all_reduce #2" in err, err
    ev = pd.read_csv(out / "events.csv")
    assert list(ev.loc[ev["rank"] == 0, "op"]) == ["all_reduce", "all_reduce"]  # the one it waits in, too
    assert list(ev.loc[ev["rank"] == 1, "op"]) == ["all_reduce"]
    _, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
