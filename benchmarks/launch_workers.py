"""What the multi-rank benchmarks share: one torchrun launch of a worker script on local gloo
ranks (rendezvous on 127.0.0.1). A launch costs ~3 s of start-up, so each one runs many rounds."""

import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_workers(
    nproc: int, worker: Path, *args: str, threads: int = 1, what: str = "the workers"
) -> None:
    """Run `worker ARGS` on `nproc` local ranks, `threads` OpenMP threads each; exits with the
    workers' stderr tail when the launch fails."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(nproc),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        str(worker),
        *args,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-4000:]}")
