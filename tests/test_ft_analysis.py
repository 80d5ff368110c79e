"""Reading and drawing runs of replica groups from hand-made events, and recording a process group's methods."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from dtlab import plots
from dtlab.instrument.recorder import CommRecorder, active, tag_methods
from dtlab.read import ft as ft_runs

from .test_plots import assert_png


def _events() -> list[dict]:
    """Two groups, 6 steps; group 1 is killed at step 3, group 0 runs step 3 again, group 1 rejoins healing."""
    t, out = 100.0, [{"time": 100.0, "kind": "lighthouse_start"}]

    def step(replica, attempt, s, committed=True, participants=2, healing=False):
        out.append({"time": t, "kind": "ft_step", "replica": replica, "attempt": attempt, "step": s,
                    "committed": committed, "participants": participants, "healing": healing, "quorum_id": 1})

    for s in range(3):
        t += 0.1
        step(0, 0, s)
        step(1, 0, s)
    t += 0.05
    out.append({"time": t, "kind": "fault", "replica": 1, "attempt": 0, "step": 3})
    out.append({"time": t + 0.01, "kind": "replica_start", "replica": 1, "attempt": 1})
    t += 0.1
    step(0, 0, 3, committed=False)
    t += 1.0
    out.append({"time": t, "kind": "ft_begin", "replica": 1, "attempt": 1, "step": 3, "healing": True})
    step(0, 0, 3, participants=1)
    step(1, 1, 3, participants=1, healing=True)
    for s in (4, 5):
        t += 0.1
        step(0, 0, s)
        step(1, 1, s)
    return out


def test_participants_missed_steps_and_recovery_are_read_from_the_events():
    events = _events()
    assert ft_runs.participants(events).to_dict() == {0: 2, 1: 2, 2: 2, 3: 1, 4: 2, 5: 2}
    assert ft_runs.missed_steps(events) == {0: [], 1: [3]}
    (r,) = ft_runs.recovery(events)
    assert r["replica"] == 1 and r["fault_step"] == 3 and r["rejoin_step"] == 3 and r["redone_steps"] == 1
    # fault at 100.35; group 1 rejoins (healing) at 101.45 and contributes again at 101.55
    assert r["recovery_s"] == pytest.approx(1.2) and r["rejoin_t"] - r["fault_t"] == pytest.approx(1.1)
    assert r["others_lost_s"] == pytest.approx(1.1 - 0.1)  # to group 0's next commit, less one ordinary step
    with pytest.raises(ValueError, match="not an ft run"):
        ft_runs.step_log([{"time": 1.0, "kind": "step", "step": 0}])


def test_the_replica_timeline_and_loss_against_time_draw(tmp_path):
    fig = plots.replica_timeline(ft_runs.timeline(_events()))
    assert [ax.get_title() for ax in fig.axes][0] == "Replica groups over time"
    assert_png(fig, tmp_path / "replicas.png")
    curve = pd.DataFrame({"step": range(10), "time_s": [0.1 * (i + 1) for i in range(10)],
                          "loss": [2.0 - 0.1 * i for i in range(10)]})
    fig = plots.loss_vs_time({"ddp": curve, "diloco": curve.assign(time_s=curve["time_s"] / 5)})
    assert [ax.get_title() for ax in fig.axes] == ["loss against steps", "loss against training time"]
    assert_png(fig, tmp_path / "loss.png")
    with pytest.raises(ValueError, match="missing column"):
        plots.loss_vs_time({"x": curve.drop(columns="time_s")})


class _Group:
    """Stands in for torchft's process group: calls reach c10d through methods of its own."""

    def allreduce(self, tensors, opts):
        return active().tag if active() is not None else None

    def send(self, tensors, dst, tag):
        return active().tag if active() is not None else None


def test_a_process_groups_own_methods_tag_their_calls():
    pg = _Group()
    tag_methods(pg, {"allreduce": "ft_cross_replica", "send": "ft_recovery"})
    tag_methods(pg, {"allreduce": "ft_cross_replica"})  # twice: wrapped once
    with CommRecorder(0) as rec:
        assert pg.allreduce([torch.ones(10)], None) == "ft_cross_replica"
        assert pg.send([torch.ones(4)], 1, 7) == "ft_recovery"
        assert rec.tag == ""  # the tag lasts for the call only
    assert pg.allreduce([torch.ones(1)], None) is None  # no recorder: nothing to tag, no error
