"""`dstrain train --nproc N`: start N local workers through torchrun's elastic agent
(`torch.distributed.run`), not hand-rolled spawning, each running `python -m dstrain.train`."""

import os

from dstrain.cli.common import console


def launch_local(nproc: int, worker_argv: list[str]) -> int:
    """Run the agent in this process; a failed worker ends the job with its rank and error."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # Restarted workers must not read the previous attempt's rendezvous keys (TORCH-CPU-NOTES).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(nproc), "-m", "dstrain.train", *worker_argv]
    )
    try:
        run(args)
    except ChildFailedError as exc:
        err = console(stderr=True)
        for rank, failure in sorted(exc.failures.items()):
            err.print(
                f"dstrain train: rank {rank} failed (exit code {failure.exitcode})", markup=False
            )
        return 1
    return 0
