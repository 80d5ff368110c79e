"""The widget panel without a browser: validation, a run in the background, stop, history, errors."""

from __future__ import annotations

import time

import pytest

from dtlab.widgets import Lab, load_history

pytestmark = pytest.mark.usefixtures("no_survivors")


def wait_for(lab: Lab, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while lab._thread is not None and lab._thread.is_alive():
        assert time.time() < deadline, "the run did not finish"
        time.sleep(0.1)


def test_invalid_combination_is_explained_not_raised(tmp_path):
    lab = Lab(history=tmp_path)
    lab.tier.value = "ddp"
    lab.world_size.value = 3  # 64 is not divisible by 3
    assert "cannot run this" in lab.message.value and "global_batch_size" in lab.message.value
    assert lab.run_button.disabled
    lab.world_size.value = 2
    assert "ready" in lab.message.value and not lab.run_button.disabled


def test_only_the_tiers_knobs_are_enabled(tmp_path):
    lab = Lab(history=tmp_path)
    lab.tier.value = "single"
    assert lab.world_size.disabled and lab.bucket.disabled and lab.hook.disabled
    lab.tier.value = "zero"
    assert not lab.world_size.disabled and not lab.bucket.disabled
    lab.tier.value = "ddp"
    lab.hook.value = "bf16"  # refused on gloo, explained in the panel
    assert "bf16" in lab.message.value and lab.run_button.disabled


def test_run_shows_progress_result_and_saves_history(tmp_path):
    lab = Lab(history=tmp_path, tier="ddp", world_size=2, steps=10)
    lab.run_button.click()
    wait_for(lab)
    assert "finished" in lab.status.value, lab.status.value
    assert [b.value for b in lab.bars.children] == [10, 10]  # one bar per rank, complete
    images = [c for c in lab.result.children if c.__class__.__name__ == "Image"]
    assert images and all(img.value[:4] == b"\x89PNG" for img in images)
    runs = load_history(tmp_path)
    assert len(runs) == 1 and (next(iter(runs.values())) / "result.json").exists()
    # a new panel (a restarted kernel) finds the run on disk and compares it
    again = Lab(history=tmp_path)
    again.compare_pick.value = tuple(again.compare_pick.options)
    again.compare_button.click()
    assert any(c.__class__.__name__ == "Image" for c in again.compare_out.children)


def test_stop_button_ends_the_run(tmp_path):
    lab = Lab(history=tmp_path, tier="ddp", world_size=2, steps=500, model_size=1024)
    lab.batch.value = 1024
    lab.run_button.click()
    time.sleep(3)
    lab.stop_button.click()
    wait_for(lab, timeout=20)
    assert "stopped" in lab.status.value
    assert not load_history(tmp_path)


def test_callback_errors_are_shown_in_the_log(tmp_path):
    lab = Lab(history=tmp_path)
    broken = lab._guard(lambda: 1 / 0)
    broken()
    assert any("ZeroDivisionError" in o.get("text", "") for o in lab.log.outputs)


def test_link_cap_and_fault_knobs_follow_the_tier(tmp_path):
    lab = Lab(history=tmp_path)
    lab.tier.value = "multinode"
    assert not lab.link.disabled and lab.fault.disabled
    assert lab.config().tier_options.nnodes == 2
    lab.tier.value = "elastic"
    assert lab.link.disabled and not lab.fault.disabled
    lab.steps.value, lab.fault.value = 20, "sigkill"
    assert lab.config().tier_options.faults == ("sigkill:10:1",)
    assert "sigkill:10:1" in lab.message.value


def test_a_fault_picked_in_the_panel_restarts_the_run_and_loses_nothing(tmp_path):
    lab = Lab(history=tmp_path, tier="elastic", world_size=2, steps=10, model_size=16)
    clean = lab.run_and_wait(timeout_s=120)
    lab.fault.value = "exception"
    faulted = lab.run_and_wait(timeout_s=120)
    assert "finished" in lab.status.value, lab.status.value
    assert [e["step"] for e in faulted.run_events if e["kind"] == "fault"] == [5]
    assert faulted.max_param_diff(clean) == 0.0
    images = [c for c in lab.result.children if c.__class__.__name__ == "Image"]
    assert len(images) == 3  # loss, step breakdown and the elastic timeline
