"""CommRecorder: exact counts and bytes, DDP buckets, bandwidth formulas, traces."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtlab
from dtlab import instrument
from dtlab.core import comm
from dtlab.instrument import algbw, bus_factor, busbw, chrome_trace, events_frame, recorder
from dtlab.tiers.ddp import Options as DDPOptions

pytestmark = pytest.mark.usefixtures("no_survivors")


def known_sequence(info):
    rec = instrument.active()
    before = len(rec.events)
    world, rank = info.world_size, info.rank
    dist.all_reduce(torch.ones(4))  # 16 B
    dist.broadcast(torch.ones(8, dtype=torch.float64), src=0)  # 64 B
    dist.all_gather([torch.zeros(3) for _ in range(world)], torch.ones(3))  # output: 2 * 12 B
    dist.reduce_scatter_tensor(torch.zeros(5), torch.ones(5 * world))  # input: 40 B
    dist.all_gather_into_tensor(torch.zeros(6 * world), torch.ones(6))  # output: 48 B
    dist.barrier()
    peer = 1 - rank
    if rank == 0:
        dist.send(torch.ones(10), dst=peer)  # 40 B
    else:
        dist.recv(torch.zeros(10), src=peer)
    work = dist.all_reduce(torch.ones(100, dtype=torch.float16), async_op=True)  # 200 B
    work.wait()
    ops = [dist.P2POp(dist.isend, torch.ones(7), peer), dist.P2POp(dist.irecv, torch.zeros(7), peer)]
    for w in dist.batch_isend_irecv(ops):  # 28 B each way
        w.wait()
    return [e[:] for e in rec.events[before:]]


def test_known_sequence_gives_exact_counts_and_bytes():
    out = dtlab.launch(known_sequence, 2, progress=False)
    for rank, events in enumerate(out):
        got = [(e[comm.OP], e[comm.BYTES]) for e in events]
        p2p = ("send", 40) if rank == 0 else ("recv", 40)
        assert got == [("all_reduce", 16), ("broadcast", 64), ("all_gather", 24), ("reduce_scatter_tensor", 40),
                       ("all_gather_into_tensor", 48), ("barrier", 0), p2p, ("all_reduce", 200),
                       ("isend", 28), ("irecv", 28)]
        assert {e[comm.GROUP] for e in events} == {2}
        async_ev = events[7]
        assert async_ev[comm.ASYNC] and async_ev[comm.DTYPE] == "float16"
        assert async_ev[comm.END] >= async_ev[comm.START] and async_ev[comm.WAIT] >= 0
        assert [e[comm.PEER] for e in events[8:]] == [1 - rank, 1 - rank]
        assert all(e[comm.TAG] == "batched" for e in events[8:])


def ddp_steps(info, bucket_cap_mb, steps):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    cfg = dtlab.RunConfig(tier="ddp", world_size=info.world_size, tier_options=DDPOptions(bucket_cap_mb=bucket_cap_mb))
    from dtlab.tiers.ddp import Strategy, bucket_layout

    strategy = Strategy(cfg, info)
    rec = instrument.active()
    ddp = strategy.wrap(model)
    init = [e[:] for e in rec.events]
    per_step, layouts = [], []
    for step in range(steps):
        rec.step = step
        ddp(torch.randn(8, 64)).sum().backward()
        per_step.append([e[:] for e in rec.events if e[comm.STEP] == step])
        layouts.append(bucket_layout(ddp)["bucket_sizes_bytes"])
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return init, per_step, grad_bytes, layouts


def test_ddp_bucket_events_match_ddp_buckets():
    init, per_step, grad_bytes, layouts = dtlab.launch(ddp_steps, 2, args=(0.02, 3), progress=False)[0]
    # DDP's initial parameter broadcast goes through _broadcast_coalesced, not dist.broadcast
    assert [e[comm.OP] for e in init] == ["broadcast"] and init[0][comm.TAG] == "broadcast_coalesced"
    assert init[0][comm.BYTES] == grad_bytes
    assert len(layouts[0]) == 1 and len(layouts[-1]) == 3  # one bucket, then rebuilt to 0.02 MB ones
    for events, buckets in zip(per_step, layouts):
        assert len(events) == len(buckets)
        assert [e[comm.BYTES] for e in events] == buckets
        assert all(e[comm.OP] == "all_reduce" and e[comm.TAG].startswith("ddp_bucket:") for e in events)
        assert sum(e[comm.BYTES] for e in events) == grad_bytes
        assert all(e[comm.END] >= e[comm.START] for e in events)


def uneven_join(info):
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    with Join([model]):
        for _ in range(2 + 2 * info.rank):  # rank 1 has more batches: Join shadows its all-reduces on rank 0
            model(torch.randn(8, 4)).sum().backward()
    ops = [e[comm.OP] for e in instrument.active().events]
    return ops.count("all_reduce"), all(e[comm.END] is not None for e in instrument.active().events)


def test_ddp_join_runs_under_the_recorder_and_its_all_reduces_are_recorded():
    # Join hands its all-reduce's Work to DDP's C++ reducer, which takes only c10d's own Work:
    # calls from torch get the real object back (their end still recorded).
    (count0, ended0), (count1, ended1) = dtlab.launch(uneven_join, 2, progress=False, timeout_s=30)
    assert count0 > 0 and count1 > 0 and ended0 and ended1


def test_recorder_off_records_nothing_and_uninstall_restores_torch():
    recorder.uninstall()  # an earlier test in this process may have recorded: start from torch's own functions
    original = dist.all_reduce
    recorder.install()
    assert dist.all_reduce is not original and dist.all_reduce.__dtlab_original__ is original
    assert dist.distributed_c10d.all_reduce is dist.all_reduce  # one wrapper for both names
    recorder.uninstall()
    assert dist.all_reduce is original

    def plain(info):
        dist.all_reduce(torch.ones(1))
        return len(instrument.active().events) if instrument.active() else None

    assert dtlab.launch(plain, 2, progress=False, record=False) == [None, None]


def test_bus_bandwidth_follows_nccl_tests():
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)  # 2(n-1)/n
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)  # (n-1)/n
    assert bus_factor("reduce_scatter_tensor", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 4) == 1.0
    assert algbw(1e9, 0.5) == pytest.approx(2e9)
    assert busbw("all_reduce", 1e9, 0.5, 2) == pytest.approx(2e9)  # factor 1 at n=2
    assert busbw("all_reduce", 8e6, 0.01, 8) == pytest.approx(8e8 * 1.75)
    assert busbw("all_gather", 3e6, 1e-3, 3) == pytest.approx(3e9 * 2 / 3)


def _row(op, nbytes, start, end, n=2, rank=0):
    return {"rank": rank, "seq": 0, "op": op, "bytes": nbytes, "dtype": "float32", "group_size": n, "peer": None,
            "start": start, "end": end, "wait_s": 0.0, "async": False, "tag": "", "step": 0}


def test_events_frame_computes_bandwidth_columns():
    df = events_frame([_row("all_reduce", 4_000_000, 10.0, 10.002, n=4), _row("broadcast", 1000, 11.0, 11.001)])
    assert df["algbw"].tolist() == pytest.approx([2e9, 1e6])
    assert df["busbw"].tolist() == pytest.approx([3e9, 1e6])


def test_chrome_trace_has_one_process_per_rank():
    events = [_row("all_reduce", 16, 1.0, 1.5, rank=0), _row("all_reduce", 16, 1.1, 1.5, rank=1)]
    phases = [{"rank": 0, "phase": "forward", "start": 0.5, "end": 1.0, "step": 0}]
    trace = json.loads(json.dumps(chrome_trace(events, phases)))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert [e["ts"] for e in spans] == pytest.approx([0.0, 0.5e6, 0.6e6])
    assert spans[1]["dur"] == pytest.approx(0.5e6)
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M"}
    assert names == {"rank 0", "rank 1"}
