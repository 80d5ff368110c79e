"""The recorder's cost breakdown: the attribution's arithmetic, and the page against its committed result."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from dtlab.experiments import recorder_cost

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "docs" / "figures" / "recorder_cost.csv"


def _rounds(plain_us: list[float], recorded_us: list[float]) -> pd.DataFrame:
    rows = [{"rank": 0, "round": r, "variant": v, "seconds_per_call": us * 1e-6}
            for r, (p, q) in enumerate(zip(plain_us, recorded_us)) for v, us in (("plain", p), ("recorded", q))]
    rows.append({"rank": 0, "round": -1, "variant": "recorded", "seconds_per_call": 1.0})  # warm-up: left out
    rows.append({"rank": 1, "round": 0, "variant": "recorded", "seconds_per_call": 1.0})  # another rank: left out
    return pd.DataFrame(rows)


def test_the_measured_difference_is_shared_out_by_the_profile_and_set_up_calls_are_left_out():
    calls = 100
    profile = pd.DataFrame([
        {"file": "dispatch.py", "name": "kernel", "calls": 100, "self_s": 0.003},
        {"file": "recorder.py", "name": "begin", "calls": 100, "self_s": 0.001},
        {"file": "events.py", "name": "__init__", "calls": 100, "self_s": 0.0005},
        {"file": "recorder.py", "name": "add", "calls": 100, "self_s": 0.0005},
        {"file": "recorder.py", "name": "start", "calls": 1, "self_s": 0.5},  # once per loop: not per call
    ])
    table = recorder_cost.attribute(_rounds([10, 12, 11], [30, 33, 29]), profile, calls)
    assert table.attrs["extra_us"] == pytest.approx(20.0)  # median of 20, 21, 18
    assert table["attributed_us"].sum() == pytest.approx(20.0) and table["share"].sum() == pytest.approx(1.0)
    first = table.iloc[0]
    assert first.part.startswith("the Python kernel") and first.share == pytest.approx(0.6)
    event = table[table.part == "making and storing the event"].iloc[0]  # two functions, one part
    assert event.calls_per_collective == 2 and event.profiled_us == pytest.approx(10.0)
    assert not table.part.str.contains("start").any()


def test_the_page_shows_the_table_its_committed_result_gives():
    page = recorder_cost.DOC.read_text()
    shown = page.split(recorder_cost.BEGIN, 1)[1].split(recorder_cost.END, 1)[0].strip()
    assert shown == recorder_cost.from_csv(COMMITTED).strip()
