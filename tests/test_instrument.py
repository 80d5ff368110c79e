"""CommRecorder: every path to a collective, exact counts and bytes, DDP buckets, bandwidth formulas, traces."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

# Bound at import, long before any recorder starts: the recorder must still see these calls.
from torch.distributed import P2POp, all_gather_into_tensor, all_reduce, batch_isend_irecv, irecv, isend

import dtlab
from dtlab import instrument
from dtlab.instrument import algbw, bus_factor, busbw, chrome_trace, events_frame, ops, recorder
from dtlab.tiers.ddp import Options as DDPOptions

pytestmark = pytest.mark.usefixtures("no_survivors")


def _seen(rec, before):
    return [(e.op, e.bytes, e.group, e.group_size, e.peer, e.tag) for e in rec.events[before:]]


def every_path(info):
    """On 3 ranks: each path to a collective, what the recorder saw of it."""
    from torch.distributed import broadcast as bound_after_start  # bound after the recorder started
    from torch.distributed._functional_collectives import all_reduce as functional_all_reduce
    from torch.distributed._functional_collectives import wait_tensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    rec, rank, world = instrument.active(), info.rank, info.world_size
    name = dist.group.WORLD.group_name
    sub = dist.new_group([1, 2])  # group ranks 0, 1 are global ranks 1, 2
    mesh = init_device_mesh("cpu", (world,))
    seen = {}

    def path(key, call):
        before = len(rec.events)
        call()
        seen[key] = _seen(rec, before)

    path("dist", lambda: dist.all_reduce(torch.ones(4)))
    path("bound_at_import", lambda: (all_reduce(torch.ones(5)), all_gather_into_tensor(torch.zeros(2 * world),
                                                                                        torch.ones(2))))
    path("bound_after_start", lambda: bound_after_start(torch.ones(3, dtype=torch.float64), src=2))
    path("distributed_c10d", lambda: dist.distributed_c10d.all_reduce(torch.ones(6)))
    path("group_method", lambda: dist.group.WORLD.allreduce([torch.ones(7)]).wait())
    if rank < 2:  # P2POp compares its op against torch's own isend/irecv: bound names must still pass
        peer = 1 - rank
        path("p2pop", lambda: [w.wait() for w in batch_isend_irecv([P2POp(isend, torch.ones(8), peer),
                                                                   P2POp(irecv, torch.zeros(8), peer)])])
    path("functional", lambda: wait_tensor(functional_all_reduce(torch.ones(9), "sum", dist.group.WORLD)))
    path("dtensor", lambda: DTensor.from_local(torch.ones(2), mesh, [Shard(0)]).full_tensor())
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(4, 4))
    with rec.channels(["ddp_buckets"]):
        path("ddp_reducer", lambda: ddp(torch.ones(2, 4)).sum().backward())
    if rank in (1, 2):
        path("sub_group", lambda: dist.all_reduce(torch.ones(10), group=sub))
        t = torch.ones(11)
        path("sub_group_p2p", lambda: dist.send(t, group=sub, group_dst=1) if rank == 1
             else dist.recv(t, group=sub, group_src=0))
    return name, sub.group_name if rank in (1, 2) else None, seen


def test_every_path_to_a_collective_is_recorded():
    out = dtlab.launch(every_path, 3, progress=False, timeout_s=60)
    for rank, (world, sub, seen) in enumerate(out):
        assert seen["dist"] == [("all_reduce", 16, world, 3, None, "")]
        assert seen["bound_at_import"] == [("all_reduce", 20, world, 3, None, ""),
                                           ("all_gather_into_tensor", 24, world, 3, None, "")]
        assert seen["bound_after_start"] == [("broadcast", 24, world, 3, 2, "")]
        assert seen["distributed_c10d"] == [("all_reduce", 24, world, 3, None, "")]
        assert seen["group_method"] == [("all_reduce", 28, world, 3, None, "")]
        if rank < 2:
            assert seen["p2pop"] == [("isend", 32, world, 3, 1 - rank, "batched"),
                                     ("irecv", 32, world, 3, 1 - rank, "batched")]
        assert seen["functional"] == [("all_reduce", 36, world, 3, None, "")]
        [(op, nbytes, _, size, _, _)] = seen["dtensor"]  # on the mesh's group
        assert (op, nbytes, size) == ("all_gather_into_tensor", 24, 3)
        assert seen["ddp_reducer"] == [("all_reduce", 80, world, 3, None, "ddp_bucket:0")]
        if rank in (1, 2):
            assert sub != world
            assert seen["sub_group"] == [("all_reduce", 40, sub, 2, None, "")]
            # group_dst/group_src are ranks within the group: recorded as the global rank they reach
            assert seen["sub_group_p2p"] == [("send" if rank == 1 else "recv", 44, sub, 2, 3 - rank, "")]


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
    sent = [1, 3] if rank == 0 else [2, 2]  # rows to rank 0, to rank 1
    got = [1, 2] if rank == 0 else [3, 2]  # rows from rank 0, from rank 1
    dist.all_to_all_single(torch.zeros(sum(got)), torch.ones(4), got, sent)  # input: 16 B
    return [e.row() for e in rec.events[before:]]


def test_known_sequence_gives_exact_counts_bytes_and_timing():
    out = dtlab.launch(known_sequence, 2, progress=False)
    for rank, events in enumerate(out):
        got = [(e["op"], e["bytes"]) for e in events]
        p2p = ("send", 40) if rank == 0 else ("recv", 40)
        assert got == [("all_reduce", 16), ("broadcast", 64), ("all_gather", 24), ("reduce_scatter_tensor", 40),
                       ("all_gather_into_tensor", 48), ("barrier", 0), p2p, ("all_reduce", 200),
                       ("all_to_all_single", 16)]
        assert {e["group_size"] for e in events} == {2}
        async_ev = events[7]
        assert async_ev["async"] and async_ev["dtype"] == "float16" and not events[0]["async"]
        assert all(e["end"] >= e["start"] for e in events) and async_ev["wait_s"] >= 0
        assert events[6]["peer"] == 1 - rank
        assert events[8]["input_splits"] == ([1, 3] if rank == 0 else [2, 2])
        assert events[8]["output_splits"] == ([1, 2] if rank == 0 else [3, 2])


def ddp_steps(info, bucket_cap_mb, steps):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    cfg = dtlab.RunConfig(tier="ddp", world_size=info.world_size, tier_options=DDPOptions(bucket_cap_mb=bucket_cap_mb))
    from dtlab.instrument.buckets import bucket_layout
    from dtlab.tiers.ddp import Strategy

    strategy = Strategy(cfg, info)
    rec = instrument.active()
    ddp = strategy.wrap(model)
    init = [e.row() for e in rec.events]
    per_step, layouts = [], []
    with rec.channels(strategy.comm_channels):
        for step in range(steps):
            rec.step = step
            ddp(torch.randn(8, 64)).sum().backward()
            per_step.append([e.row() for e in rec.events if e.step == step])
            layouts.append(bucket_layout(ddp)["bucket_sizes_bytes"])
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    return init, per_step, grad_bytes, layouts


def test_ddp_bucket_events_match_ddp_buckets():
    init, per_step, grad_bytes, layouts = dtlab.launch(ddp_steps, 2, args=(0.02, 3), progress=False)[0]
    # DDP's construction, as it goes on the wire: a shape check (an all-gather) and its broadcast of the
    # parameters from rank 0 (_broadcast_coalesced, from C++)
    assert [e["op"] for e in init][0] == "all_gather"
    broadcasts = [e for e in init if e["op"] == "broadcast"]
    assert broadcasts and all(e["peer"] == 0 for e in broadcasts)
    assert max(e["bytes"] for e in broadcasts) == grad_bytes
    assert len(layouts[0]) == 1 and len(layouts[-1]) == 3  # one bucket, then rebuilt to 0.02 MB ones
    for step, (events, buckets) in enumerate(zip(per_step, layouts)):
        reduces = [e for e in events if e["op"] == "all_reduce"]
        assert [e["bytes"] for e in reduces] == buckets
        assert [e["tag"] for e in reduces] == [f"ddp_bucket:{i}" for i in range(len(buckets))]
        assert all(e["end"] >= e["start"] for e in reduces)
        assert sum(e["bytes"] for e in reduces) == grad_bytes
        # the second step's forward rebuilds the buckets: rank 0 broadcasts the new layout (from C++)
        rebuild = [(e["op"], e["peer"]) for e in events if e["op"] != "all_reduce"]
        assert rebuild == ([("broadcast", 0)] * len(rebuild) if step == 1 else []) and (step != 1 or rebuild)


def uneven_join(info):
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
    with Join([model]):
        for _ in range(2 + 2 * info.rank):  # rank 1 has more batches: Join shadows its all-reduces on rank 0
            model(torch.randn(8, 4)).sum().backward()
    ops_seen = [e.op for e in instrument.active().events]
    return ops_seen.count("all_reduce"), all(e.end is not None for e in instrument.active().events)


def test_ddp_join_runs_under_the_recorder_and_its_all_reduces_are_recorded():
    (count0, ended0), (count1, ended1) = dtlab.launch(uneven_join, 2, progress=False, timeout_s=30)
    assert count0 > 0 and count1 > 0 and ended0 and ended1


def tags_and_quiet(info):
    rec = instrument.active()
    before = len(rec.events)
    seen = {}

    def other_thread():
        seen["inside"] = rec.tag
        dist.all_reduce(torch.ones(1))  # not tagged: the tag belongs to the main thread

    with rec.tagged("main"):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        dist.all_reduce(torch.ones(2))
        with rec.quiet():
            dist.all_reduce(torch.ones(3))  # not recorded
    return seen["inside"], [(e.bytes, e.tag) for e in rec.events[before:]]


def test_tags_and_quiet_are_per_thread():
    for inside, events in dtlab.launch(tags_and_quiet, 2, progress=False):
        assert inside == ""
        assert events == [(4, ""), (8, "main")]


def test_recorder_registers_its_kernels_only_while_it_runs():
    def has_kernel() -> bool:
        return torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "BackendSelect")

    wait = dist.distributed_c10d.Work.wait
    assert not recorder.installed() and not has_kernel()
    with instrument.CommRecorder(0):
        assert recorder.installed() and has_kernel()
        assert dist.distributed_c10d.Work.wait is not wait
    assert not recorder.installed() and not has_kernel()
    assert dist.distributed_c10d.Work.wait is wait

    def plain(info):
        dist.all_reduce(torch.ones(1))
        return instrument.active(), recorder.installed()

    assert dtlab.launch(plain, 2, progress=False, record=False) == [(None, False), (None, False)]


def test_a_renamed_argument_fails_loudly(monkeypatch):
    assert "allreduce_" in ops.check_schemas()
    monkeypatch.setitem(ops.C10D_OPS, "allreduce_", ops.OpRule("all_reduce", "tensor_list"))
    with pytest.raises(RuntimeError, match=r"c10d::allreduce_'s argument\(s\) tensor_list"):
        ops.check_schemas(("allreduce_",))


def backend_directly(info):
    backend = dist.group.WORLD._get_backend(torch.device("cpu"))
    for _ in range(2):
        backend.allreduce([torch.ones(2)]).wait()
    return len(instrument.active().events)


def test_a_call_below_the_dispatcher_is_named_once():
    with pytest.warns(RuntimeWarning, match="not recorded: Backend.allreduce") as caught:
        counts = dtlab.launch(backend_directly, 2, progress=False)
    assert counts == [0, 0]
    assert sum("Backend.allreduce" in str(w.message) for w in caught) == 1  # once, not per rank or per call


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
    return {"rank": rank, "seq": 0, "op": op, "bytes": nbytes, "dtype": "float32", "group_size": n, "group": "0",
            "peer": None, "start": start, "end": end, "wait_s": 0.0, "async": False, "tag": "", "step": 0}


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


def nothing_kept(info):
    import gc
    import time
    import weakref

    t = torch.ones(1000)
    ref = weakref.ref(t)
    work = dist.all_reduce(t, async_op=True)
    work.get_future().wait()  # complete, never waited on through the Work
    del t, work
    for _ in range(100):  # gloo's backend thread may hold the tensor a moment after the future completes
        gc.collect()
        if ref() is None:
            break
        time.sleep(0.02)
    return ref() is None, len(instrument.active()._in_flight)


def test_the_recorder_keeps_no_tensor_of_a_completed_call_alive():
    assert dtlab.launch(nothing_kept, 2, progress=False) == [(True, 0), (True, 0)]
