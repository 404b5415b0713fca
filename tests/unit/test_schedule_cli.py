"""`dstrain schedule` as a user runs it: text, JSON, PNG, comparison mode, --from-run, bad input."""

import json

import matplotlib.image
import pytest

from dstrain.planner.bubble import SCHEDULES

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
JSON_KEYS = {
    "schedule",
    "pp",
    "microbatches",
    "virtual_stages",
    "costs",
    "p2p",
    "bubble_fraction",
    "theoretical_bubble_fraction",
    "makespan",
    "rank_bubble",
    "peak_inflight",
    "blocks",
}


def test_text_output(cli):
    result = cli("schedule", "--schedule", "1f1b", "--pp", "4", "--microbatches", "8")
    assert result.code == 0, result.text
    assert "bubble 27.27% simulated, 27.27% closed form; makespan 33" in result.out
    assert "peak in-flight" in result.out
    assert len([line for line in result.out.splitlines() if "FB" in line]) == 4  # a row per rank


def test_json_output(cli):
    args = ("--schedule", "interleaved-1f1b", "--pp", "2", "--microbatches", "4", "--json")
    result = cli("schedule", *args, "--virtual-stages", "3", "--costs", "1,2,0.5")
    assert result.code == 0, result.text
    (item,) = result.json()
    assert set(item) == JSON_KEYS
    assert item["virtual_stages"] == 3 and item["costs"]["backward"] == 2.0
    assert item["bubble_fraction"] == pytest.approx(item["theoretical_bubble_fraction"])
    assert len(item["blocks"]) == 2 and len(item["peak_inflight"]) == 2
    assert len(item["blocks"][0]) == 2 * 3 * 4  # F and B of 4 micro-batches on 3 stages
    assert set(item["blocks"][0][0]) == {"start", "end", "stage", "kind", "microbatch"}


def test_png_is_a_real_image(cli, tmp_path):
    path = tmp_path / "plots" / "zbv.png"
    result = cli("schedule", "--schedule", "zbv", "--pp", "4", "--microbatches", "8", "--png", path)
    assert result.code == 0, result.text
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(path).shape
    assert width > 800 and height > 200


def test_all_compares_every_schedule_and_skips_what_upstream_refuses(cli, tmp_path):
    result = cli("schedule", "--schedule", "all", "--pp", "2", "--microbatches", "4", "--json")
    assert result.code == 0, result.text
    assert [item["schedule"] for item in result.json()] == list(SCHEDULES)

    path = tmp_path / "all.png"
    result = cli("schedule", "--schedule", "all", "--pp", "4", "--microbatches", "4", "--png", path)
    assert result.code == 0, result.text
    assert "skipping dualpipev" in result.err and "dualpipev:" not in result.out
    assert result.out.count("closed form") == len(SCHEDULES) - 1
    assert path.read_bytes()[:8] == PNG_SIGNATURE


def _run_dir(tmp_path, metrics: list[dict], schedule: str = "zbv"):
    run = tmp_path / "run"
    run.mkdir()
    run.joinpath("config.toml").write_text(
        f'[parallel]\npp = 2\npp_schedule = "{schedule}"\nnum_virtual_stages = 2\n\n'
        "[train]\ngrad_accum_steps = 8\n"
    )
    run.joinpath("metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    return run


def test_from_run_reads_layout_and_last_measured_costs(cli, tmp_path):
    times = {"pipeline/time_f_ms": 2.0, "pipeline/time_i_ms": 1.5, "pipeline/time_w_ms": 0.5}
    run = _run_dir(
        tmp_path,
        [{"step": 1, "loss/main": 3.0, **times}, {"step": 2, "loss/main": 2.9, **times}],
    )
    with run.joinpath("metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps({"step": 3, "pipeline/time_f_ms": 4.0, "pipeline/time_i_ms": 3.0}))
        metrics.write("\n{truncated\n")  # a crash mid-line does not hide the lines before
    (item,) = cli("schedule", "--from-run", run, "--json").json()
    assert (item["schedule"], item["pp"], item["microbatches"]) == ("zbv", 2, 8)
    # the last line with the times wins; it has no time_w_ms: W = 0
    assert item["costs"] == {"forward": 4.0, "backward": 3.0, "weight": 0.0, "unit": "ms"}

    result = cli("schedule", "--from-run", run, "--schedule", "1f1b", "--costs", "1,1,1")
    assert result.code == 0 and result.out.startswith("1f1b: pp 2, 8 micro-batches")


def test_from_run_with_a_full_backward(cli, tmp_path):
    run = _run_dir(
        tmp_path, [{"step": 5, "pipeline/time_f_ms": 1.0, "pipeline/time_b_ms": 2.5}], "1f1b"
    )
    (item,) = cli("schedule", "--from-run", run, "--json").json()
    assert item["schedule"] == "1f1b" and item["virtual_stages"] == 1
    assert item["costs"]["backward"] == 2.5 and item["costs"]["weight"] == 0.0


BASE = ("--schedule", "1f1b", "--pp", "2", "--microbatches", "4")


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--schedule", "1f1b", "--pp", "0", "--microbatches", "4"), "--pp must be"),
        ((*BASE, "--costs", "1,x,1"), "not three numbers"),
        ((*BASE, "--costs", "1,1"), "not 3"),
        ((*BASE, "--costs", "1,-1,1"), "B > 0"),
        ((*BASE, "--p2p", "-1"), "--p2p must be"),
        (("--schedule", "pipedream", "--pp", "2", "--microbatches", "4"), "unknown schedule"),
        (("--pp", "2"), "are needed"),
        (("--from-run", "no/such/run"), "no run at"),
        (("--schedule", "dualpipev", "--pp", "4", "--microbatches", "6"), ">= 8 micro-batches"),
        (("--schedule", "interleaved-1f1b", "--pp", "2", "--microbatches", "5"), "use 6"),
        (("--schedule", "zbv", "--pp", "2", "--microbatches", "4", "--virtual-stages", "3"), "2"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(cli, args, words):
    result = cli("schedule", *args)
    assert result.code == 2
    assert result.err.count("error:") == 1 and words in result.err
    assert "Traceback" not in result.text and result.out == ""


def test_run_without_pipeline_times_says_which_keys_and_why(cli, tmp_path):
    run = _run_dir(tmp_path, [{"step": 1, "loss/main": 3.0}])
    result = cli("schedule", "--from-run", run)
    assert result.code == 2 and "Traceback" not in result.text
    assert "pipeline/time_f_ms" in result.err and "pp > 1" in result.err
