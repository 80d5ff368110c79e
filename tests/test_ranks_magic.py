"""``%%ranks``: cells on persistent ranks in a real Jupyter kernel, and the checks of its line and names.

The kernel tests share one kernel (starting one, and its forkserver with torch preloaded, is most of their
time); each test starts the ranks it needs, so any one of them runs alone too. The last one kills a kernel.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from IPython.core.error import UsageError
from jupyter_client.manager import start_new_kernel

import dtlab
from dtlab.app.ranks import cell_names, names_to_send, parse, placement

REPO = Path(dtlab.__file__).resolve().parents[1]
GONE_WITHIN_S = 10.0


# -- the line and the names, no process -------------------------------------------------------------------------
@pytest.mark.parametrize("line, message", [
    ("0", "N=0 is invalid"),
    ("-2", "N=-2 is invalid"),
    ("", "give the number of ranks"),
    ("two", "invalid int value: 'two'"),
    ("2 --bogus", "unrecognized arguments: --bogus"),
    ("2 --backend mpi", "invalid choice: 'mpi'"),
    ("2 --timeout 0", "--timeout 0 is invalid"),
    ("2 --out 1x", "--out '1x' is invalid"),
    ("2 --out 'a", "No closing quotation"),
])
def test_bad_lines_are_one_usage_error_naming_the_mistake(line, message):
    with pytest.raises(UsageError) as info:
        parse(line)
    text = str(info.value)
    assert message in text and "\n" not in text


def test_what_a_line_leaves_out_is_the_running_ranks_setting():
    first = parse("4 --timeout 5 --flight-recorder")
    assert (first.world_size, first.backend, first.timeout_s, first.flight_recorder) == (4, "auto", 5.0, True)
    later = parse("--out r", first)
    assert later.same_ranks(first) and later.out == "r"
    assert not parse("2", first).same_ranks(first)
    assert not parse("4 --no-flight-recorder", first).same_ranks(first)


def test_nccl_without_a_gpu_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(UsageError, match="--backend nccl needs CUDA devices"):
        placement("nccl", 2)
    assert placement("auto", 2) == ("gloo", "cpu")


def test_only_the_names_a_cell_reads_are_sent_and_an_unpicklable_one_is_named():
    ns = {"lr": 0.1, "lock": threading.Lock(), "model": object(), "_5": 1, "In": [], "unused": 2, "rank": 7}
    code = "model.step(lr)\nprint(_5, In, rank)\n"
    assert cell_names(code) == ({"model", "lr", "print", "_5", "In", "rank"}, set())
    sent = names_to_send(code, ns, hidden={"In"}, owned={"model"})
    assert sorted(sent) == ["lr"]  # the ranks' own model, IPython's names and the preset rank stay out
    with pytest.raises(UsageError, match=r"cannot send lock \(TypeError: cannot pickle") as info:
        names_to_send("print(lock)", ns, hidden=set(), owned=set())
    assert "\n" not in str(info.value)
    # A cell that makes its own lock needs nothing from the notebook's
    assert names_to_send("import threading\nlock = threading.Lock()\nlock.acquire()", ns, set(), set()) == {}
    with pytest.raises(UsageError, match="does not parse"):
        names_to_send("def f(:\n", ns, set(), set())


# -- in a real kernel -------------------------------------------------------------------------------------------
class Kernel:
    """A Jupyter kernel (jupyter_client, as nbclient drives it) running cells one at a time."""

    def __init__(self, folder: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg"}
        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=str(folder), env=env, startup_timeout=120)
        self.pid = int(self.run("import os; print(os.getpid())")[0])

    def run(self, code: str, timeout: float = 240, interrupt_after_s: float | None = None) -> tuple[str, str]:
        """(what the cell printed, its error's name and the traceback shown, one line each; "" if none);
        ``interrupt_after_s``: press the notebook's stop button that long after the cell starts."""
        printed, error = [], []
        if interrupt_after_s is not None:
            threading.Timer(interrupt_after_s, self.km.interrupt_kernel).start()

        def hook(msg: dict) -> None:
            content = msg["content"]
            if msg["msg_type"] == "stream":
                (error if content["name"] == "stderr" and "UsageError" in content["text"] else printed).append(
                    content["text"])
            elif msg["msg_type"] == "error":
                error.append("\n".join([content["ename"], *content["traceback"]]))

        self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        return "".join(printed), "".join(error)

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def close(self) -> None:
        self.kc.stop_channels()
        with contextlib.suppress(Exception):
            self.km.shutdown_kernel(now=True)


def gone(pids: list[int], within_s: float = GONE_WITHIN_S) -> list[int]:
    """Those of ``pids`` still running (not zombies) after at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while True:
        alive = []
        for pid in pids:
            with contextlib.suppress(psutil.NoSuchProcess):
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def rank_pids(kernel: Kernel) -> list[int]:
    out, err = kernel.run("import dtlab.app.ranks as _r\nprint(*_r.session(get_ipython()).pids)")
    assert not err, err
    return [int(p) for p in out.split()]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory):
    k = Kernel(tmp_path_factory.mktemp("ranks-kernel"))
    assert k.run("%load_ext dtlab") == ("", "")
    yield k
    k.close()


@pytest.mark.slow
def test_a_cell_on_4_ranks_returns_its_collectives_and_the_next_cell_sees_its_state(kernel):
    out, err = kernel.run("%%ranks 4\nx = torch.ones(4) * (rank + 1)\ndist.all_reduce(x)\nprint(x.tolist())\n"
                          "seen = rank * 10")
    assert not err, err
    for r in range(4):
        assert f"[rank {r}] [10.0, 10.0, 10.0, 10.0]" in out
    out, err = kernel.run("print(_ranks.events[['rank', 'op', 'bytes']].to_csv(index=False))")
    assert out.split() == ["rank,op,bytes", *(f"{r},all_reduce,16" for r in range(4))], out + err

    kernel.run("seen = 'the notebook'\nscale = 3")
    out, err = kernel.run("%%ranks 4 --out later\nprint(seen, scale * x.sum().item())")
    assert not err, err
    assert all(f"[rank {r}] {r * 10} 120.0" in out for r in range(4)), out  # each rank's own seen; scale was sent
    assert kernel.run("print(len(later.events), later.world_size)")[0].split() == ["0", "4"]


@pytest.mark.slow
def test_bad_input_is_one_line_and_starts_nothing(kernel):
    kernel.run("%ranks stop\nimport threading\nlock = threading.Lock()")
    before = {p.pid for p in kernel.descendants()}
    for line, cell, message in [("0", "pass", "N=0 is invalid"), ("2 --bogus", "pass", "unrecognized arguments"),
                                ("2", "print(lock)", "cannot send lock (TypeError")]:
        out, err = kernel.run(f"%%ranks {line}\n{cell}")
        assert message in err and len(err.strip().splitlines()) == 1, err
        assert "Traceback" not in err + out
    assert {p.pid for p in kernel.descendants()} <= before  # no rank started, none left


@pytest.mark.slow
def test_a_failing_rank_is_named_with_its_traceback(kernel):
    out, err = kernel.run("%%ranks 2\nif rank == 1:\n    raise ValueError('rank one says no')\ndist.barrier()")
    assert err.splitlines()[1] == "rank 1 failed: ValueError: rank one says no", err
    assert "--- traceback of rank 1 ---" in err and "raise ValueError('rank one says no')" in err
    assert "the ranks were ended" in err  # rank 0 was left in the barrier: the process group is not usable
    # the same mistake on every rank leaves them, and their state, as they were
    kernel.run("%%ranks 2\nkept = rank + 100")
    out, err = kernel.run("%%ranks 2\nprint(undefined_here)")
    assert "NameError: name 'undefined_here' is not defined" in err and "ended" not in err
    assert "[rank 1] 101" in kernel.run("%%ranks 2\nprint(kept)")[0]


@pytest.mark.slow
def test_a_stuck_collective_ends_with_the_timeout_and_the_flight_recorder_diagnosis(kernel):
    t0 = time.monotonic()
    out, err = kernel.run("%%ranks 2 --timeout 3 --flight-recorder\nif rank == 0:\n    dist.all_reduce(torch.ones(2))")
    assert time.monotonic() - t0 < 120
    assert err.startswith("CollectiveTimeout"), err
    assert re.search(r"rank 0: waiting in all_reduce \(its collective #1.*\) for \d", err), err
    assert "Flight Recorder (dtlab): rank 1 never issued all_reduce #1" in err, err
    assert "the ranks were ended" in err


@pytest.mark.slow
def test_an_interrupt_ends_the_ranks_in_one_line(kernel):
    assert not kernel.run("%%ranks 2\nx = 1")[1]
    pids = rank_pids(kernel)
    t0 = time.monotonic()
    out, err = kernel.run("%%ranks 2\nimport time\ntime.sleep(60)", interrupt_after_s=2)
    assert time.monotonic() - t0 < 30
    assert err.splitlines()[1:] == ["KeyboardInterrupt: %%ranks: the ranks were ended, and what they held with them"]
    assert not gone(pids)


@pytest.mark.slow
def test_the_ranks_end_when_the_kernel_restarts_or_is_killed(kernel):
    """Last: it kills the module's kernel."""
    assert not kernel.run("%%ranks 2\nx = 1")[1]
    pids = rank_pids(kernel)
    kernel.km.restart_kernel(now=False)  # a kernel restart: shutdown_request, then a new kernel
    assert not gone(pids), "a restarted kernel's ranks still run"

    kernel.kc.wait_for_ready(timeout=120)
    kernel.pid = int(kernel.run("import os; print(os.getpid())")[0])
    kernel.run("%load_ext dtlab")
    assert not kernel.run("%%ranks 2\nx = 1")[1]
    pids = rank_pids(kernel)
    below = [p.pid for p in kernel.descendants()]  # the forkserver, the reaper, the resource tracker too
    os.kill(kernel.pid, signal.SIGKILL)
    assert not gone(pids), "a killed kernel's ranks still run"
    assert not gone(below), [" ".join(psutil.Process(p).cmdline())[:80] for p in gone(below, 0)]
