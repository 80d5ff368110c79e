"""Exercise layer_flops: the reference equals the planner's count on shapes drawn for each check; wrong counts are
named by their term; answers written down in advance and the planner's own count fail; no ranks."""

from __future__ import annotations

import functools
import random

import pytest

from dtlab import exercises
from dtlab.cost.planner.layout import Layout
from dtlab.cost.planner.ops import stage_ops
from dtlab.cost.planner.transformer import TransformerSpec
from dtlab.exercises import _progress, layer_flops
from dtlab.exercises.layer_flops import Shape, draw_shapes, planner_count

SEEDS = range(1000, 1025)  # each wrong count is judged on the shapes of 25 draws, and once more as check() draws them


@pytest.fixture(autouse=True)
def progress_log(tmp_path, monkeypatch):
    monkeypatch.setattr(_progress, "PROGRESS_LOG", tmp_path / "progress.jsonl")


def counted(hidden, heads, kv_heads, ffn, seq, batch, dtype_bytes, gated, *, per_mac=2, attention=4, kv_full=False,
            as_gated=None, scores=False, values=False, norms=True, adds=True, fused_qkv=True, passes=1,
            batched=True, one_head=False):
    """A learner's count with one mistake switched on (the defaults give the right count)."""
    tokens = batch * seq if batched else seq
    kv = hidden if kv_full else kv_heads * (hidden // heads)
    gated = gated if as_gated is None else as_gated
    gemms = [(tokens, hidden + 2 * kv, hidden), (tokens, hidden, hidden), (tokens, (2 if gated else 1) * ffn, hidden),
             (tokens, hidden, ffn)]
    flops = passes * (sum(per_mac * m * n * k for m, n, k in gemms)
                      + attention * tokens * seq * (hidden // heads if one_head else hidden))
    moved = sum(m * k + k * n + m * n for m, n, k in gemms) + tokens * (2 * hidden + 2 * kv)
    moved += (0 if fused_qkv else 2 * tokens * hidden) + (2 * batch * heads * seq * seq if scores else 0)
    moved += ((2 if gated else 1) + 1) * tokens * ffn + (4 if norms else 0) * tokens * hidden
    moved += (6 if adds else 0) * tokens * hidden
    return flops, moved if values else dtype_bytes * moved


def through_planner_count(*args):
    """The exercise module's own helper: the planner's count of the layer."""
    return planner_count(Shape("mine", *args))


def through_stage_ops(hidden, heads, kv_heads, ffn, seq, batch, dtype_bytes, gated):
    """The planner's ops, reached by hand."""
    spec = TransformerSpec("mine", layers=1, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, seq=seq, vocab=1,
                           gated_mlp=gated)
    layout = Layout(dp=1, tp=1, pp=1, zero=0, checkpointing="none", micro_batch=batch,
                    precision={2: "bf16", 4: "fp32"}[dtype_bytes])
    ops = stage_ops(spec, layout, first=False, last=False).forward
    return (sum(op.flops * op.count for op in ops if op.kind != "memory"), sum(op.bytes * op.count for op in ops))


KNOWN = {shape.args(): planner_count(shape) for seed in range(50) for shape in draw_shapes(random.Random(seed))}


def pasted_answers(*args):
    """The answers for the shapes of 50 draws, written down beforehand: right wherever they are known."""
    return KNOWN[args]


COUNTS = {  # the mistake -> what the feedback must say
    "per_mac=1": (dict(per_mac=1), "a multiply-add is 2 FLOPs"),
    "attention at one FLOP per multiply-add": (dict(attention=2), "are T seq hidden multiply-adds each over all the "
                                                                  "heads, and a multiply-add is 2 FLOPs"),
    "causal, halved": (dict(attention=2), "Halved for the causal mask? The convention counts a causal attention as if "
                                          "unmasked"),
    "attention twice": (dict(attention=8), "attention FLOPs (what changes when the same tokens come in longer "
                                           "sequences) are 2x the planner's"),
    "every term twice": (dict(passes=2), "every term is twice the planner's: a multiply-add is 2 FLOPs in all"),
    "one sequence, no batch": (dict(batched=False), "your FLOPs do not change with batch: the layer runs on T = batch "
                                                    "x seq tokens"),
    "one head's attention": (dict(one_head=True), "one head's: add up the heads"),
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
WRONG = {name: (functools.partial(counted, **changes), phrase) for name, (changes, phrase) in COUNTS.items()}
WRONG.update({  # the cheats
    "the planner's count through the exercise's helper": (through_planner_count, "your function called the planner "
                                                          "(dtlab.cost.planner."),
    "the planner's count through stage_ops": (through_stage_ops, "your function called the planner "
                                              "(dtlab.cost.planner."),
    "answers written down beforehand": (pasted_answers, "your function raised KeyError with hidden="),
})


def test_drawn_shapes_are_of_the_four_kinds_and_the_reference_equals_the_planners_count_on_each():
    for seed in range(200):
        shapes = draw_shapes(random.Random(seed))
        mha, gqa, gqa32, mqa = shapes
        assert mha.kv_heads == mha.heads and not mha.gated and mha.dtype_bytes == 2 and mha.batch >= 2
        assert gqa.kv_heads < gqa.heads and gqa.gated and gqa.dtype_bytes == 2
        assert gqa32.kv_heads * 2 == gqa32.heads and gqa32.gated and gqa32.dtype_bytes == 4 and gqa32.batch >= 2
        assert mqa.kv_heads == 1 and not mqa.gated and mqa.dtype_bytes == 4
        for shape in shapes:
            assert shape.hidden % shape.heads == 0 and shape.heads % 2 == 0 and shape.seq % 2 == 0
            assert layer_flops.layer_flops(*shape.args()) == planner_count(shape) == counted(*shape.args())
    # the planner's count is the textbook's: 2 x the weights' elements per token, plus attention's 4 T s h
    s = draw_shapes(random.Random(7))[1]
    weights = s.hidden * (s.hidden + 2 * s.kv_heads * s.hidden // s.heads) + s.hidden ** 2 + 3 * s.hidden * s.ffn
    assert planner_count(s)[0] == 2 * s.tokens * weights + 4 * s.tokens * s.seq * s.hidden


def test_each_check_draws_other_shapes():
    draws = {draw_shapes(random.SystemRandom()) for _ in range(5)}
    assert len(draws) == 5


def test_the_reference_passes_in_this_process_and_is_recorded(tmp_path):
    result = exercises.check("layer_flops", exercises.solution("layer_flops"))
    assert result.passed and "on 4 shapes drawn for this check" in result.feedback
    last = _progress.read_rows(tmp_path / "progress.jsonl")[-1]
    assert (last["kind"], last["name"], last["passed"]) == ("exercise", "layer_flops", True)


@pytest.mark.parametrize("mistake", WRONG, ids=list(WRONG))
def test_a_wrong_count_is_named_by_its_term(mistake):
    fn, phrase = WRONG[mistake]
    for seed in SEEDS:
        feedback = layer_flops.judge(fn, draw_shapes(random.Random(seed)))
        assert feedback is not None and phrase in feedback, (seed, feedback)
    result = exercises.check("layer_flops", fn)
    assert not result.passed and phrase in result.feedback, result.feedback


def test_the_cheats_pass_where_they_could_know_the_shapes():
    """What fails them is the check, not a mistake of theirs: each is right where the planner or the pasted table
    answers without being found out."""
    for seed in range(50):
        shapes = draw_shapes(random.Random(seed))
        assert layer_flops.judge(pasted_answers, shapes) is None
        assert all(through_stage_ops(*shape.args()) == planner_count(shape) for shape in shapes)
    assert "the planner's own count is no answer. Count the ops yourself" in layer_flops.judge(through_stage_ops)


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
    assert "four shapes drawn anew for every check" in text and "may not call the planner" in text
    assert "4 * tokens * seq * hidden" in exercises.hint("layer_flops", 3)
