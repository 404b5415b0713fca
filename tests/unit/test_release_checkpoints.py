"""Released checkpoints as they really are, judged from outside: sparse replicas of DeepSeek-V3
(163 files, 91,991 tensors, FP8 with block scales, the MTP layer with its copies) and V2-Lite,
written by `tests/release_replica.py` from the releases' public facts (it imports nothing from
dstrain), against the header check, `ckpt verify-hf`, `check`, and the dry run's loader reading
each rank's slices; then every kind of damaged folder, one clear message each."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from tests.conftest import run_cli  # noqa: E402
from tests.release_replica import corrupt, sparse_files_supported, write_release  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
V3_LAYOUT = REPO / "examples" / "deepseek-v3-h800x2048.toml"


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("releases")
    if not sparse_files_supported(root):
        pytest.skip(f"{root}'s file system keeps no sparse files (a replica would fill the disk)")
    return {
        "v3": write_release(root / "DeepSeek-V3", "deepseek-v3"),
        "v2-lite": write_release(root / "DeepSeek-V2-Lite", "deepseek-v2-lite"),
    }


def test_v3_headers_fit_the_flavor_and_init_from_config(replicas):
    """Both ways of naming the architecture (the deepseek-v3 flavor; the folder's own
    config.json) accept the release as it is: no missing, extra, mis-shaped tensor, no dtype or
    scale problem, MTP copies included; from headers alone, in seconds."""
    from dstrain.checkpoint.hf_check import check_headers
    from dstrain.config.flavors import flavor_args
    from dstrain.config.hf_config import read_hf_config

    v3 = replicas["v3"]
    for args in (flavor_args("deepseek-v3"), read_hf_config(v3.folder)):
        began = time.perf_counter()
        result = check_headers(v3.folder, args)
        seconds = time.perf_counter() - began
        assert result.problems == [], result.problems[:5]
        assert (result.files, result.tensors) == (163, 91_991)
        assert result.checkpoint_bytes == v3.data_bytes
        print(
            f"V3 header check: {result.tensors:,} tensors in {result.files} files, {seconds:.2f} s"
        )
        assert seconds < 30
    assert read_hf_config(v3.folder).aux_loss_alpha == 0.001  # the file's own value


def test_v3_verify_hf_and_the_dry_run_read_only_each_ranks_slices(replicas):
    """Rank 0 and rank 2047 of the published layout: `ckpt verify-hf` plans their reads, the
    dry run's loader reads them (slices of the sparse files, FP8 dequantised, discarded), and
    both agree; each reads about the shards it holds (the MTP copies compared on top where it
    holds the embedding or head), a few hundred MB of the 689 GB."""
    folder = replicas["v3"].folder
    planned = run_cli(
        "ckpt", "verify-hf", folder, "--config", V3_LAYOUT, "--rank", 0, 2047, "--json"
    )
    assert planned.code == 0, planned.text
    plan = {r["rank"]: r for r in planned.json()["ranks"]}
    dry = run_cli(
        "train", V3_LAYOUT, "--dry-run", "--rank", 0, 2047, "--no-step", "--json",
        "--set", f"model.init_from={folder}",
    )  # fmt: skip
    assert dry.code == 0, dry.text
    for report in dry.json():
        reads, rank = report["init_from"], report["rank"]
        assert reads["read"] and not plan[rank]["read"]
        assert reads["bytes"] == plan[rank]["bytes"] and reads["files"] == plan[rank]["files"]
        share = reads["share_bytes"]
        print(
            f"V3 rank {rank}: read {reads['bytes'] / 2**20:.1f} MiB from {reads['files']} files, "
            f"its shards {share / 2**20:.1f} MiB, in {report['seconds']['init_from']:.1f} s"
        )
        assert share <= reads["bytes"] <= 2 * share
        assert reads["bytes"] < reads["checkpoint_bytes"] / 1000
    last = next(r for r in dry.json() if r["rank"] == 2047)["init_from"]
    print(f"V3 rank 2047: read {last['bytes'] / last['share_bytes'] - 1:.4%} over its shards")
    # No embedding or head: scales only, measured 0.0255 % over its shards; bound 0.1 %.
    assert last["bytes"] <= 1.001 * last["share_bytes"], last


def test_check_reports_the_checkpoint_and_the_reads(replicas):
    result = run_cli(
        "check", V3_LAYOUT, "--set", f"model.init_from={replicas['v3'].folder}", "--json"
    )
    assert result.code == 0, result.text
    messages = [f["message"] for f in result.json() if f["key"] == "model.init_from"]
    assert any("91,991 tensors in 163 file(s)" in m for m in messages), messages
    assert any(m.startswith("rank 2047 of 2048 will read") for m in messages), messages


def test_v2_lite_at_dp2_each_rank_reads_half(replicas):
    """V2-Lite (q_lora_rank null, greedy top-k, no balancing bias, no MTP) at dp 2: its own
    config.json and the deepseek-v2-lite flavor both fit; each rank reads its half."""
    folder = replicas["v2-lite"].folder
    layout = ["--set", "parallel.dp_shard=2", "--set", "train.seq_len=64"]
    for model in ("model.flavor=null", "model.flavor=deepseek-v2-lite"):
        verified = run_cli(
            "ckpt", "verify-hf", folder, "--config", REPO / "examples" / "debug.toml",
            "--set", model, *layout, "--world-size", 2, "--json",
        )  # fmt: skip
        assert verified.code == 0, verified.text
    dry = run_cli(
        "train", REPO / "examples" / "debug.toml", "--dry-run", "--world-size", 2, "--no-step",
        "--json", "--set", "model.flavor=null", "--set", f"model.init_from={folder}", *layout,
    )  # fmt: skip
    assert dry.code == 0, dry.text
    total = replicas["v2-lite"].data_bytes
    for report in dry.json():
        reads = report["init_from"]
        print(f"V2-Lite rank {report['rank']}: read {reads['bytes'] / total:.4f} of the checkpoint")
        assert reads["bytes"] == reads["share_bytes"]
        assert 0.45 * total < reads["bytes"] < 0.55 * total


# ---- damaged folders: one clear message, exit 1, before any worker ---------------------------

DAMAGE = {
    "truncated": ("v2-lite", "truncated"),
    "header_length": ("v2-lite", "prefix lies"),
    "missing_shard": ("v2-lite", "not found"),
    "wrong_file": ("v2-lite", "places it in"),
    "unknown_dtype": ("v2-lite", "I16: the loader reads"),
    "scale_shape": ("v3-cut", "in 128 x 128 blocks needs [12, 56]"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_folder_is_one_error_naming_it(kind, tmp_path):
    structure, words = DAMAGE[kind]
    if not sparse_files_supported(tmp_path):
        pytest.skip("no sparse files here")
    if structure == "v3-cut":
        write_release(tmp_path / "ckpt", "deepseek-v3", layers=2)
    else:
        write_release(tmp_path / "ckpt", "deepseek-v2-lite")
    corrupt(tmp_path / "ckpt", kind)
    result = run_cli(
        "check", REPO / "examples" / "debug.toml", "--set", "model.flavor=null",
        "--set", f"model.init_from={tmp_path / 'ckpt'}", "--set", "train.seq_len=64", "--json",
    )  # fmt: skip
    assert result.code == 1, result.text
    errors = [f for f in result.json() if f["severity"] == "error"]
    assert len(errors) == 1, errors  # the damage itself, not its knock-on effects
    assert words in errors[0]["message"] and errors[0]["fix"], errors[0]
    verified = run_cli(
        "ckpt", "verify-hf", tmp_path / "ckpt", "--config", REPO / "examples" / "debug.toml",
        "--set", "model.flavor=null", "--set", "train.seq_len=64",
    )  # fmt: skip
    assert verified.code == 1 and words in verified.out and "Traceback" not in verified.text


def test_nproc_and_torchrun_say_it_once_before_any_worker(tmp_path):
    if not sparse_files_supported(tmp_path):
        pytest.skip("no sparse files here")
    write_release(tmp_path / "ckpt", "deepseek-v2-lite")
    corrupt(tmp_path / "ckpt", "wrong_file")
    config = [
        str(REPO / "examples" / "debug.toml"), "--set", "model.flavor=null",
        "--set", f"model.init_from={tmp_path / 'ckpt'}", "--set", "train.seq_len=64",
        "--set", f"run.root={tmp_path}", "--set", "parallel.dp_shard=2",
    ]  # fmt: skip
    launchers = {
        "--nproc": [sys.executable, "-m", "dstrain", "train", *config, "--nproc", "2"],
        "torchrun": [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "dstrain.train", *config,
        ],
    }  # fmt: skip
    for name, command in launchers.items():
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        text = done.stdout + done.stderr
        assert done.returncode != 0, (name, text)
        assert text.count("does not fit this model") == 1, (name, text)
        assert "index disagreement" in text and "fix:" in text, (name, text)
        assert "dstrain/" not in text.replace(str(tmp_path), ""), (name, text)  # no frames of ours
        if name == "--nproc":
            assert "rank" not in text.lower(), text  # no worker started


def test_ckpt_verify_hf_bad_inputs(tmp_path):
    missing = run_cli("ckpt", "verify-hf", tmp_path, "--config", REPO / "examples" / "debug.toml")
    assert missing.code == 2 and "no config.json" in missing.err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    bad_rank = run_cli(
        "ckpt", "verify-hf", tmp_path, "--config", REPO / "examples" / "debug.toml",
        "--set", "model.flavor=debug", "--rank", 5,
    )  # fmt: skip
    assert bad_rank.code == 2 and "outside the world" in bad_rank.err
