"""Exercise layer_flops: the reference equals the planner's count; wrong counts are named by their term; no ranks."""

from __future__ import annotations

import functools

import pytest

from dtlab import exercises
from dtlab.exercises import _progress, layer_flops
from dtlab.exercises.layer_flops import SHAPES, planner_count


@pytest.fixture(autouse=True)
def progress_log(tmp_path, monkeypatch):
    monkeypatch.setattr(_progress, "PROGRESS_LOG", tmp_path / "progress.jsonl")


def counted(hidden, heads, kv_heads, ffn, seq, batch, dtype_bytes, gated, *, per_mac=2, attention=4, kv_full=False,
            as_gated=None, scores=False, values=False, norms=True, adds=True, fused_qkv=True, passes=1):
    """A learner's count with one mistake switched on (the defaults give the right count)."""
    tokens = batch * seq
    kv = hidden if kv_full else kv_heads * (hidden // heads)
    gated = gated if as_gated is None else as_gated
    gemms = [(tokens, hidden + 2 * kv, hidden), (tokens, hidden, hidden), (tokens, (2 if gated else 1) * ffn, hidden),
             (tokens, hidden, ffn)]
    flops = passes * (sum(per_mac * m * n * k for m, n, k in gemms) + attention * tokens * seq * hidden)
    moved = sum(m * k + k * n + m * n for m, n, k in gemms) + tokens * (2 * hidden + 2 * kv)
    moved += (0 if fused_qkv else 2 * tokens * hidden) + (2 * batch * heads * seq * seq if scores else 0)
    moved += ((2 if gated else 1) + 1) * tokens * ffn + (4 if norms else 0) * tokens * hidden
    moved += (6 if adds else 0) * tokens * hidden
    return flops, moved if values else dtype_bytes * moved


WRONG = {  # the mistake -> what the feedback must say
    "per_mac=1": (dict(per_mac=1), "a multiply-add is 2 FLOPs"),
    "causal, halved": (dict(attention=2), "causal? The convention counts a causal attention as if unmasked"),
    "attention twice": (dict(attention=8), "attention FLOPs (what changes when the same tokens come in longer "
                                           "sequences) are 2x the planner's"),
    "one head's attention": (dict(attention=4 / 16), "one head's: add up the heads"),
    "K and V as wide as Q": (dict(kv_full=True), "do not change with kv_heads: with grouped-query attention"),
    "two matrices when gated": (dict(as_gated=False), "the MLP has three matrices when gated"),
    "forward and backward": (dict(passes=3), "that is forward and backward"),
    "the scores in memory": (dict(scores=True), "the attention scores? A flash attention never writes them"),
    "values, not bytes": (dict(values=True), "you counted values; a value is dtype_bytes bytes"),
    "no norms, no adds": (dict(norms=False, adds=False), "the two norms (each reads T x hidden and writes T x hidden) "
                                                         "and the two residual adds"),
    "no residual adds": (dict(adds=False), "the two residual adds are missing"),
    "Q, K and V apart": (dict(fused_qkv=False), "Q, K and V read the layer's input three times"),
}


def test_the_reference_and_the_mistakes_default_equal_the_planners_count_on_every_shape():
    assert {s.kv_heads < s.heads for s in SHAPES} == {True, False} and {s.gated for s in SHAPES} == {True, False}
    assert {s.dtype_bytes for s in SHAPES} == {2, 4} and any(s.kv_heads == 1 for s in SHAPES)
    for shape in SHAPES:
        assert layer_flops.layer_flops(*shape.args()) == planner_count(shape) == counted(*shape.args())
    # the planner's count is the textbook's: 2 x the weights' elements per token, plus attention's 4 T s h
    s = SHAPES[1]
    weights = s.hidden * (s.hidden + 2 * s.kv_heads * s.hidden // s.heads) + s.hidden ** 2 + 3 * s.hidden * s.ffn
    assert planner_count(s)[0] == 2 * s.tokens * weights + 4 * s.tokens * s.seq * s.hidden


def test_the_reference_passes_in_this_process_and_is_recorded(tmp_path):
    result = exercises.check("layer_flops", exercises.solution("layer_flops"))
    assert result.passed and f"on all {len(SHAPES)} shapes" in result.feedback
    last = _progress.read_rows(tmp_path / "progress.jsonl")[-1]
    assert (last["kind"], last["name"], last["passed"]) == ("exercise", "layer_flops", True)


@pytest.mark.parametrize("mistake", WRONG, ids=list(WRONG))
def test_a_wrong_count_is_named_by_its_term(mistake):
    changes, phrase = WRONG[mistake]
    result = exercises.check("layer_flops", functools.partial(counted, **changes))
    assert not result.passed
    assert phrase in result.feedback, result.feedback


def test_the_stub_a_wrong_return_and_an_error_are_named():
    stub = exercises.check("layer_flops", exercises.stub("layer_flops")).feedback
    assert "raised NotImplementedError" in stub and "exercises.hint('layer_flops')" in stub
    assert "return two numbers >= 0, (flops, bytes)" in exercises.check("layer_flops", lambda *a: 12).feedback
    assert "your FLOPs change with dtype_bytes" in exercises.check(
        "layer_flops", lambda *a: (layer_flops.layer_flops(*a)[0] * a[6], layer_flops.layer_flops(*a)[1])).feedback
    with pytest.raises(ValueError, match="layer_flops runs in this process"):
        exercises.check("layer_flops", layer_flops.layer_flops, world_sizes=[2])
    with pytest.raises(TypeError, match="needs your function"):
        exercises.check("layer_flops", "not a function")


def test_registered_described_and_hinted():
    text = exercises.describe("layer_flops")
    assert exercises.names()[-1] == "layer_flops" and "Checked in this process" in text
    assert text.startswith("Write fn(hidden, heads, kv_heads, ffn, seq, batch, dtype_bytes, gated) -> (flops, bytes)")
    assert "4 * tokens * seq * hidden" in exercises.hint("layer_flops", 3)
