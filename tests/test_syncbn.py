"""CPUSyncBatchNorm: global-batch numerics, the single-rank path, DDP parity, and conversion."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dtlab
from dtlab import instrument
from dtlab.tiers.parts.syncbn import CPUSyncBatchNorm, convert_sync_batchnorm

pytestmark = pytest.mark.usefixtures("no_survivors")

WORLD = 2


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def _all_reduces() -> int:
    rec = instrument.active()
    return sum(1 for row in rec.rows() if row["op"] == "all_reduce") if rec is not None else -1


# -- 1. numerics against single-device BatchNorm on the concatenated batch --------------------------------------------
def _numerics(info, shape, loss_kind):
    """Single-device BN on the full batch (computed here, on every rank) vs CPUSyncBatchNorm on this rank's rows.

    loss_kind "global": rank r's loss is sum over its rows of out*w, divided by the GLOBAL batch size N, so the
    ranks' losses add up to the single-device loss L = sum(out*w) / N.
    loss_kind "local": rank r's loss is divided by its LOCAL batch size n = N/W (what a DDP training loop does),
    so the ranks' losses average to L.
    """
    torch.manual_seed(0)
    n_global = shape[0]
    x = torch.randn(shape) * 2.0 + 0.5
    loss_w = torch.randn(shape)
    ref = (nn.BatchNorm2d if len(shape) == 4 else nn.BatchNorm1d)(shape[1])
    with torch.no_grad():
        ref.weight.copy_(torch.rand(shape[1]) + 0.5)
        ref.bias.copy_(torch.randn(shape[1]))
    bn = convert_sync_batchnorm(copy.deepcopy(ref))
    assert isinstance(bn, CPUSyncBatchNorm)

    x_ref = x.clone().requires_grad_()
    out_ref = ref(x_ref)
    ((out_ref * loss_w).sum() / n_global).backward()

    n = n_global // info.world_size
    rows = slice(info.rank * n, (info.rank + 1) * n)
    x_mine = x[rows].clone().requires_grad_()
    before = _all_reduces()
    out = bn(x_mine)
    divisor = n_global if loss_kind == "global" else n
    ((out * loss_w[rows]).sum() / divisor).backward()
    collectives = _all_reduces() - before

    # Weight/bias gradients are local sums; average them over ranks as DDP does.
    grads = torch.stack([bn.weight.grad, bn.bias.grad])
    dist.all_reduce(grads)
    grads /= info.world_size
    # The relations that must hold (see dtlab/syncbn.py's docstring):
    #   "global": grad_x == dL/dx rows;      mean over ranks of grad_w == dL/dw / W  (their SUM is dL/dw)
    #   "local":  grad_x == W * dL/dx rows;  mean over ranks of grad_w == dL/dw       (what DDP hands the optimizer)
    x_scale = 1.0 if loss_kind == "global" else float(info.world_size)
    w_scale = 1.0 / info.world_size if loss_kind == "global" else 1.0
    return {
        "out": _max_diff(out, out_ref[rows]),
        "grad_x": _max_diff(x_mine.grad, x_scale * x_ref.grad[rows]),
        "grad_weight": _max_diff(grads[0], w_scale * ref.weight.grad),
        "grad_bias": _max_diff(grads[1], w_scale * ref.bias.grad),
        "running_mean": _max_diff(bn.running_mean, ref.running_mean),
        "running_var": _max_diff(bn.running_var, ref.running_var),
        "tracked": int(bn.num_batches_tracked),
        "collectives": collectives,
        # A rank whose slice alone were normalised would be far off: the check has teeth.
        "local_stats_gap": _max_diff(nn.functional.batch_norm(x[rows], None, None, ref.weight, ref.bias, True),
                                     out_ref[rows]),
    }


@pytest.mark.parametrize("loss_kind", ["global", "local"])
def test_matches_single_device_batchnorm_on_the_global_batch(loss_kind):
    for shape in [(8, 3, 5, 5), (8, 3)]:
        results = dtlab.launch(_numerics, WORLD, args=(shape, loss_kind), progress=False)
        for r in results:
            for key in ("out", "grad_x", "grad_weight", "grad_bias", "running_mean", "running_var"):
                assert r[key] <= 1e-6, (shape, key, r)
            assert r["tracked"] == 1
            assert r["collectives"] == 2, "one all_reduce in forward, one in backward, both seen by CommRecorder"
            assert r["local_stats_gap"] > 1e-2


# -- 2. one rank, or no process group: exactly plain BatchNorm, no communication --------------------------------------
def _compare_with_plain(momentum):
    torch.manual_seed(1)
    ref = nn.BatchNorm2d(3, momentum=momentum)
    bn = convert_sync_batchnorm(copy.deepcopy(ref))
    for _ in range(3):  # training steps, then eval
        x = torch.randn(6, 3, 4, 4)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ref(xa), bn(xb)
        ya.pow(2).sum().backward()
        yb.pow(2).sum().backward()
        assert torch.equal(ya, yb) and torch.equal(xa.grad, xb.grad)
    assert torch.equal(ref.weight.grad, bn.weight.grad) and torch.equal(ref.bias.grad, bn.bias.grad)
    for name, buf in ref.named_buffers():
        assert torch.equal(buf, dict(bn.named_buffers())[name]), name
    ref.eval()
    bn.eval()
    x = torch.randn(2, 3, 4, 4)
    assert torch.equal(ref(x), bn(x))
    return True


def _world_one(info):
    before = _all_reduces()
    for momentum in (0.1, None):
        _compare_with_plain(momentum)
    return _all_reduces() - before


def test_without_process_group_is_plain_batchnorm(monkeypatch):
    assert not dist.is_initialized()

    def refuse(*args, **kwargs):
        raise AssertionError("no collective expected")

    monkeypatch.setattr(dist, "all_reduce", refuse)
    for momentum in (0.1, None):
        assert _compare_with_plain(momentum)


def test_world_size_one_is_plain_batchnorm_and_communicates_nothing():
    assert dtlab.launch(_world_one, 1, progress=False) == [0]


# -- 3. the lesson: DDP at world size 2 matches one device only with synchronised batch norm --------------------------
def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(4, 10))


def _batches():
    g = torch.Generator().manual_seed(1)
    return torch.randn(10, 16, 1, 8, 8, generator=g) * 1.5 + 0.3, torch.randint(0, 10, (10, 16), generator=g)


def _train(model, xs, ys, rows=slice(None)):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
        opt.step()


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}


def _ddp_runs(info, xs, ys):
    torch.set_num_threads(1)  # two ranks on two cores
    n = xs.shape[1] // info.world_size
    rows = slice(info.rank * n, (info.rank + 1) * n)
    out = {}
    for synced in (True, False):
        model = _cnn()
        if synced:
            model = convert_sync_batchnorm(model)
        ddp = nn.parallel.DistributedDataParallel(model)
        _train(ddp, xs, ys, rows)
        out[synced] = _state(model)
    return out


def test_ddp_with_converted_batchnorm_matches_single_device():
    xs, ys = _batches()
    single = _cnn()
    _train(single, xs, ys)
    want = _state(single)
    results = dtlab.launch(_ddp_runs, WORLD, args=(xs, ys), progress=False)
    for r in results:
        synced = max(_max_diff(r[True][k], want[k]) for k in want)
        unsynced = max(_max_diff(r[False][k], want[k]) for k in want)
        assert synced <= 1e-5, synced  # parameters and running stats alike
        assert unsynced > 1e-4, unsynced  # the control: per-rank statistics train a different model


# -- 4. conversion -----------------------------------------------------------------------------------------------------
def test_convert_keeps_weights_and_buffers_and_is_idempotent():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3, eps=1e-3, momentum=None), nn.Flatten(),
                          nn.Sequential(nn.Linear(3 * 4 * 4, 5), nn.BatchNorm1d(5, affine=False, momentum=0.3)))
    for _ in range(3):
        model(torch.randn(4, 1, 6, 6))  # non-trivial running stats
    model.eval()
    old = {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}
    x = torch.randn(4, 1, 6, 6)
    expected = model(x)

    converted = convert_sync_batchnorm(model)
    new = dict(converted.named_modules())
    for name, m in old.items():
        c = new[name]
        assert type(c) is CPUSyncBatchNorm
        assert (c.num_features, c.eps, c.momentum, c.affine, c.track_running_stats, c.training) == (
            m.num_features, m.eps, m.momentum, m.affine, m.track_running_stats, m.training)
        for attr in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(c, attr) is getattr(m, attr), attr  # shared, as torch's converter does
    assert int(new["1"].num_batches_tracked) == 3
    assert torch.equal(converted(x), expected)

    again = convert_sync_batchnorm(converted)
    assert again is converted and all(a is b for a, b in zip(again.modules(), new.values()))
    root = convert_sync_batchnorm(nn.BatchNorm1d(2))
    assert type(root) is CPUSyncBatchNorm and convert_sync_batchnorm(root) is root
