"""The one torchrun command line that every target runs (Slurm, bare metal, Kubernetes), so the
two-node e2e test that runs launch.sh exercises what a cluster runs.

It reads its inputs from shell variables, which each target fills its own way:
    NNODES, NPROC_PER_NODE       nodes and ranks per node (torchrun --nnodes/--nproc-per-node)
    MASTER_ADDR, MASTER_PORT     the c10d rendezvous endpoint: the leader node, port 29400
    RDZV_ID                      one id per job (Slurm: $SLURM_JOB_ID; Kubernetes: the job name)
    MAX_RESTARTS                 torchrun's in-place restarts of the whole worker group
    DSTRAIN_CONFIG               the resolved config.toml
    NODE_RANK (optional)         only static rendezvous uses it; c10d ranks nodes by join order
    PYTHON (optional)            the interpreter, python3 by default (tests point it at a venv)
"""

import shlex

from dstrain.deploy.spec import DeploySpec


def torchrun_command() -> str:
    """`python -m torch.distributed.run ... -m dstrain.train CONFIG`, one flag per line.
    `python -m torch.distributed.run` rather than `torchrun` so $PYTHON picks the environment."""
    parts = [
        '"${PYTHON:-python3}" -m torch.distributed.run',
        '--nnodes="$NNODES"',
        '--nproc-per-node="$NPROC_PER_NODE"',
        '${NODE_RANK:+--node-rank="$NODE_RANK"}',
        "--rdzv-backend=c10d",
        '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"',
        '--rdzv-id="$RDZV_ID"',
        '--max-restarts="$MAX_RESTARTS"',
        '-m dstrain.train "$DSTRAIN_CONFIG"',
    ]
    command = " \\\n  ".join(parts)
    # slurm.py wraps it in single quotes for `srun bash -c '...'`.
    assert "'" not in command
    return command


def env_defaults(values: dict[str, str]) -> str:
    """`: "${NAME:=value}"` lines: the environment wins, the rendered value is the default."""
    return "\n".join(f': "${{{name}:={value}}}"' for name, value in values.items())


def env_exports(values: dict[str, str], *, overridable: bool) -> str:
    """`export NAME=value` lines; `overridable` keeps a value the environment already has."""
    if overridable:
        return "\n".join(f'export {k}="${{{k}:-{v}}}"' for k, v in values.items())
    return "\n".join(f"export {k}={shlex.quote(v)}" for k, v in values.items())


def launch_defaults(spec: DeploySpec, master_addr: str = "127.0.0.1") -> dict[str, str]:
    """The launch variables from the config and flags (bare metal: their defaults; a
    Kubernetes pod: its env, with the leader pod as `master_addr`)."""
    return {
        "NNODES": str(spec.nodes),
        "NPROC_PER_NODE": str(spec.gpus_per_node),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(spec.rdzv_port),
        "RDZV_ID": spec.job_name,
        "MAX_RESTARTS": str(spec.max_restarts),
    }
