"""launch_torchrun: torchrun's agent in between, the same guarantees as launch."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import dtlab
from dtlab.launch import LaunchResult
from dtlab.launch.torchrun import launch_torchrun, torchrun_command
from tests.conftest import leftover_processes

pytestmark = pytest.mark.usefixtures("no_survivors")


def ranks_and_sum(info, scale):
    t = torch.tensor([info.rank + 1.0])
    dist.all_reduce(t)
    dtlab.report(step=1, total=1, loss=0.5)
    return info.rank, info.local_rank, info.world_size, t.item() * scale, os.environ["TORCHELASTIC_RUN_ID"] != ""


def test_returns_every_rank_value_under_torchrun():
    seen = []
    out = launch_torchrun(ranks_and_sum, 2, args=(10,), progress=seen.append)
    assert out == [(0, 0, 2, 30.0, True), (1, 1, 2, 30.0, True)]
    assert seen and seen[-1]["step"] == 1
    assert isinstance(out, LaunchResult) and list(out) == out.values and out.wall_s > 0
    assert {"node_start", "worker_start", "worker_finish"} <= {e["kind"] for e in out.events}
    assert list(out.logs) == [0]  # one agent: logs are keyed by node


def rank_one_raises(info):
    if info.rank == 1:
        raise ValueError("rank one under torchrun")
    dist.barrier()


def test_failure_names_the_culprit_under_torchrun():
    with pytest.raises(dtlab.RankError) as info:
        launch_torchrun(rank_one_raises, 2, progress=False)
    assert info.value.rank == 1
    assert str(info.value).startswith("rank 1 failed: ValueError: rank one under torchrun")
    assert "worker_error" in {e["kind"] for e in info.value.events}  # the run's events ride along


def rank_one_killed(info):
    dist.barrier()
    if info.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_signal_death_is_named_under_torchrun():
    with pytest.raises(dtlab.RankError) as info:
        launch_torchrun(rank_one_killed, 2, progress=False)
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)


def sleeps(info):
    dist.barrier()
    time.sleep(60)


def test_deadline_kills_torchrun_and_its_workers():
    t0 = time.perf_counter()
    with pytest.raises(dtlab.CollectiveTimeout, match="deadline"):
        launch_torchrun(sleeps, 2, deadline_s=6, progress=False)
    assert time.perf_counter() - t0 < 15
    assert not leftover_processes()


def test_interrupt_kills_torchrun_and_its_workers(default_sigint):
    main = threading.main_thread().ident
    timer = threading.Timer(6.0, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    with pytest.raises(KeyboardInterrupt):
        launch_torchrun(sleeps, 2, progress=False)
    timer.join()
    assert not leftover_processes()


def test_stop_event_kills_torchrun_and_its_workers():
    stop = threading.Event()
    threading.Timer(5.0, stop.set).start()
    t0 = time.perf_counter()
    with pytest.raises(dtlab.LaunchStopped):
        launch_torchrun(sleeps, 2, progress=False, stop=stop)
    assert time.perf_counter() - t0 < 15
    assert not leftover_processes()


def test_command_binds_the_rendezvous_to_loopback(tmp_path):
    cmd = torchrun_command(tmp_path, 2, port=1234, rdzv_id="x")
    assert cmd[cmd.index("--rdzv-endpoint") + 1] == "127.0.0.1:1234"
    assert cmd[cmd.index("--local-addr") + 1] == "127.0.0.1"
    assert cmd[-3:] == ["-m", "dtlab.launch.worker", str(tmp_path)]


def test_bad_arguments_fail_before_torchrun_starts():
    with pytest.raises(ValueError, match="nproc_per_node"):
        launch_torchrun(sleeps, 0)
    with pytest.raises(ValueError, match="max_restarts"):
        launch_torchrun(sleeps, 2, max_restarts=-1)
    with pytest.raises(ValueError, match="timeout_s=0 is invalid"):
        launch_torchrun(sleeps, 2, timeout_s=0)
