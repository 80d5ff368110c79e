"""The launcher: results, notebook functions, failures, timeouts, interrupts, teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import dtlab
from dtlab.launch import LaunchOptions, LaunchResult
from dtlab.launch.local import loopback_store
from tests.conftest import leftover_processes

pytestmark = pytest.mark.usefixtures("no_survivors")


def rank_sum(info, scale):
    t = torch.tensor([float(info.rank + 1)])
    dist.all_reduce(t)
    return {"rank": info.rank, "world": info.world_size, "sum": t.item() * scale}


def test_returns_every_rank_value_in_rank_order():
    out = dtlab.launch(rank_sum, 2, args=(10,), progress=False)
    assert out == [{"rank": 0, "world": 2, "sum": 30.0}, {"rank": 1, "world": 2, "sum": 30.0}]


def test_result_reads_as_the_list_of_values_and_carries_the_launch():
    out = dtlab.launch(rank_sum, 2, args=(1,), progress=False)
    assert isinstance(out, LaunchResult) and len(out) == 2 and out[1]["rank"] == 1
    assert list(out) == out.values == [o for o in out] and repr(out) == repr(out.values)
    assert sorted(out.logs) == [0, 1] and out.wall_s > 0 and out.events == []


@pytest.mark.parametrize("bad,message", [
    (dict(timeout_s=0), "timeout_s=0 is invalid: must be > 0 seconds"),
    (dict(deadline_s=-1.0), "deadline_s=-1.0 is invalid"),
    (dict(backend="mpi"), "backend='mpi' is invalid"),
    (dict(device="cpu", backend="nccl"), "backend='nccl' is invalid"),
    (dict(progress="yes"), "progress='yes' is invalid"),
    (dict(env=["A=1"]), "env=['A=1'] is invalid"),
    (dict(stop=True), "stop=True is invalid"),
])
def test_bad_options_name_the_field_before_any_process(bad, message):
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError) as info:
        LaunchOptions(**bad)
    assert str(info.value).startswith(message) and "\n" not in str(info.value)
    with pytest.raises(ValueError, match=message.split("=")[0]):
        dtlab.launch(rank_sum, 2, **bad)
    assert len(psutil.Process().children(recursive=True)) <= before


def test_world_size_four():
    out = dtlab.launch(rank_sum, 4, args=(1,), progress=False)
    assert [o["rank"] for o in out] == [0, 1, 2, 3] and {o["sum"] for o in out} == {10.0}


def test_ten_launches_in_a_row():
    for i in range(10):
        assert dtlab.launch(rank_sum, 2, args=(i,), progress=False)[1]["sum"] == 3.0 * i


def test_spawn_start_method_works_too():
    assert dtlab.launch(rank_sum, 2, args=(1,), progress=False, start_method="spawn")[0]["sum"] == 3.0


def test_fork_is_refused():
    with pytest.raises(ValueError, match="start_method"):
        dtlab.launch(rank_sum, 2, start_method="fork")


def test_bad_world_size_fails_before_any_process():
    before = len(psutil.Process().children(recursive=True))
    with pytest.raises(ValueError, match="world_size"):
        dtlab.launch(rank_sum, 0)
    assert len(psutil.Process().children(recursive=True)) <= before


NOTEBOOK_SCRIPT = textwrap.dedent("""
    # Run as `python -` so that __main__ has no file, as in a Jupyter kernel.
    import torch, torch.distributed as dist, dtlab
    from dtlab.train import run

    OFFSET = 5.0

    def cell_function(info):
        t = torch.tensor([OFFSET + info.rank])
        dist.all_reduce(t)
        return t.item()

    class CellModel(torch.nn.Module):
        def __init__(self, input_shape, num_classes):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, num_classes))
        def forward(self, x):
            return self.net(x)

    print("values", dtlab.launch(cell_function, 2, progress=False))
    result = run(dtlab.RunConfig(model=CellModel, steps=3), progress=False)
    print("params", sorted(result.params()))
    dtlab.shutdown()
""")


def test_function_and_model_defined_in_a_notebook_cell():
    proc = subprocess.run([sys.executable, "-"], input=NOTEBOOK_SCRIPT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "values [11.0, 11.0]" in proc.stdout
    assert "params ['net.1.bias', 'net.1.weight']" in proc.stdout


def rank_one_raises(info):
    x = torch.ones(2)
    if info.rank == 1:
        raise ValueError("rank one's own message")
    dist.all_reduce(x)  # rank 0 becomes a victim here
    return x


def test_failure_names_the_culprit_with_its_traceback():
    t0 = time.perf_counter()
    with pytest.raises(dtlab.RankError) as info:
        dtlab.launch(rank_one_raises, 2, progress=False)
    err = info.value
    assert err.rank == 1
    text = str(err)
    assert text.splitlines()[0] == "rank 1 failed: ValueError: rank one's own message"
    assert "--- traceback of rank 1 ---" in text and "in rank_one_raises" in text
    # the victim is listed after the culprit, not instead of it
    assert text.index("rank one's own message") < text.index("rank 0")
    assert time.perf_counter() - t0 < 15


def rank_zero_raises_late(info):
    x = torch.ones(2)
    dist.all_reduce(x)
    if info.rank == 0:
        raise KeyError("zero")
    time.sleep(60)  # rank 1 would sleep on; the launcher must stop it


def test_other_ranks_are_stopped_at_once():
    t0 = time.perf_counter()
    with pytest.raises(dtlab.RankError) as info:
        dtlab.launch(rank_zero_raises_late, 2, progress=False)
    assert info.value.rank == 0 and "KeyError" in str(info.value)
    assert time.perf_counter() - t0 < 10


def rank_one_is_killed(info):
    dist.barrier()
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_a_rank_killed_by_a_signal_is_named():
    with pytest.raises(dtlab.RankError) as info:
        dtlab.launch(rank_one_is_killed, 2, progress=False)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)


def mismatched_collective(info):
    x = torch.ones(4)
    dist.all_reduce(x)
    if info.rank == 0:
        dist.all_reduce(x)  # rank 1 skips this one
    time.sleep(60)


def test_mismatched_collective_ends_within_the_timeout():
    t0 = time.perf_counter()
    with pytest.raises(dtlab.CollectiveTimeout) as info:
        dtlab.launch(mismatched_collective, 2, timeout_s=2, progress=False)
    elapsed = time.perf_counter() - t0
    assert elapsed < 2 + 8, elapsed
    text = str(info.value)
    assert info.value.rank == 0
    assert "rank 0: waiting in all_reduce (its collective #2" in text
    assert "rank 1: last left all_reduce (its collective #1" in text


def stuck_without_collective_timeout(info):
    x = torch.ones(4)
    if info.rank == 0:
        dist.all_reduce(x)
    time.sleep(60)


def test_deadline_stops_a_launch():
    t0 = time.perf_counter()
    with pytest.raises(dtlab.RankError, match="deadline"):
        dtlab.launch(stuck_without_collective_timeout, 2, timeout_s=30, deadline_s=2, progress=False)
    assert time.perf_counter() - t0 < 8


def sleeps(info):
    dist.barrier()
    time.sleep(60)


def test_keyboard_interrupt_terminates_every_rank(default_sigint):
    main = threading.main_thread().ident
    timer = threading.Timer(2.0, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        dtlab.launch(sleeps, 2, progress=False)
    timer.join()
    assert time.perf_counter() - t0 < 10
    assert not leftover_processes()


def prints_and_reports(info):
    print(f"hello from rank {info.rank}")
    for step in range(3):
        dtlab.report(step=step + 1, total=3, loss=1.0 / (step + 1))
    return info.rank


def test_progress_reaches_the_caller_and_output_is_kept():
    seen = []
    out = dtlab.launch(prints_and_reports, 2, progress=seen.append)
    assert [s["step"] for s in seen if s["rank"] == 0] == [1, 2, 3]
    assert sorted({s["rank"] for s in seen}) == [0, 1]  # every rank's reports reach a callable
    assert "hello from rank 0" in out.logs[0] and "hello from rank 1" in out.logs[1]


def test_store_listens_on_loopback_only():
    store, port = loopback_store(2, 5.0)
    listening = [c for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
    assert listening and all(c.laddr.ip == "127.0.0.1" for c in listening)
    del store


def test_shutdown_leaves_no_process_at_all():
    dtlab.launch(rank_sum, 2, args=(1,), progress=False)
    dtlab.shutdown()
    time.sleep(0.5)
    alive = [p for p in psutil.Process().children(recursive=True)
             if "resource_tracker" not in " ".join(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive
    assert dtlab.launch(rank_sum, 2, args=(1,), progress=False)[0]["sum"] == 3.0  # and it starts again


def mismatched_shapes(info):
    dist.all_reduce(torch.ones(4 + info.rank))


def test_debug_detail_names_mismatched_shapes():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL reaches ranks started from a forkserver that imported torch before."""
    with pytest.raises(dtlab.RankError) as info:
        dtlab.launch(mismatched_shapes, 2, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}, timeout_s=10, progress=False)
    text = str(info.value)
    assert "Detected mismatch between collectives" in text
    assert "TensorShape=[4]" in text and "TensorShape=[5]" in text


def test_stop_event_ends_a_launch_from_another_thread():
    stop = threading.Event()
    threading.Timer(1.5, stop.set).start()
    t0 = time.perf_counter()
    with pytest.raises(dtlab.LaunchStopped):
        dtlab.launch(sleeps, 2, progress=False, stop=stop)
    assert time.perf_counter() - t0 < 8
    assert not leftover_processes()
