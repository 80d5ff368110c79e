"""The pages quote measured numbers from committed results, and say when a page and its result disagree."""

from __future__ import annotations

import nbformat
import pandas as pd
import pytest

from dtlab.app import quoted, quotes, unquoted

ROOT = quotes.ROOT
# Numbers the scan flags that are still typed by hand on the pages (a measurement not yet quoted from a
# result, or a non-measurement not yet on ``unquoted.ALLOWED``), one ``page: number | its line`` a line.
# The list may only shrink: a new number must be quoted or allowed, and a fixed one taken off.
TYPED_BY_HAND = ROOT / "tests" / "quotes_typed_by_hand.txt"


def test_every_quoted_block_agrees_with_its_committed_result():
    assert quotes.check() == []


@pytest.mark.parametrize(("page", "names"), [
    ("README.md", {"recording-cost-line", "width-sweep", "width-sweep-predictions", "ft-recovery", "diloco-link",
                   "costmodel-error", "planner-validation", "demo-compare",
                   "link-sweep", "goodput", "parity-over-bound"}),
    ("docs/tiers.md", {"parity-by-tier", "parity-diloco", "parity-machine", "parity-ulps", "parity-wide-jobs"}),
    ("docs/determinism.md", {"parity-float32"}),
    ("docs/measurement.md", {"recording-cost", "width-sweep", "width-sweep-runs", "ft-recovery-table",
                             "ft-without-faults", "ft-break-even", "diloco-link", "diloco-link-table",
                             "costmodel-error", "costmodel-error-table", "demo-compare-table", "goodput-table",
                             "goodput-findings", "goodput-checkpoint", "goodput-projection"}),
    ("docs/troubleshooting.md", {"busy-notebooks"}),
    ("notebooks/01_single_device.ipynb", {"recording-cost"}),
    ("notebooks/11_compare.ipynb", {"recording-cost", "width-sweep"}),
])
def test_the_pages_that_read_timings_quote_the_recorders_cost_and_the_sweep(page, names):
    found = {m["name"] for _, text in quotes._texts(ROOT / page) for m in quotes.BLOCK.finditer(text)}
    assert names <= found, f"{page} quotes {sorted(found)}"


def _overhead_rows(ratios: list[float]) -> list[dict]:
    rows = []
    for r, ratio in enumerate(ratios):
        for mode, step in (("plain", 0.010), ("instrumented", 0.010 * ratio)):
            rows.append({"tier": "ddp", "size": "small", "world_size": 2, "model_size": 64, "global_batch": 64,
                         "steps": 8, "round": r, "order": 0, "variant": f"ddp:small:{mode}", "median_step_s": step})
    return rows


def _sweep_rows() -> list[dict]:
    # two runs of a two-width sweep: speedups against 2 threads and against 1 thread
    rows = []
    for run, (s64, s1k, t64, t1k) in enumerate([(0.3, 0.7, 0.5, 2.0), (0.25, 0.8, 0.4, 1.5)], start=1):
        for width, speedup, vs_1t, err in ((64, s64, t64, -0.5), (1024, s1k, t1k, 0.1)):
            rows.append({"width": width, "speedup": speedup, "speedup_vs_1t": vs_1t, "prediction_error": err,
                         "retimed_error": err / 5, "run": run, "started": f"2026-12-0{run}T10:00:00",
                         "load": "1.00/1.20"})
    return rows


@pytest.fixture
def house(tmp_path):
    """A checkout in miniature: the two results, and a README and a notebook that quote them."""
    (tmp_path / "docs" / "figures").mkdir(parents=True)
    (tmp_path / "notebooks").mkdir()
    pd.DataFrame(_overhead_rows([1.05, 1.01, 1.20])).to_csv(tmp_path / quoted.OVERHEAD, index=False)
    pd.DataFrame(_sweep_rows()).to_csv(tmp_path / quoted.SWEEPS, index=False)
    (tmp_path / "README.md").write_text(
        "| cost | <!-- quote:recording-cost-line -->old<!-- /quote:recording-cost-line --> |\n"
        "\n<!-- quote:width-sweep-runs -->\nold\n<!-- /quote:width-sweep-runs -->\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(
        "Sweeps: <!-- quote:width-sweep -->typed by hand<!-- /quote:width-sweep -->.")])
    (tmp_path / "notebooks" / "11_compare.ipynb").write_text(nbformat.writes(nb) + "\n")
    return tmp_path


def test_rendering_writes_the_results_numbers_and_a_changed_result_is_caught(house):
    assert len(quotes.check(house)) == 3  # every block typed by hand differs from its result
    assert all(quotes.render(page, house) for page in (house / "README.md", house / "notebooks" / "11_compare.ipynb"))
    assert quotes.check(house) == []
    readme = (house / "README.md").read_text()
    # the ratios 1.05, 1.01, 1.20: median 1.050, and three rounds are a min-max, not a "90 %"
    assert "`ddp` MLP 64, global batch 64: 1.050 [min–max of 3 rounds 1.010–1.200]" in readme
    assert "| 64 | −50 % / −10 % (0.30) | −50 % / −10 % (0.25) |" in readme
    assert "| within 30 %, roofline | 1 of 2 (worst 64: −50 %) | 1 of 2 (worst 64: −50 %) |" in readme
    cell = nbformat.read(house / "notebooks" / "11_compare.ipynb", as_version=4).cells[0].source
    assert ("2 runs of the sweep, 2026-12-01, 2026-12-02: ddp reached at most 0.70–0.80× of one 2-thread process "
            "(at width 1024); against single on one thread it pays from a width of about") in cell
    # a result measured again, its pages not rewritten: the check names the page and the quote
    pd.DataFrame(_overhead_rows([1.05, 1.01, 1.30, 1.40])).to_csv(house / quoted.OVERHEAD, index=False)
    assert quotes.check(house) == ["README.md: quote:recording-cost-line differs from its result "
                                   "(python -m dtlab.app.quotes rewrites it)"]


def test_an_unknown_quote_or_a_block_quoted_inline_is_named(house):
    with pytest.raises(ValueError, match="README.md: unknown quote 'nope'"):
        quotes.render_text("<!-- quote:nope -->x<!-- /quote:nope -->", house, "README.md")
    with pytest.raises(ValueError, match="'width-sweep-runs' is a block"):
        quotes.render_text("<!-- quote:width-sweep-runs -->x<!-- /quote:width-sweep-runs -->", house)


def test_ft_against_elastic_reads_the_benchmarks_rows_and_an_interval_holding_the_target_is_unresolved():
    # two rounds: ft loses 0.1 s and 0.3 s where elastic loses 1 s and 1 s: ratios 0.1 and 0.3 around 0.2
    rows = []
    for r, lost_ft in enumerate((0.1, 0.3)):
        for variant, lost, span in (("elastic_killed", 1.0, 0.0), ("elastic", 0.0, 0.002),
                                    ("ft_tuned_killed", lost_ft, 0.0), ("ft_tuned", 0.0, 0.003),
                                    ("ddp", 0.0, 0.0)):
            rows.append({"round": r, "variant": variant, "lost_s": lost, "span_step_s": span, "step_s": 0.001,
                         "redone_steps": 0, "samples_lost": 32.0 if variant == "ft_tuned_killed" else 0.0})
    s = quoted.ft_against_elastic(rows, ("tuned",))
    assert s["rounds"] == 2 and s["tuned"]["ratios"] == pytest.approx([0.1, 0.3])
    # (1.0 - 0.2) s saved per fault over 1 ms more per step: 800 steps
    assert s["tuned"]["break_even_steps"] == pytest.approx(800)
    assert quoted._verdict(s["tuned"]["ratios"], 0.2).startswith("unresolved")
    assert quoted._verdict([0.1, 0.15], 0.2) == "met" and quoted._verdict([0.3, 0.4], 0.2) == "not met"


def test_diloco_is_judged_at_its_best_h_seed_by_seed():
    rows = pd.read_csv(ROOT / quoted.DILOCO)
    line = quoted.diloco_link(ROOT)
    best = quoted.best_h(rows.to_dict("records"), rows["link_mbit"].min())
    ratios = rows.loc[rows["variant"] == best, "time_ratio"]
    # met only when every seed reached DDP's loss within the bound; the line says which
    met = bool(ratios.notna().all() and (ratios <= quoted.DILOCO_BOUND).all())
    assert (": met)" in line) == met and (": not met)" in line) != met
    assert f"on {int(ratios.notna().sum())} seed" in line


def test_no_page_states_a_measured_number_without_its_result():
    found, known = set(unquoted.unquoted()), set(TYPED_BY_HAND.read_text().splitlines())
    new = sorted(found - known)
    assert not new, "measured-looking numbers outside quote blocks (quote them or say why in ALLOWED):\n" + \
        "\n".join(new)
    gone = sorted(known - found)
    assert not gone, f"no longer on the pages: take them off {TYPED_BY_HAND.name}:\n" + "\n".join(gone)


def test_a_number_typed_by_hand_is_named_and_a_quoted_or_allowed_one_is_not(house):
    (house / "docs").mkdir(exist_ok=True)
    (house / "README.md").write_text(
        "| cost | <!-- quote:recording-cost-line -->1.05 [2 %]<!-- /quote:recording-cost-line --> |\n"
        "DDP took 1.78× longer, 4.2 ms a step, 0.516 of the memory (gap 4.5e-14)\n")
    (house / "docs" / "page.md").write_text("Adam at lr 0.01 on torch 2.13, `--slow-rank 1:5ms`, within 30 %.\n"
                                            "A gap above 1e-10 is a bug; tests keep a bound of 1e-5 (bf16: 5e-4).\n"
                                            "<!-- bench:begin -->\n| x | 3.37 ms |\n<!-- bench:end -->\n")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("a collective took\n12 % of the step"),
                                         nbformat.v4.new_code_cell("print('3.5 s')")])
    (house / "notebooks" / "11_compare.ipynb").write_text(nbformat.writes(nb) + "\n")
    found = unquoted.unquoted(house)
    assert sorted(k.split(" | ")[0] for k in found) == sorted(
        ["README.md: 1.78×", "README.md: 4.2 ms", "README.md: 0.516", "README.md: 4.5e-14",
         "notebooks/11_compare.ipynb: 12 %"])
    assert found["notebooks/11_compare.ipynb: 12 % | 12 % of the step"] == "cell 0 line 2"


def test_the_fresh_clone_line_reads_the_last_clone_and_says_whether_the_suite_kept_its_aim(tmp_path):
    from dtlab.app import quoted_more

    (tmp_path / "docs" / "figures").mkdir(parents=True)
    rows = ("date,commit,command,seconds,exit_code\n2026-01-01,aaa,make demo,400,0\n2026-01-01,aaa,make test,3000,0\n"
            "2026-01-02,bbb,make demo,290,0\n2026-01-02,bbb,make test,1100,{code}\n")
    (tmp_path / quoted_more.FRESH_CLONE).write_text(rows.format(code=0))
    line = quoted_more.fresh_clone(tmp_path)
    assert line.startswith("in a fresh clone of bbb on 2026-01-02, `make demo` took 5 minutes (290 s")
    assert "`make test` 18 minutes (1,100 s, within the suite's aim of 20 minutes)" in line
    (tmp_path / quoted_more.FRESH_CLONE).write_text(rows.format(code=2))
    assert quoted_more.fresh_clone(tmp_path).endswith("; failed: make test")


def test_shrinking_the_list_takes_off_what_left_the_pages_and_adds_nothing(house):
    (house / "README.md").write_text("DDP took 1.78× longer and 4.2 ms a step\n")
    listed = house / "typed.txt"
    listed.write_text("README.md: 1.78× | DDP took 1.78× longer and 4.2 ms a step\n"
                      "README.md: 9.9× | a number no page states any more\n")
    before, after, new = unquoted.shrink(listed, house)
    assert (before, after) == (2, 1)
    assert listed.read_text() == "README.md: 1.78× | DDP took 1.78× longer and 4.2 ms a step\n"
    assert new == ["README.md: 4.2 ms | DDP took 1.78× longer and 4.2 ms a step"]  # named, not added


def test_the_pipeline_table_and_the_link_sweep_read_their_files_rows(tmp_path):
    from dtlab.app import quoted_docs, quoted_measure

    (tmp_path / "docs" / "figures").mkdir(parents=True)
    bubble = {"schedule": ["gpipe", "zbv"], "p": 2, "v": [1, 2], "M": 4, "measured": [0.3, 0.25],
              "formula": [0.2, float("nan")], "simulated": [0.2, 0.05], "transfer_share": 0.5,
              "idle_in_transfer": 0.6, "idle_in_arrival": [0.05, 0.2], "step_ms": [100.4, 99.6],
              "activations_MiB": [4.125, 6.0], "predicted_MiB": [4.125, 6.5], "load_before": "0.50 1 1",
              "load_after": "1.25 1 1"}
    pd.DataFrame(bubble).to_csv(tmp_path / quoted_docs.PIPELINE_BUBBLE, index=False)
    table = quoted_docs.pipeline_bubble_table(tmp_path)
    assert "| `gpipe` | 1 | 0.300 | 0.200 | 0.200 | 0.500 | 0.600 | 0.050 | 100 | 4.125 |" in table
    assert "| `zbv` | 2 | 0.250 | — | 0.050 |" in table and "6.000 (predicted 6.500)" in table
    # the transfers' share of the idle time above the layout: 0.05 · 0.3 / 0.1 and 0.2 · 0.25 / 0.2
    assert quoted_docs.pipeline_bubble_excess(tmp_path).startswith("15 % (GPipe) to 25 % (ZB-V) of that excess")
    assert quoted_docs.pipeline_bubble_load(tmp_path) == "load average 0.50 (1 min) before, 1.25 after"
    rows = [{"link_mbit": mbit, "link_delay_ms": 0.0, "comm_hook": hook, "round": r, "seed": r,
             "step_ms": step * (1 + r), "comm_mb_per_step": mb, "eval_loss": loss + r}
            for r in (0, 1) for mbit, scale in ((10000.0, 1), (200.0, 10))
            for hook, step, mb, loss in (("allreduce", 2.0 * scale, 1.0, 0.1), ("fp16", 1.0 * scale, 0.5, 0.1),
                                         ("powersgd", 3.0, 0.01, 0.2))]
    pd.DataFrame(rows).to_csv(tmp_path / quoted_measure.LINK_SWEEP_RUNS, index=False)
    table = quoted_measure.link_sweep_table(tmp_path)
    # medians over the rounds (range in brackets); ratios within a round
    assert "| 10 Gbit/s | 3.0 ms (2.0–4.0) | 1.5 ms (0.500 [0.500–0.500]) | 4.5 ms (1.50 [1.50–1.50]) |" in table
    assert "| 200 Mbit/s | 30.0 ms (20.0–40.0) |" in table and "(0.150 [0.150–0.150])" in table
    assert "PowerSGD at rank 1 is worse on every seed, by 0.1000 to 0.100" in quoted_measure.link_sweep_quality(
        tmp_path)


def test_the_parity_table_is_the_experiments_by_tier_and_a_nonzero_gap_is_not_called_bitwise(tmp_path):
    from dtlab.app import quoted_parity

    (tmp_path / "docs" / "figures").mkdir(parents=True)
    rows = [(case, tier, opt, dtype, gap) for case, tier, opt, gaps in (
        ("ddp w2 sgd", "ddp", "sgd", (1e-8, 2e-17)), ("ddp w2 adam", "ddp", "adam", (2e-7, 1e-16)),
        ("ddp w2 moe adam", "ddp", "adam", (3e-5, 4e-14)),
        ("diloco 2x1 sgd", "diloco", "sgd", (0.0, 0.0)), ("diloco 2x1 adam", "diloco", "adam", (4.5e-8, 0.0)))
        for dtype, gap in zip(("float32", "float64"), gaps)]
    frame = pd.DataFrame(rows, columns=["case", "tier", "optimizer", "dtype", "gap"]).assign(ulps=1.0)
    frame.to_csv(tmp_path / quoted_parity.PARITY, index=False)
    table = quoted_parity.parity_by_tier_table(tmp_path).splitlines()
    assert table[0] == "| tier | cases | float64, SGD | float64, Adam | float32, SGD | float32, Adam |"
    # the largest gap per dtype and optimizer, and which of the tier's Adam cases it is
    assert table[2].startswith("| `ddp` | 3: ") and table[2].endswith(
        "| 2.0e-17 | 4.0e-14 | 1.0e-8 | 3.0e-5 (`ddp w2 moe`) |")
    assert table[3].endswith("| 0 | 0 | 0 | 4.5e-8 |")
    # float64 all zero is bitwise; float32 is not, where one optimizer's gap is not zero
    assert quoted_parity.parity_diloco(tmp_path) == ("bitwise in float64, in float32 bitwise with SGD and within "
                                                     "4.5e-8 with Adam")
    assert quoted_parity.parity_over_bound(tmp_path) == ("1 of the 5 float32 jobs of the committed run, all Adam "
                                                         "at lr 0.01 (up to 3.0e-5)")
