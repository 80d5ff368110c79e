"""Context parallelism: ring attention trains the single device's charformer, passing K/V around a ring; every
method and balance computes SDPA's attention (tests/test_cp_methods.py trains with them)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F

from dtlab import RunConfig
from dtlab.core.results import RunResult
from dtlab.launch.local import launch
from dtlab.tiers import cp
from dtlab.tiers.cp import BACKWARD_TAG, FORWARD_TAG, ring_attention, ring_hops_per_block
from dtlab.tiers.parts import cp_layout
from dtlab.tiers.parts.cp_ulysses import HeadSwap
from dtlab.train import run
from tests.parity import TOL, job, single

pytestmark = pytest.mark.usefixtures("no_survivors")

ADAM_LR = 0.003  # Adam turns rounding-level gradient noise into lr-sized steps: see test_transformer_parity_with_adam


def text_job(optimizer: str, **changes) -> RunConfig:
    return job(optimizer, model="charformer", dataset="text", **changes)


@functools.cache
def reference(optimizer: str) -> RunResult:
    if optimizer == "sgd":
        return single("sgd", model="charformer", dataset="text")  # shared with other modules' tests
    return run(text_job(optimizer, lr=ADAM_LR), progress=False)


@functools.cache
def cp_run(optimizer: str, world_size: int) -> RunResult:
    """A cp run of the parity job (cached: the ring-pattern test reads the world-4 run's events)."""
    lr = ADAM_LR if optimizer == "adam" else job("sgd").lr
    return run(text_job(optimizer, lr=lr, tier="cp", world_size=world_size), progress=False)


@pytest.mark.parametrize(("optimizer", "world_size"), [("sgd", 2), ("adam", 2), ("sgd", 4)])
def test_cp_matches_single(optimizer, world_size):
    ref, result = reference(optimizer), cp_run(optimizer, world_size)
    assert result.max_param_diff(ref) <= TOL
    assert len({r.params_checksum for r in result.ranks}) == 1  # every rank holds the same whole model
    # Each rank reports the global mean loss (its chunk's mean, all-reduced), the single device's loss.
    ref_loss = [s["loss"] for s in ref.ranks[0].steps]
    for r in result.ranks:
        assert [s["loss"] for s in r.steps] == pytest.approx(ref_loss, abs=TOL)
    # Evaluation ran the ordinary (SDPA) forward on whole sequences: the same parameters evaluate the same.
    assert result.ranks[0].evaluation["loss"] == pytest.approx(ref.ranks[0].evaluation["loss"], abs=1e-4)


def test_ring_pattern_from_recorded_events():
    n = 4
    result = cp_run("sgd", n)
    cfg = result.config
    events = result.events_frame()
    p2p = events[events["op"].isin(["isend", "irecv"]) & (events["step"] >= 0)]
    for r in range(n):
        mine = p2p[p2p["rank"] == r]
        sends, recvs = mine[mine["op"] == "isend"], mine[mine["op"] == "irecv"]
        assert set(sends["peer"]) == {(r + 1) % n}  # only ever to the next rank ...
        assert set(recvs["peer"]) == {(r - 1) % n}  # ... and from the previous one
        # Per attention block (model_depth of them) and step: n-1 K/V hops in forward; in backward
        # n-1 K/V hops again plus n dK/dV hops (the last returns them to their owner): 3n - 2.
        per_step = sends.groupby("step").size()
        assert ring_hops_per_block(n) == 3 * n - 2
        assert list(per_step.index) == list(range(cfg.steps))
        assert set(per_step) == {cfg.model_depth * (3 * n - 2)}
        assert set(recvs.groupby("step").size()) == {cfg.model_depth * (3 * n - 2)}
        forward = sends[sends["tag"] == FORWARD_TAG].groupby("step").size()
        backward = sends[sends["tag"] == BACKWARD_TAG].groupby("step").size()
        assert set(forward) == {cfg.model_depth * (n - 1)} and set(backward) == {cfg.model_depth * (2 * n - 1)}
    # Every hop carries one chunk's K and V (or dK and dV): 2 x batch x chunk x width float32.
    kv_bytes = 2 * cfg.global_batch_size * (32 // n) * cfg.model_size * 4
    assert set(p2p["bytes"]) == {kv_bytes}
    assert result.ranks[0].strategy == {"method": "ring", "balance": "contiguous", "sequence_chunk": 32 // n,
                                        "chunks": [0], "ring_steps": n, "isends_per_block": 3 * n - 2}
    # Gradients: one coalesced all-reduce per step (plus the 4-byte loss), not one per tensor.
    assert result.comm_summary()["all_reduce"]["calls_per_step"] == pytest.approx(2.0)


def against_sdpa(info, seq_len: int, seed: int) -> dict[str, float]:
    """This rank's largest error of each method and balance against SDPA on the whole sequence, output and
    gradients of q, k, v, in float32 and float64 (6 heads: Ulysses splits them over 2 or 3 ranks)."""
    errors = {}
    n = info.world_size
    for method, balance, dtype in itertools.product(cp.METHODS, cp.BALANCES, (torch.float32, torch.float64)):
        g = torch.Generator().manual_seed(seed)
        q, k, v, dout = (torch.randn(3, 6, seq_len, 8, generator=g, dtype=dtype) for _ in range(4))
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        expected = F.scaled_dot_product_attention(*full, is_causal=True)
        expected.backward(dout)
        mine = torch.tensor(cp_layout.positions(info.rank, n, balance, seq_len))
        local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        comm = cp.Ring() if method == "ring" else HeadSwap()
        if method == "ring" and balance == "contiguous":  # the tier's attention is ring_attention's
            out = ring_attention(*local)
        else:
            out = cp.attention(cp.Options(method, balance), n, comm, seq_len)(*local)
        out.backward(dout[:, :, mine])
        pairs = [(out, expected[:, :, mine])] + [(a.grad, b.grad[:, :, mine]) for a, b in zip(local, full)]
        errors[(method, balance, str(dtype))] = max((a - b).abs().max().item() for a, b in pairs)
    return errors


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_method_and_balance_matches_sdpa(world_size):
    for errors in launch(against_sdpa, world_size, args=(12, 0), progress=False).values:
        assert len(errors) == 8
        for (method, balance, dtype), error in errors.items():
            assert error <= (1e-5 if dtype == "torch.float32" else 1e-12), (method, balance, dtype, error)


@pytest.mark.parametrize(("changes", "field"), [
    ({"model": "mlp", "dataset": "digits"}, "RunConfig.model"),
    ({"world_size": 3, "global_batch_size": 63}, "world_size"),  # 32 positions do not split in 3
])
def test_bad_configs_fail_before_launch(changes, field):
    with pytest.raises(ValueError, match=field):
        RunConfig(**{"tier": "cp", "model": "charformer", "dataset": "text", **changes})
