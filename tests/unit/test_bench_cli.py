"""`dstrain bench comm` flags: bad ones give one message with a fix and a non-zero exit, before any
worker starts; good ones reach the workers unchanged."""

import argparse

import pytest

from dstrain.cli import bench
from dstrain.cli.common import run_guarded


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="dstrain")
    bench.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def _fails(capsys, *argv: str) -> tuple[int, str]:
    args = _parse(*argv)
    code = run_guarded(args.func, args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    ("argv", "message", "fix"),
    [
        (["--ops", "all_reduce,alltoall"], "unknown op `alltoall`", "all_to_all"),
        (["--sizes", "1X:1M"], "'1X' is not a size", "--sizes 1K:64M"),
        (["--sizes", "64M:1K"], "first size is larger", "MIN:MAX"),
        (["--nproc", "1"], "at least 2 ranks", "--nproc 2"),
        (["--axis", "tp"], "--axis tp needs a layout", "--config C"),
        (["--axis", "tp", "--set", "parallel.tp=1"], "the tp axis has 1 rank", "parallel.tp=2"),
        (["--axis", "tp", "--set", "parallel.tp=4", "--nproc", "2"], "world size", "world size"),
        (["--config", "/nonexistent/run.toml"], "run.toml", ""),
    ],
)
def test_bad_flags_are_one_clear_error(capsys, argv, message, fix):
    code, err = _fails(capsys, "comm", *argv)
    assert code in (1, 2)
    assert err.startswith("dstrain bench: error: ") and message in err
    assert fix in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--straggler-ratio", "0.9"],
        ["--min-busbw", "fast"],
        ["--dtype", "int8"],
        ["--axis", "cp"],
        ["--iters", "0"],
    ],
)
def test_bad_values_are_argparse_errors(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        _parse("comm", *argv)
    assert exc.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_bench_alone_prints_help(capsys):
    args = _parse()
    assert args.func(args) == 2 and "comm" in capsys.readouterr().err


def test_the_workers_get_the_same_flags(tmp_path):
    argv = ["comm", "--ops", "all_reduce", "--sizes", "1K:1M", "--step-factor", "4", "--dtype",
            "bfloat16", "--warmup", "1", "--iters", "3", "--axis", "tp", "--set",
            "parallel.tp=2", "--straggler-ratio", "1.5", "--min-busbw", "0.5", "--no-gemm",
            "--json"]  # fmt: skip
    args = _parse(*argv, "--nproc", "4")
    again = _parse(*bench._worker_argv(args, tmp_path / "r.json"))
    keep = set(vars(args)) - {"func", "nproc", "result"}
    assert {k: vars(again)[k] for k in keep} == {k: vars(args)[k] for k in keep}
    assert again.result == tmp_path / "r.json" and again.nproc is None
