"""`dstrain train [CONFIG]`: pre-flight the config, then train (no arguments: the debug model on
the embedded corpus, on CPU)."""

import argparse
import os

from dstrain.cli.common import add_config_args, non_negative_int, positive_int
from dstrain.cli.dry_run import add_dry_run_args, dry_run_world, run_dry
from dstrain.config.load import load_config
from dstrain.train.worker import before_launch, run_overrides, train

_EPILOG = """\
The run directory is runs/<run.name>/: config.toml (exactly what ran), metrics.jsonl, tb/
(TensorBoard), checkpoints/step-N/ with a `latest` pointer, summary.json, and profile/ with
--profile-steps.
A run directory that already holds a checkpoint resumes from it (checkpoint.resume = auto);
--resume PATH resumes from a given checkpoint; --fresh starts from scratch (and refuses a run
directory that already holds checkpoints, rather than mixing two runs in it).

Several processes: --nproc N starts N local workers through torchrun's elastic agent; on a
cluster run `torchrun --nnodes ... -m dstrain.train CONFIG [--set ...]` on every node instead
(`dstrain deploy slurm|k8s|bare CONFIG -o DIR` writes that launch for you).
The layout comes from the parallel section; the world size from the launcher.

Faults: --max-restarts K restarts the group when a worker dies, resuming from the newest valid
checkpoint (the steps since it are recomputed). SIGTERM (preemption) saves a final checkpoint
within checkpoint.preemption_deadline_s and exits 0. A NaN/Inf loss or a spike follows the guard
section (skip, rollback or stop). summary.json reports goodput, restarts and recomputed steps.

Out of memory (device or host) in a step: instead of a traceback, the failing rank prints its
memory by part (weights, gradients, optimizer, activations, other), the planner's estimate of
the same layout, and the nearest layouts that fit on the same GPUs as --set flags (also in
runs/<name>/oom.json), and the run exits 3 (--nproc too); the newest checkpoint stays valid.
docs/oom.md shows an example.

exit status: 0 done (or preempted), 1 an error (config, data, a failed rank), 2 unreadable
input, 3 out of memory.

examples:
  dstrain train                                   # debug model, embedded corpus, CPU
  dstrain train --nproc 4 --set parallel.dp_shard=2 --set parallel.ep=2 --set parallel.zero_stage=2
  dstrain train run.toml --set train.steps=1000 --set run.name=longer
  dstrain train --set data.source=corpus.jsonl --set data.text_field=content
  dstrain train --nproc 2 --max-restarts 3 --set checkpoint.interval=50
  dstrain train --profile-steps 5:7 --set metrics.prometheus_port=9400
  dstrain train examples/deepseek-v3-h800x2048.toml --dry-run --world-size 2048 --rank 0 --json

Dry run: --dry-run builds the given ranks' runtimes at any world size in this one CPU process,
on torch's fake process group with the model on meta, and reports per rank the layers held,
each mesh axis's group size, parameters, gradients and optimizer state (dense and expert), the
peak while building, and the activation peak of one step under fake tensors. It checks the
config first: an illegal layout prints the reasons and exits 1.

Metrics: every metrics.log_interval steps a line here, metrics.jsonl and tb/ get the keys of
docs/observability.md (loss, MFU, comm/exposed_fraction, pipeline bubble, memory, time per phase,
MoE load per layer); metrics.prometheus_port serves them on port + local rank; `dstrain report
RUN_DIR` plots them.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "train",
        help="train (no arguments: the debug model on the embedded corpus, on CPU)",
        description="Check the config with the same rules as `dstrain check`, then train and "
        "write the run directory.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_config_args(parser)
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=1,
        metavar="N",
        help="local worker processes, started through torchrun's elastic agent (default 1)",
    )
    parser.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=0,
        metavar="K",
        help="restart the whole group up to K times when a worker dies (torchrun's "
        "restart policy); it resumes from the newest valid checkpoint (default 0)",
    )
    parser.add_argument(
        "--profile-steps",
        type=_step_range,
        metavar="A:B",
        help="write a torch.profiler Chrome trace of steps A..B per rank to "
        "runs/<name>/profile/ (open in ui.perfetto.dev); other steps run unprofiled",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", metavar="PATH", help="resume from this checkpoint folder")
    group.add_argument(
        "--fresh", action="store_true", help="start from scratch, not from a checkpoint"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the final summary (summary.json's figures) as JSON; with --dry-run, the "
        "rank reports",
    )
    add_dry_run_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    overrides = run_overrides(args.overrides, args.resume, args.fresh, args.profile_steps)
    loaded = load_config(args.config, overrides)
    if args.dry_run:
        world = dry_run_world(args, loaded)
        before_launch(loaded, world, worker=False)
        return run_dry(args, loaded, world)
    worker = "LOCAL_RANK" in os.environ  # started by torchrun
    if worker:
        from dstrain.parallel.distributed import env_int  # imports torch: workers only

        world = env_int("WORLD_SIZE", 1)
    else:
        world = args.nproc
    # The layout, and init_from's checkpoint, are checked before any process exists.
    before_launch(loaded, world, worker)
    if (args.nproc > 1 or args.max_restarts) and not worker:
        from dstrain.cli.launch import launch_local

        return launch_local(
            args.nproc,
            _worker_argv(args, overrides),
            max_restarts=args.max_restarts,
            shutdown_s=loaded.config.checkpoint.preemption_deadline_s,
        )
    return train(loaded, args.json)


def _step_range(text: str) -> str:
    """`A:B` with 1 <= A <= B (argparse turns the ValueError into a usage error)."""
    first, sep, last = text.partition(":")
    if not (sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give two step numbers A:B with 1 <= A <= B (e.g. 5:7)"
        )
    return text


def _worker_argv(args: argparse.Namespace, overrides: list[str]) -> list[str]:
    argv = [str(args.config)] if args.config else []
    for override in overrides:
        argv += ["--set", override]
    if args.json:  # rank 0 prints the summary; the launcher's own output is on stderr
        argv.append("--json")
    return argv
