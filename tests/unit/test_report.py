"""`dstrain report`: reading a run directory, which figures it draws or skips, the heatmap's
numbers, compare mode and the CLI's answers. Synthetic run directories, no model."""

import json
from pathlib import Path

import numpy as np
import pytest

from dstrain.errors import UserError
from dstrain.report.html import format_value
from dstrain.report.plots import FIGURE_NAMES, load_matrix, relative_load
from dstrain.report.run_data import load_run
from tests.conftest import run_cli
from tests.synthetic_run import (
    ALL_BUT_LOSS,
    LOADS,
    NUM_EXPERTS,
    write_run,
)

# Loading


def test_load_reads_series_loads_summary_and_config(tmp_path):
    run = load_run(write_run(tmp_path, steps=5))
    assert run.name == "run-a"
    assert run.series["loss/main"].steps == [1, 2, 3, 4, 5]
    assert run.series["optim/lr"].values[0] == pytest.approx(2e-4)
    assert run.expert_load["layer2"] == [LOADS["layer2"]] * 5
    assert "moe/layer2/tokens_per_expert" not in run.series
    assert run.summary["mfu"] == 0.123
    assert "ep = 2" in run.config_text
    assert not run.truncated_tail


def test_keys_missing_from_some_lines_keep_their_own_steps(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lines = [{"step": 1, "loss/main": 3.0}, {"step": 2, "loss/main": 2.5, "optim/lr": 0.1}]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = load_run(run_dir)
    assert run.series["optim/lr"].steps == [2]
    assert run.series["loss/main"].steps == [1, 2]
    assert run.summary is None and run.config_text is None and not run.expert_load


def test_a_repeated_step_keeps_the_later_line(tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    lines = [
        {"step": 1, "loss/main": 3.0},
        {"step": 2, "loss/main": 9.0, "optim/lr": 9.0},  # written before a crash
        {"step": 2, "loss/main": 2.0},  # the resumed run's step 2
        {"step": 3, "loss/main": 1.0},
    ]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    run = load_run(run_dir)
    assert run.series["loss/main"].steps == [1, 2, 3]
    assert run.series["loss/main"].values == [3.0, 2.0, 1.0]
    assert "optim/lr" not in run.series  # the whole earlier line lost, not merged


def test_a_truncated_last_line_is_skipped(tmp_path):
    run = load_run(write_run(tmp_path, steps=3, tail='{"step": 4, "loss/ma'))
    assert run.series["loss/main"].steps == [1, 2, 3]
    assert run.truncated_tail


def test_a_corrupt_middle_line_names_file_and_line(tmp_path):
    run_dir = write_run(tmp_path, steps=3, tail='{"step": 4, "loss\n{"step": 5}\n')
    with pytest.raises(UserError) as caught:
        load_run(run_dir)
    assert f"{run_dir / 'metrics.jsonl'}: line 4 is not JSON" in caught.value.message
    assert caught.value.exit_code == 2


@pytest.mark.parametrize("line", ["[1, 2]", '{"loss/main": 1.0}', '{"step": "ten"}'])
def test_a_line_without_a_step_is_an_error(tmp_path, line):
    run_dir = write_run(tmp_path, steps=2, tail=line + "\n" + '{"step": 9}\n')
    with pytest.raises(UserError, match="line 3"):
        load_run(run_dir)


def test_missing_run_or_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no run directory"):
        load_run(tmp_path / "nope")
    with pytest.raises(UserError, match="has no metrics.jsonl"):
        load_run(tmp_path)


# The heatmap's numbers


def test_relative_load_is_the_mean_over_lines_over_the_layer_mean():
    lines = [[10.0, 30.0, 0.0, 0.0], [30.0, 10.0, 0.0, 0.0]]  # mean per expert 20, 20, 0, 0
    assert relative_load(lines).tolist() == [2.0, 2.0, 0.0, 0.0]
    assert np.isnan(relative_load([[0.0, 0.0]])).all()  # a layer that routed nothing


def test_load_matrix_orders_layers_and_pads_narrow_ones():
    layers, matrix = load_matrix(
        {"layer10": [[1.0, 3.0]], "layer2": [[2.0, 2.0, 2.0, 2.0]], "layer3": [[4.0, 0, 0, 0]]}
    )
    assert layers == ["layer2", "layer3", "layer10"]
    assert matrix[:2].tolist() == [[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]]
    assert matrix[2, :2].tolist() == [0.5, 1.5] and np.isnan(matrix[2, 2:]).all()


def test_loaded_run_feeds_the_heatmap_its_layers_relative_load(tmp_path):
    layers, matrix = load_matrix(load_run(write_run(tmp_path, steps=4)).expert_load)
    assert layers == ["layer1", "layer2"]
    assert matrix[0] == pytest.approx([1.0] * NUM_EXPERTS)
    assert matrix[1] == pytest.approx([3.0, *[1.0] * 5, 0.0, 0.0])  # over the mean, 10


# The CLI


def _report(*args):
    result = run_cli("report", *args, "--json")
    assert result.code == 0, result.text
    return result.json()


def test_every_figure_is_drawn_for_a_full_run(tmp_path):
    answer = _report(write_run(tmp_path))
    out = Path(answer["output"])
    assert answer["plots"] == [f"{name}.png" for name in FIGURE_NAMES]
    assert answer["skipped"] == []
    assert answer["index"] == str(out / "index.html")
    assert out == tmp_path / "run-a" / "report"
    for name in answer["plots"]:
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "index.html").read_text()
    assert page.count("<img ") == len(FIGURE_NAMES)
    assert "12.3%" in page and "some_new_figure" in page and "not a scalar" not in page


def test_figures_without_data_are_skipped_and_stale_pngs_removed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("comm", "bubble", "expert_load"):  # left by an earlier report
        (out / f"{name}.png").write_bytes(b"stale")
    dense = write_run(tmp_path, name="dense", drop=("moe/", "comm/", "pipeline/"))
    answer = _report(dense, "-o", out)
    assert answer["skipped"] == ["comm", "bubble", "expert_load"]
    assert sorted(p.name for p in out.glob("*.png")) == sorted(answer["plots"])
    assert "expert_load.png" not in (out / "index.html").read_text()


def test_compare_overlays_two_runs(tmp_path):
    a = write_run(tmp_path, name="run-a")
    b = write_run(tmp_path, name="run-b", scale=0.9, drop=("moe/layer2",))
    answer = _report(a, "--compare", b, "-o", tmp_path / "cmp")
    assert answer["plots"] == [f"{name}.png" for name in FIGURE_NAMES]
    page = (tmp_path / "cmp" / "index.html").read_text()
    assert "run-a vs run-b" in page
    assert "<th>run-a</th><th>run-b</th>" in page
    assert page.count("<details>") == 2


def test_compare_of_same_named_runs_labels_them_by_path(tmp_path):
    a = write_run(tmp_path / "x", name="default", drop=ALL_BUT_LOSS)
    b = write_run(tmp_path / "y", name="default", drop=ALL_BUT_LOSS)
    _report(a, "--compare", b, "-o", tmp_path / "cmp")
    assert f"{a} vs {b}" in (tmp_path / "cmp" / "index.html").read_text()


def test_plain_output_names_index_and_plots(tmp_path):
    run = write_run(tmp_path, drop=("pipeline/",), tail='{"step": 21, "lo')
    result = run_cli("report", run)
    assert result.code == 0, result.text
    assert f"wrote {run / 'report' / 'index.html'}" in result.out
    assert str(run / "report" / "loss.png") in result.out
    assert "not logged, not drawn: bubble" in result.out
    assert "last line cut short" in result.err


def test_corrupt_line_via_cli_is_one_message_and_no_traceback(tmp_path):
    run = write_run(tmp_path, steps=3, tail="not json\n{}\n")
    result = run_cli("report", run)
    assert result.code == 2
    assert "Traceback" not in result.text
    assert f"dstrain report: error: {run / 'metrics.jsonl'}: line 4 is not JSON" in result.err
    assert not (run / "report").exists()


def test_missing_run_via_cli(tmp_path):
    result = run_cli("report", tmp_path / "nope")
    assert result.code == 2 and "no run directory" in result.err and "Traceback" not in result.text


def test_help_says_what_it_reads_and_writes(cli):
    result = cli("report", "--help")
    assert result.code == 0
    for word in ("metrics.jsonl", "summary.json", "config.toml", "index.html", "--compare", "-o"):
        assert word in result.out


@pytest.mark.parametrize(
    ("key", "value", "shown"),
    [
        ("mfu", 0.123, "12.3%"),
        ("pipeline_bubble_fraction", None, "-"),
        ("wall_s", 30.0, "30.0 s"),
        ("tokens_per_s", 12345.6, "12,345.6"),
        ("peak_rss_mb", 900.4, "900 MB"),
        ("restarts", 1234, "1,234"),
        ("preempted", False, "no"),
        ("final_loss", float("nan"), "nan"),
    ],
)
def test_summary_values_read_well(key, value, shown):
    assert format_value(key, value) == shown


def test_a_comparison_by_default_keeps_the_plain_report(tmp_path):
    a = write_run(tmp_path, name="run-a", drop=ALL_BUT_LOSS)
    b = write_run(tmp_path, name="run-b", drop=ALL_BUT_LOSS)
    plain, compared = _report(a), _report(a, "--compare", b)
    assert plain["output"] == str(a / "report")
    assert compared["output"] == str(a / "report-vs-run-b")
    assert (a / "report" / "index.html").exists() and (
        a / "report-vs-run-b" / "index.html"
    ).exists()
