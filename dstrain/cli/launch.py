"""`dstrain train --nproc N` (and `dstrain bench comm --nproc N`): start N local workers through
torchrun's elastic agent (`torch.distributed.run`), not hand-rolled spawning, each running
`python -m <module>` (dstrain.train, dstrain.bench)."""

import os

from dstrain.cli.common import console
from dstrain.errors import OUT_OF_MEMORY


def launch_local(
    nproc: int,
    worker_argv: list[str],
    *,
    module: str = "dstrain.train",
    max_restarts: int = 0,
    shutdown_s: float = 30.0,
) -> int:
    """Run the agent in this process, each worker running `python -m {module} {worker_argv}`;
    a failed worker ends the job with its rank and error (exit code 1, or 3 when a worker ran
    out of memory: `train/oom.py`), or,
    with `max_restarts`, restarts the whole group (which resumes from its newest checkpoint).
    On SIGTERM the agent forwards it to the workers and waits `shutdown_s` for them (they save a
    final checkpoint) before SIGKILL."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Restarted workers must not read the previous attempt's rendezvous keys (TORCH-CPU-NOTES).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(shutdown_s) + 1))
    args = get_args_parser().parse_args(
        [
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(max_restarts),
            "-m",
            module,
            *worker_argv,
        ]
    )
    command = "dstrain " + module.removeprefix("dstrain.")  # how messages name the command
    try:
        run(args)
    except SignalException as exc:
        # The workers got the signal too and have saved their final checkpoint, or the agent
        # killed them after shutdown_s.
        console(stderr=True).print(f"{command}: stopped by signal {exc.sigval.name}", markup=False)
        return 0 if exc.sigval.name == "SIGTERM" else 128 + int(exc.sigval)
    except ChildFailedError as exc:
        err = console(stderr=True)
        for rank, failure in sorted(exc.failures.items()):
            err.print(f"{command}: rank {rank} failed (exit code {failure.exitcode})", markup=False)
        # A rank that ran out of memory decides the job's code: its advice is the cause.
        codes = {failure.exitcode for failure in exc.failures.values()}
        return OUT_OF_MEMORY if OUT_OF_MEMORY in codes else 1
    return 0
