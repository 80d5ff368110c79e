"""PyTorch's Flight Recorder in dtlab: the switch, the dumps every rank leaves (a hung one too), reading them,
the hang diagnosis, torch's own analyser beside it, and the cross-check against dtlab's CommRecorder."""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

import cloudpickle
import pytest
import torch
import torch.distributed as dist

import dtlab
from dtlab.app import cli, commands
from dtlab.core.config import RunConfig
from dtlab.core.failures import CollectiveTimeout, RankFailure
from dtlab.core.flight import read, read_all, torch_verdict
from dtlab.core.flight_diagnosis import diagnose
from dtlab.core.results import RankResult, save_flight
from dtlab.launch import cluster, worker
from dtlab.launch.contract import LaunchOptions, launch_error
from dtlab.launch.flight import DIR_ENV
from dtlab.launch.torchrun import launch_torchrun
from dtlab.launch.workdir import result_path
from dtlab.read import flight
from dtlab.read.flight import crosscheck

launches_ranks = pytest.mark.usefixtures("no_survivors")  # (conftest marks these slow)
T0 = 1_800_000_000.0  # a wall-clock second for the synthetic dumps


# -- synthetic dumps, in torch's format -----------------------------------------------------------------------------
def entry(group: str, seq: int, op: str, size: int, at: float, retired: bool = True, desc: str = "") -> dict:
    sizes = [[size]] if size else []
    return {"record_id": 0, "pg_id": int(group), "process_group": (group, desc or _DESC.get(group, "undefined")),
            "collective_seq_id": seq, "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}",
            "time_created_ns": int((T0 + at) * 1e9), "input_sizes": sizes, "input_dtypes": ["Float"] * len(sizes),
            "output_sizes": sizes, "output_dtypes": ["Float"] * len(sizes), "state": "scheduled",
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": retired,
            "timeout_ms": 2000, "is_p2p": False, "frames": [{"name": "train", "filename": "/x/prog.py", "line": 7}]}


_DESC = {"0": "default_pg", "1": "metrics"}


def dump(rank: int, entries: list[dict], reason: str = "error", at: float = 2.5,
         groups: dict[str, str] | None = None) -> bytes:
    groups = groups or {"0": "default_pg", "1": "metrics"}
    config = {g: {"name": g, "desc": d, "ranks": "[0, 1]"} for g, d in groups.items()}
    return pickle.dumps({"version": "2.10", "pg_config": config, "pg_status": {}, "comm_lib_version": "",
                         "entries": entries, "dtlab": {"rank": rank, "reason": reason, "error": "",
                                                       "dumped_ns": int((T0 + at) * 1e9)}})


def ar(seq: int, at: float, group: str = "0", size: int = 212, retired: bool = True, op: str = "all_reduce") -> dict:
    return entry(group, seq, op, size, at, retired)


CASES = {
    "order": ({0: dump(0, [ar(1, 0.0), ar(2, 0.1, retired=False)]),
               1: dump(1, [ar(1, 0.0), ar(2, 0.1, size=1, op="broadcast", retired=False)])},
              ("order", 1, "broadcast", 2, "0")),
    "skipped": ({0: dump(0, [ar(1, 0.0), ar(1, 0.01, group="1", size=2, retired=False)]),
                 1: dump(1, [ar(1, 0.0), ar(2, 0.05, retired=False)])},
                ("skipped", 1, "all_reduce", 1, "1")),
    "skipped_and_finished": ({0: dump(0, [ar(1, 0.0), ar(2, 0.1, retired=False)]),
                              1: dump(1, [ar(1, 0.0)], reason="end", at=0.2)},
                             ("skipped", 1, "all_reduce", 2, "0")),
    "wrong_group": ({0: dump(0, [entry("2", 1, "all_reduce", 212, 0.0, False, "grads")],
                             groups={"0": "default_pg", "1": "metrics", "2": "grads"}),
                     1: dump(1, [entry("1", 1, "all_reduce", 212, 0.001, False, "grads")],
                             groups={"0": "default_pg", "1": "grads", "2": "metrics"})},
                    ("wrong_group", 1, "all_reduce", 1, "1")),
    "stuck": ({0: dump(0, [ar(1, 0.0), ar(2, 0.01, retired=False)]), 1: dump(1, [ar(1, 0.0)], reason="request")},
              ("stuck", 1, "all_reduce", 2, "0")),
    "missing": ({0: dump(0, [ar(1, 0.0), ar(2, 0.01, retired=False)]), 1: dump(1, [ar(1, 0.0)], at=0.2)},
                ("missing", 1, "all_reduce", 2, "0")),
    "no_dump": ({0: dump(0, [ar(1, 0.0), ar(2, 0.01, retired=False)])}, ("no_dump", 1, "all_reduce", 2, "0")),
    "incomplete": ({r: dump(r, [ar(1, 0.0), ar(2, 0.1, retired=False)]) for r in range(2)},
                   ("incomplete", 0, "all_reduce", 2, "0")),
    "none": ({r: dump(r, [ar(1, 0.0), ar(2, 0.1)], reason="end") for r in range(2)}, ("none", None, "", None, "")),
}


@pytest.mark.parametrize("case", CASES)
def test_the_diagnosis_names_the_rank_the_collective_and_its_sequence_number(case):
    dumps, want = CASES[case]
    found = diagnose(dumps)
    assert (found.kind, found.rank, found.op, found.seq, found.group) == want, found.text
    if found.rank is not None:
        assert f"rank {found.rank}" in found.text and f"#{found.seq}" in found.text


def test_a_wrong_group_says_the_groups_were_made_in_different_orders():
    found = diagnose(CASES["wrong_group"][0])
    assert "process group 1 is 'metrics' on rank 0, 'grads' on rank 1" in found.text


def test_reading_a_dump_and_the_table_of_it():
    d = read(CASES["skipped"][0][0])
    assert d.rank == 0 and d.reason == "error" and d.groups["1"] == ("metrics", (0, 1))
    e = d.entries[1]
    assert (e.op, e.backend, e.group, e.group_desc, e.seq, e.bytes, e.retired) == \
        ("all_reduce", "gloo", "1", "metrics", 1, 8, False)
    assert e.where == "train (prog.py:7)" and e.label() == "all_reduce #1 on group 1 (metrics)"
    table = flight.frame(CASES["skipped"][0])
    assert list(table.columns) == list(flight.COLUMNS) and len(table) == 4 and table["created_s"].min() == 0


def test_torchs_analyser_reads_the_dumps_dtlab_completes_and_not_gloos_own():
    verdict = torch_verdict(CASES["stuck"][0])
    assert "Not all ranks joining collective, sequence number: 2" in verdict and "missing ranks: {1}" in verdict
    assert "matched on every rank" in torch_verdict(CASES["none"][0])
    raw = {r: pickle.dumps({**pickle.loads(b), "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}})
           for r, b in CASES["stuck"][0].items()}  # what gloo itself writes: no process groups
    assert "could not analyse these dumps: KeyError" in torch_verdict(raw)


def test_the_switch_is_checked_before_anything_starts(capsys):
    with pytest.raises(ValueError, match=r"RunConfig\.flight_recorder='yes' is invalid"):
        RunConfig(flight_recorder="yes")
    with pytest.raises(ValueError, match=r"flight_recorder=True is invalid: the rpc tier"):
        RunConfig(tier="rpc", world_size=2, flight_recorder=True)
    with pytest.raises(ValueError, match="flight_recorder=1 is invalid"):
        LaunchOptions(flight_recorder=1)
    assert cli.main(["run", "--tier", "rpc", "--world-size", "2", "--flight-recorder"]) == 2
    assert capsys.readouterr().err.startswith("error: --flight-recorder: RunConfig.flight_recorder=True is invalid")


def test_a_failed_cli_run_keeps_the_dumps_and_says_what_they_show(tmp_path, monkeypatch, capsys):
    dumps = CASES["stuck"][0]
    error = launch_error([RankFailure(0, "exception", "RuntimeError", "timed out waiting", time=1.0)], flight=dumps)
    assert isinstance(error, CollectiveTimeout)

    def failing_run(cfg: RunConfig, **_: Any) -> Any:
        assert cfg.flight_recorder
        raise error

    monkeypatch.setattr(commands, "run", failing_run)
    code = cli.main(["run", "--tier", "ddp", "--world-size", "2", "--flight-recorder", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 1 and "Flight Recorder (dtlab): rank 1 never issued all_reduce #2" in err
    assert "Not all ranks joining collective" in err
    assert diagnose(str(tmp_path / "flight_recorder")).kind == "stuck"


def test_a_cluster_job_asks_its_workers_for_dumps_and_collect_reads_them(tmp_path, monkeypatch):
    cfg = RunConfig(tier="ddp", world_size=2, flight_recorder=True)
    plan = cluster.plan(cfg, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", workdir=tmp_path / "w")
    cluster.write(plan)
    for name in (DIR_ENV, "TORCH_FR_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)  # and put back as it was afterwards
    worker._load(plan.workdir)  # what each worker does first, before its process group starts
    assert os.environ[DIR_ENV] == str(plan.workdir / "flight_recorder") and os.environ["TORCH_FR_BUFFER_SIZE"] == "2000"
    for r in range(2):
        result_path(plan.workdir, r).write_bytes(cloudpickle.dumps(RankResult(r, [], {}, [], [], 0.0)))
    save_flight(CASES["stuck"][0], plan.workdir)
    assert cluster.collect(plan.workdir).flight == CASES["stuck"][0]


# -- launching ------------------------------------------------------------------------------------------------------
def _probe(info: Any) -> str:
    """A collective, point-to-point ops, a named group; then rank 1 sleeps while rank 0 waits in an all_reduce."""
    t = torch.ones(4)
    dist.all_reduce(t)
    peer = 1 - info.rank
    if info.rank == 0:
        dist.send(t, peer)
    else:
        dist.recv(t, peer)
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, peer), dist.P2POp(dist.irecv, torch.ones(4), peer)]):
        work.wait()
    dist.all_reduce(t, group=dist.new_group(group_desc="mine"))
    if info.rank == 1:
        time.sleep(60)  # the launcher asks for its dump, then kills it
    dist.all_reduce(t)
    return "unreachable"


@launches_ranks
def test_every_rank_leaves_its_dump_when_a_launch_hangs_the_busy_rank_too():
    with pytest.raises(CollectiveTimeout) as caught:
        dtlab.launch(_probe, 2, timeout_s=2, progress=False, flight_recorder=True)
    dumps = read_all(caught.value.flight)
    assert sorted(dumps) == [0, 1] and dumps[0].reason == "error" and dumps[1].reason == "request"
    ops = [(e.op, e.group, e.group_desc, e.seq) for e in dumps[0].entries]
    # gloo records no point-to-point op (send, recv, batch_isend_irecv): only the collectives, numbered per group
    assert ops == [("all_reduce", "0", "default_pg", 1), ("all_reduce", "1", "mine", 1),
                   ("all_reduce", "0", "default_pg", 2)]
    # gloo never advances "state", nor sets the "discovered" times: a collective that never completed reads as one
    # that did (only matching the ranks' entries tells them apart)
    assert all(e.p2p_seq == 0 and e.state == "scheduled" for e in dumps[0].entries)
    raw = pickle.loads(caught.value.flight[0])["entries"]
    assert not any(e["time_discovered_started_ns"] or e["time_discovered_completed_ns"] for e in raw)
    assert all(e.retired for e in dumps[1].entries)  # the busy rank's last collective had completed
    found = diagnose(caught.value.flight)
    assert (found.kind, found.rank, found.op, found.seq) == ("stuck", 1, "all_reduce", 2)


@launches_ranks
def test_a_ddp_run_keeps_every_ranks_dump_with_the_reducers_bucket_all_reduces(tmp_path):
    cfg = RunConfig(tier="ddp", world_size=2, steps=3, flight_recorder=True)
    result = dtlab.run(cfg, progress=False, record=False)  # unrecorded: DDP keeps its C++ all-reduce
    dumps = read_all(result.flight)
    assert sorted(dumps) == [0, 1] and all(d.reason == "end" for d in dumps.values())
    params = sum(p.numel() for p in result.params().values())
    buckets = [e for e in dumps[0].entries if e.op == "all_reduce"]
    assert len(buckets) == cfg.steps and all(e.bytes == 4 * params for e in buckets)
    assert [e.seq for e in dumps[0].entries] == list(range(1, len(dumps[0].entries) + 1))
    assert all(e.retired and e.created_s > 0 for e in dumps[0].entries)
    assert diagnose(result.flight).kind == "none"
    folder = result.save(tmp_path) / "flight_recorder"
    assert sorted(p.name for p in folder.iterdir()) == ["rank_0", "rank_1"]
    assert "matched on every rank" in flight.report(str(folder))  # torch's analyser reads the saved folder


def _all_reduce_once(info: Any) -> float:
    t = torch.ones(3)
    dist.all_reduce(t)
    return float(t[0])


@launches_ranks
def test_torchrun_workers_leave_their_dumps_too():
    out = launch_torchrun(_all_reduce_once, 2, timeout_s=20, progress=False, flight_recorder=True)
    dumps = read_all(out.flight)
    assert list(out) == [2.0, 2.0] and sorted(dumps) == [0, 1]
    assert all([(e.op, e.bytes) for e in d.entries] == [("all_reduce", 12)] and d.reason == "end"
               for d in dumps.values())


def _rank1_busy(info: Any) -> None:
    t = torch.ones(4)
    dist.all_reduce(t)
    if info.rank == 1:
        time.sleep(60)  # torchrun's agent stops it (SIGTERM) once rank 0 has failed: it dumps first
    dist.all_reduce(t)


@launches_ranks
def test_a_hung_torchrun_job_leaves_every_ranks_dump():
    with pytest.raises(CollectiveTimeout) as caught:
        launch_torchrun(_rank1_busy, 2, timeout_s=3, progress=False, flight_recorder=True)
    dumps = read_all(caught.value.flight)
    assert dumps[0].reason == "error" and dumps[1].reason in ("terminated", "request")
    found = diagnose(dumps)
    assert (found.kind, found.rank, found.op, found.seq) == ("stuck", 1, "all_reduce", 2), found.text


CROSSCHECK = {
    "ddp": RunConfig(tier="ddp", world_size=2, steps=2, flight_recorder=True),
    "fsdp": RunConfig(tier="fsdp", world_size=2, steps=2, flight_recorder=True),
    "tp": RunConfig(tier="tp", world_size=2, steps=2, flight_recorder=True),
    "pipeline": RunConfig(tier="pipeline", world_size=2, steps=2, flight_recorder=True),
    "ep": RunConfig(tier="ep", world_size=2, steps=2, model="moe", dataset="text", flight_recorder=True),
}


@launches_ranks
@pytest.mark.parametrize("tier", CROSSCHECK)
def test_dtlabs_recorder_and_flight_recorder_saw_the_same_collectives(tier):
    check = crosscheck(dtlab.run(CROSSCHECK[tier], progress=False))
    print(check)
    assert check.compared and all(not x["op"].startswith(("all_", "broadcast", "reduce")) for x in check.excluded)
    assert check.ok, str(check)
