"""The widget panel without a browser: validation, a run in the background, stop, history, errors."""

from __future__ import annotations

import time

import ipywidgets as w
import pytest

from dtlab import tiers
from dtlab.app.widgets import Lab, load_history
from dtlab.core import options

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


def shown_controls(lab: Lab) -> list:
    """The option controls on screen: the grid under the tier's header (none for a tier without options)."""
    return list(lab.options_box.children[1].children) if len(lab.options_box.children) > 1 else []


def test_only_the_tiers_knobs_are_shown(tmp_path):
    lab = Lab(history=tmp_path)
    lab.tier.value = "single"
    assert lab.world_size.disabled and shown_controls(lab) == []
    assert "no options" in lab.options_box.children[0].value
    lab.tier.value = "zero"
    assert not lab.world_size.disabled
    assert shown_controls(lab) == list(lab.option_controls["zero"].values())
    lab.tier.value = "ddp"
    lab.option_controls["ddp"]["comm_hook"].value = "bf16"  # refused on gloo, explained in the panel
    assert "bf16" in lab.message.value and lab.run_button.disabled


def test_every_option_of_every_tier_has_a_control_and_invalid_values_disable_run(tmp_path):
    lab = Lab(history=tmp_path)
    kinds = {"bool": w.Checkbox, "int": w.IntText, "float": w.FloatText, "str": w.Text, "tuple": w.Text}
    for tier in tiers.TIERS:
        spec = tiers.get(tier)
        lab.tier.value = tier
        assert "ready" in lab.message.value and not lab.run_button.disabled, (tier, lab.message.value)
        fields = options.fields(spec.options)
        assert set(lab.option_controls[tier]) == set(fields)
        for name, kind in fields.items():
            control = lab.option_controls[tier][name]
            assert control in shown_controls(lab) and control.description == name
            assert isinstance(control, w.Dropdown if name in spec.choices else kinds[kind]), (tier, name)
            if kind not in ("int", "float"):
                continue
            default = control.value
            # no count, size, time or index of any tier may be negative (an index's "none" is -1: below it)
            control.value = min(-1, default - 1)
            assert "cannot run this" in lab.message.value and name in lab.message.value, (tier, name)
            assert lab.run_button.disabled, (tier, name)
            control.value = default
            assert "ready" in lab.message.value and not lab.run_button.disabled, (tier, name)
    # text fields: parsed as the command line parses them, errors named the same way
    lab.tier.value = "elastic"
    lab.option_controls["elastic"]["faults"].value = "sigkill:7:1,bogus"
    assert "faults entry &#x27;bogus&#x27; is invalid" in lab.message.value and lab.run_button.disabled
    lab.option_controls["elastic"]["faults"].value = "sigkill:7:1, exception:12:0"
    assert lab.config().tier_options.faults == ("sigkill:7:1", "exception:12:0") and not lab.run_button.disabled
    lab.option_controls["elastic"]["nnodes"].value = "two"
    assert "nnodes" in lab.message.value and lab.run_button.disabled


def test_the_knobs_of_fsdp_pipeline_and_rpc_reach_the_config(tmp_path):
    lab = Lab(history=tmp_path, tier="pipeline", schedule="1f1b", microbatches=8)
    assert lab.config().tier_options.schedule == "1f1b" and lab.config().tier_options.microbatches == 8
    lab.tier.value = "fsdp"
    lab.option_controls["fsdp"]["mixed_precision"].value = "bf16"
    lab.option_controls["fsdp"]["reshard_after_forward"].value = False
    o = lab.config().tier_options
    assert o.mixed_precision == "bf16" and o.reshard_after_forward is False
    lab.tier.value = "rpc"
    lab.option_controls["rpc"]["mode"].value = "async"
    assert lab.config().tier_options.mode == "async"
    with pytest.raises(ValueError, match="bucket_size"):
        Lab(history=tmp_path, tier="ddp", bucket_size=1)  # a typo is named, not ignored


def test_a_missing_checkpoint_is_refused_at_run_before_any_process(tmp_path):
    lab = Lab(history=tmp_path, tier="ddp", world_size=2, steps=10)
    lab.option_controls["ddp"]["resume_from"].value = str(tmp_path / "nowhere")
    lab.run_button.click()  # preflight: the folder is looked for only when Run is pressed
    assert lab._thread is None and "resume_from" in lab.message.value and lab.run_button.disabled
    with pytest.raises(ValueError, match="resume_from"):
        lab.run_and_wait()


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
    assert lab.option_controls["multinode"]["link_mbit"] in shown_controls(lab) and lab.fault.disabled
    assert lab.config().tier_options.nnodes == 2
    lab.tier.value = "elastic"
    assert lab.option_controls["multinode"]["link_mbit"] not in shown_controls(lab)
    assert not lab.fault.disabled and lab.fault in shown_controls(lab)
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
