"""Running a worker script on N gloo ranks through torchrun, and collecting each rank's result.

A worker calls `worker_main(fn)`: it joins the process group (60 s timeout, so a stuck collective
fails the test instead of hanging it), runs `fn(out_dir)` and writes its JSON result as
`rank{r}.json`, then leaves through `dstrain.parallel.distributed.shutdown` (os._exit, dodging the
gloo exit-time abort). One launch runs many cases: torchrun start-up costs ~3-4 s.
"""

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    nproc: int, worker: str, out_dir: Path, *args: str, timeout: float = 300
) -> list[Any]:
    """Run tests/distributed/workers/{worker}.py on `nproc` ranks; return the ranks' results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(REPO / "tests" / "distributed" / "workers" / f"{worker}.py"),
        str(out_dir),
        *args,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise AssertionError(f"{worker} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def worker_main(fn: Callable[[Path], Any]) -> None:
    """Entry point of a worker script: init gloo, run fn, write this rank's result, exit."""
    import torch.distributed as dist

    from dstrain.parallel.distributed import shutdown

    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    result = fn(out_dir)
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    shutdown(0)
