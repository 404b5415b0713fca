"""Slurm and bare metal: an sbatch script that starts one torchrun agent per node through srun,
and launch.sh, the same torchrun command for any machine (ssh, pdsh, a test)."""

from dstrain.deploy.launch import env_defaults, env_exports, launch_defaults, torchrun_command
from dstrain.deploy.nccl_env import nccl_env
from dstrain.deploy.spec import CONFIG_NAME, DeploySpec

SBATCH_NAME = "dstrain.sbatch"
LAUNCH_NAME = "launch.sh"


def render_launch_sh(spec: DeploySpec) -> str:
    defaults = launch_defaults(spec)
    return f"""#!/usr/bin/env bash
# dstrain launch for bare metal: run this once on every node (job "{spec.job_name}").
#   NNODES=2 MASTER_ADDR=<first node> bash launch.sh     # on each of the 2 nodes
# Every variable below can be set in the environment; the values here come from the config.
# Restarts: torchrun restarts the whole worker group up to MAX_RESTARTS times when a worker
# dies; the workers resume from the newest checkpoint. A lost node ends the job.
# Every node must see the same run directory (run.root: {spec.run_root}) and DIR: each rank
# writes its own checkpoint shards there.
set -euo pipefail
HERE="$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)"
{env_defaults(defaults)}
: "${{DSTRAIN_CONFIG:=$HERE/{CONFIG_NAME}}}"
export NNODES NPROC_PER_NODE MASTER_ADDR MASTER_PORT RDZV_ID MAX_RESTARTS DSTRAIN_CONFIG
{env_exports(nccl_env(spec, "bare"), overridable=True)}
exec {torchrun_command()}
"""


def render_sbatch(spec: DeploySpec) -> str:
    chosen = (("time", spec.time), ("partition", spec.partition))
    optional = "".join(f"#SBATCH --{key}={value}\n" for key, value in chosen if value)
    cpu_only = spec.cpu_only
    gpus = "" if cpu_only else f"#SBATCH --gpus-per-node={spec.gpus_per_node}\n"
    ranks = "CPU rank(s)" if cpu_only else "rank(s), one per GPU"
    return f"""#!/bin/bash
#SBATCH --job-name={spec.job_name}
#SBATCH --nodes={spec.nodes}
#SBATCH --ntasks-per-node=1
{gpus}#SBATCH --cpus-per-task={spec.cpus_per_task}
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
{optional}# dstrain on Slurm: submit from this folder (cd DIR && sbatch {SBATCH_NAME}), or set
# DEPLOY_DIR. One task per node runs one torchrun agent, which starts {spec.gpus_per_node} {ranks};
# the agents meet through c10d rendezvous on the first node of the allocation.
# --cpus-per-task={spec.cpus_per_task} is every CPU the node's agent and its ranks (and their
# dataloaders) may use: it must not exceed a node's CPUs (sinfo -o "%n %c"). A job that asks
# for more never starts: sbatch refuses it ("Requested node configuration is not available")
# or, without EnforcePartLimits, it stays PENDING with reason PartitionConfig. Then render
# again with a smaller --cpus-per-task, or override it: sbatch --cpus-per-task=N {SBATCH_NAME}.
# Restarts: torchrun restarts the worker group up to MAX_RESTARTS times in place (the workers
# resume from the newest checkpoint); --kill-on-bad-exit ends the whole step when an agent
# gives up, and Slurm itself does not requeue (add --requeue for that).
# run.root ({spec.run_root}) and this folder must be on a filesystem every node mounts: each
# rank writes its own checkpoint shards there.
set -euo pipefail
DEPLOY_DIR="${{DEPLOY_DIR:-$SLURM_SUBMIT_DIR}}"
export NNODES="$SLURM_JOB_NUM_NODES"
export NPROC_PER_NODE={spec.gpus_per_node}
# sed reads the whole list: `head -n1` would close the pipe early, and scontrol's SIGPIPE
# fails the script under pipefail on a long node list.
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)"
export MASTER_ADDR
export MASTER_PORT={spec.rdzv_port}
export RDZV_ID="$SLURM_JOB_ID"
export MAX_RESTARTS={spec.max_restarts}
export DSTRAIN_CONFIG="${{DSTRAIN_CONFIG:-$DEPLOY_DIR/{CONFIG_NAME}}}"
{env_exports(nccl_env(spec, "slurm"), overridable=True)}
# srun's --cpus-per-task, said again: Slurm's docs since 22.05 say srun does not inherit it
# from sbatch, and a step without it gets one CPU per task: with core binding every rank of
# the node would share that one core.
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \\
  --cpus-per-task="${{SLURM_CPUS_PER_TASK:-{spec.cpus_per_task}}}" \\
  bash -c '{torchrun_command()}'
"""
