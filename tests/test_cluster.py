"""dtlab cluster: the node commands and SLURM script it writes, its refusals, and a real two-node run."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

import dtlab
from dtlab.app.cli import main
from dtlab.core.config import RunConfig
from dtlab.launch import cluster
from dtlab.launch.torchrun import free_port, kill_session, torchrun_command
from dtlab.tiers import elastic, multinode

from .parity import TOL

pytestmark = pytest.mark.usefixtures("no_survivors")

# Tiny and cheap: a few SGD steps of a narrow mlp, one thread per rank.
JOB = dict(steps=4, model_size=32, optimizer="sgd", lr=0.05, threads_per_rank=1)


def _plan(tmp_path, tier="ddp", **launch):
    launch = {"nnodes": 2, "nproc_per_node": 1, "master_addr": "10.1.2.3", "port": 29555, **launch}
    return cluster.plan(RunConfig(tier=tier, **JOB), workdir=tmp_path / "w", **launch)


def _value(argv, flag):
    return argv[argv.index(flag) + 1]


def test_every_node_runs_the_same_torchrun_command_with_the_launch_flags_and_env(tmp_path):
    plan = _plan(tmp_path, nproc_per_node=2, ifname="eth0", rdzv_id="job7", max_restarts=2)
    assert len(plan.commands) == 2 and plan.commands[0] == plan.commands[1]
    argv = shlex.split(plan.commands[0])
    assert argv[:5] == ["env", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "PYTHONUNBUFFERED=1",
                        "GLOO_SOCKET_IFNAME=eth0", "NCCL_SOCKET_IFNAME=eth0"]
    assert argv[5:8] == [sys.executable, "-m", "torch.distributed.run"]
    assert _value(argv, "--nnodes") == "2" and _value(argv, "--nproc-per-node") == "2"
    assert _value(argv, "--rdzv-backend") == "c10d" and _value(argv, "--rdzv-endpoint") == "10.1.2.3:29555"
    assert _value(argv, "--rdzv-id") == "job7" and _value(argv, "--max-restarts") == "2"
    assert "--local-addr" not in argv  # each node is known by its own host name
    assert argv[-3:] == ["-m", "dtlab.launch.worker", str(tmp_path / "w")]
    assert plan.config.world_size == 4  # the default world size 1 is set to nnodes x nproc_per_node
    assert not (tmp_path / "w").exists()  # planning writes nothing


def test_without_ifname_gloo_and_nccl_choose_and_the_worker_keeps_off_loopback(tmp_path):
    from dtlab.launch import worker

    argv = shlex.split(_plan(tmp_path).commands[0])
    assert not any(a.startswith(("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")) for a in argv)
    # A config.json run is a cluster's: the worker must not pin gloo to "lo" as it does for dtlab's own launches.
    cluster.write(_plan(tmp_path))
    assert worker._load(tmp_path / "w")[2].gloo_ifname is None


def test_torchrun_command_can_leave_local_addr_out(tmp_path):
    assert "--local-addr" not in torchrun_command(tmp_path, 1, port=1, rdzv_id="x", local_addr=None)
    assert "--local-addr" in torchrun_command(tmp_path, 1, port=1, rdzv_id="x")


def test_tier_options_follow_the_launch(tmp_path):
    cfg = RunConfig(tier="multinode", **JOB, tier_options=multinode.Options(nnodes=1))
    plan = cluster.plan(cfg, nnodes=4, nproc_per_node=1, master_addr="h0", workdir=tmp_path / "m")
    assert plan.config.tier_options.nnodes == 4 and plan.config.world_size == 4
    cfg = RunConfig(tier="elastic", **JOB, tier_options=elastic.Options(faults=("sigkill:2:0",)))
    plan = cluster.plan(cfg, nnodes=2, nproc_per_node=1, master_addr="h0", workdir=tmp_path / "e")
    o = plan.config.tier_options
    assert (o.nnodes, o.max_restarts, o.snapshot_dir) == ("2", 3, str(tmp_path / "e" / "snapshots"))
    assert _value(shlex.split(plan.commands[0]), "--max-restarts") == "3"  # the elastic tier's own default


def test_write_leaves_the_job_and_a_valid_sbatch_script(tmp_path):
    plan = _plan(tmp_path, nnodes=4, ifname="ib0")
    work = tmp_path / "w"
    work.mkdir()
    for stale in ("payload.pkl", "result-rank0.pkl", "error-rank1.json", "events.jsonl"):  # a previous run's
        (work / stale).write_text("old")
    paths = cluster.write(plan)
    assert paths == [work / "config.json", work / "dtlab.sbatch"]
    assert sorted(p.name for p in work.iterdir()) == ["config.json", "dtlab.sbatch"]
    assert RunConfig.from_dict(json.loads((work / "config.json").read_text())) == plan.config
    script = (work / "dtlab.sbatch").read_text()
    check = subprocess.run(["bash", "-n", str(work / "dtlab.sbatch")], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --job-name=dtlab-ddp",
                 f"#SBATCH --output={work}/slurm-%j.out",
                 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                 "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1", "export GLOO_SOCKET_IFNAME=ib0"):
        assert line in script.splitlines()
    srun = " ".join(script.split("\nsrun ", 1)[1].split("\\\n"))
    argv = shlex.split(srun.split("\n")[0])
    assert argv[:4] == ["--kill-on-bad-exit=1", sys.executable, "-m", "torch.distributed.run"]
    assert _value(argv, "--rdzv-endpoint") == "${MASTER_ADDR}:29555" and _value(argv, "--rdzv-id") == "${SLURM_JOB_ID}"
    assert argv[-3:] == ["-m", "dtlab.launch.worker", str(work)]
    assert '--rdzv-endpoint "${MASTER_ADDR}:29555" --rdzv-id "${SLURM_JOB_ID}"' in script  # expanded by bash


@pytest.mark.parametrize("tier,launch,message", [
    ("rpc", {}, "tier 'rpc' cannot run on a cluster: .*choose one of ddp-naive, ddp, zero, fsdp, multinode, elastic"),
    ("single", {}, "tier 'single' cannot run on a cluster"),
    ("ddp", {"nnodes": 0}, "nnodes=0 is invalid"),
    ("ddp", {"nproc_per_node": 0}, "nproc_per_node=0 is invalid"),
    ("ddp", {"master_addr": ""}, "master_addr='' is invalid"),
    ("ddp", {"master_addr": "host:29500"}, "give the port as port="),
    ("ddp", {"max_restarts": -1}, "max_restarts=-1 is invalid"),
    ("ddp", {"port": 70000}, "port=70000 is invalid"),
    ("ddp", {"ifname": ""}, "ifname='' is invalid"),
    ("ddp", {"nnodes": 3}, "global_batch_size=64 is invalid: must be divisible by world_size=3"),
])
def test_bad_input_fails_before_anything_is_written(tmp_path, tier, launch, message):
    with pytest.raises(ValueError, match=message):
        _plan(tmp_path, tier=tier, **launch)
    assert not (tmp_path / "w").exists()


def test_a_world_size_that_contradicts_the_launch_and_unsendable_jobs_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"world_size=4 does not match the cluster: .* 2 x 1 = 2 ranks"):
        cluster.plan(RunConfig(tier="ddp", world_size=4, **JOB), nnodes=2, nproc_per_node=1, master_addr="h",
                     workdir=tmp_path / "w")
    with pytest.raises(ValueError, match="cannot be sent to a cluster"):
        cluster.plan(RunConfig(tier="ddp", model=lambda shape, classes: None, **JOB), nnodes=2, nproc_per_node=1,
                     master_addr="h", workdir=tmp_path / "w")
    oom = RunConfig(tier="elastic", **JOB, tier_options=elastic.Options(faults=("oom:1:0",)))
    with pytest.raises(ValueError, match="'oom' fault"):
        cluster.plan(oom, nnodes=1, nproc_per_node=1, master_addr="h", workdir=tmp_path / "w")
    mn = RunConfig(tier="multinode", world_size=2, **JOB, tier_options=multinode.Options(nnodes=1))
    assert cluster.plan(mn, nnodes=2, nproc_per_node=1, master_addr="h", workdir=tmp_path / "w").config \
        .tier_options.nnodes == 2
    assert not (tmp_path / "w").exists()


def test_cli_prints_the_node_commands_and_writes_the_files(tmp_path):
    work = tmp_path / "w"
    proc = subprocess.run([sys.executable, "-m", "dtlab", "cluster", "--master-addr", "10.0.0.1", "--nnodes", "2",
                           "--nproc-per-node", "2", "--ifname", "eth0", "--steps", "3", "--workdir", str(work)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "node 0:" in out and "node 1:" in out and "--rdzv-endpoint 10.0.0.1:29500" in out
    assert f"sbatch {work}/dtlab.sbatch" in out and f"python -m dtlab cluster --collect {work}" in out
    assert json.loads((work / "config.json").read_text())["world_size"] == 4


@pytest.mark.parametrize("argv,message", [
    (["--tier", "rpc", "--master-addr", "h"], "tier 'rpc'"),
    (["--nnodes", "0", "--master-addr", "h"], "nnodes=0"),
    (["--master-addr", "h", "--max-restarts", "-1"], "max_restarts=-1"),
    (["--master-addr", ""], "master_addr=''"),
    ([], "--master-addr is required"),
    (["--master-addr", "h", "--opt", "no_such=1"], "bucket_cap_mb"),
])
def test_cli_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, argv, message):
    assert main(["cluster", "--workdir", str(tmp_path / "w"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "w").exists()


def test_collect_names_the_workdir_and_the_missing_ranks(tmp_path, capsys):
    plan = _plan(tmp_path)
    cluster.write(plan)
    (plan.workdir / "error-rank1.json").write_text(json.dumps(
        {"rank": 1, "error_type": "RuntimeError", "message": "gloo: connection refused\nmore", "traceback": "",
         "time": 0.0}))
    with pytest.raises(FileNotFoundError) as info:
        cluster.collect(plan.workdir)
    assert str(info.value).startswith(f"{plan.workdir}: no result from rank(s) 0, 1 of 2")
    assert "rank 1 failed: RuntimeError: gloo: connection refused" in str(info.value)
    with pytest.raises(FileNotFoundError, match="holds no config.json"):
        cluster.collect(tmp_path / "elsewhere")
    assert main(["cluster", "--collect", str(plan.workdir)]) == 1
    assert "no result from rank(s) 0, 1" in capsys.readouterr().err


def test_two_nodes_run_the_printed_commands_and_match_single(tmp_path, capsys):
    """The real thing on one machine: both node commands at once, as two hosts would run them."""
    cfg = RunConfig(tier="ddp", **JOB)
    # ifname "lo": both "hosts" are this machine, whose host name may resolve to any interface.
    plan = cluster.plan(cfg, nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", port=free_port(),
                        workdir=tmp_path / "w", ifname="lo")
    cluster.write(plan)
    procs = []
    try:
        for i, command in enumerate(plan.commands):
            with open(tmp_path / f"node{i}.log", "wb") as log:
                procs.append(subprocess.Popen(command, shell=True, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True))
        for p in procs:
            p.wait(timeout=120)
    finally:
        for p in procs:
            kill_session(p)  # the shell, torchrun's agent and its workers (in sessions of their own)
    logs = "\n".join((tmp_path / f"node{i}.log").read_text()[-2000:] for i in range(2))
    assert [p.returncode for p in procs] == [0, 0], logs
    result = cluster.collect(plan.workdir)
    assert [r.rank for r in result.ranks] == [0, 1] and result.config == plan.config
    assert {"worker_start", "process_group_ready", "worker_finish"} <= {e["kind"] for e in result.run_events}
    single = dtlab.run(cfg.replace(tier="single", world_size=1), progress=False)
    assert result.max_param_diff(single) <= TOL
    capsys.readouterr()
    assert main(["cluster", "--collect", str(plan.workdir)]) == 0
    assert "ddp x2" in capsys.readouterr().out
    assert (plan.workdir / "result.json").exists() and (plan.workdir / "params.pt").exists()
