"""`dstrain deploy {docker,k8s,slurm,bare} CONFIG -o DIR`: launch files from one config."""

import argparse
import re
from pathlib import Path
from typing import Any

from dstrain.cli.common import (
    add_config_args,
    add_json_flag,
    console,
    non_negative_int,
    positive_int,
    print_json,
)
from dstrain.deploy import TARGETS, render
from dstrain.deploy.build import build_spec
from dstrain.deploy.docker import CUDA_BUILDS
from dstrain.deploy.kubernetes import leader_host
from dstrain.deploy.render import EXECUTABLE
from dstrain.deploy.spec import DEFAULT_IMAGE, DeploySpec
from dstrain.deploy.write import check_out_dir, write_files
from dstrain.errors import UserError

_EPILOG = """\
targets (each writes DIR/config.toml, the resolved config that runs, and points at it):
  docker  Dockerfile (CUDA base matching torch's CUDA build, pinned dependencies, torchrun
          entry point) + Dockerfile.dockerignore; build it from the dstrain source tree
  k8s     dstrain.yaml: ConfigMap, headless Service, JobSet (or --k8s-kind pytorchjob), and a
          Volcano PodGroup with --gang volcano; one pod per node with all its GPUs
  slurm   dstrain.sbatch (srun + torchrun, c10d rendezvous on the first node) + launch.sh
  bare    launch.sh alone: run it on every node with NNODES, MASTER_ADDR (and MASTER_PORT,
          NPROC_PER_NODE, NODE_RANK, PYTHON) in the environment

Nodes and GPUs per node come from the cluster section; --nodes/--gpus-per-node override it.
The config is checked with `dstrain check`'s rules for nodes x gpus_per_node ranks, and
tensor/expert-parallel groups must fit inside a node. Restarts: torchrun restarts the worker
group in place up to --max-restarts times; Kubernetes recreates the pods up to as many times
(docs/deploy.md explains the layers).

examples:
  dstrain deploy docker run.toml -o deploy/docker --image registry.example.com/dstrain:0.1.0
  dstrain deploy k8s run.toml -o deploy/k8s --nodes 4 --pvc dstrain-runs --gang volcano
  dstrain deploy k8s run.toml -o deploy/k8s --k8s-kind pytorchjob --node-selector pool=h100
  dstrain deploy slurm run.toml -o deploy/slurm --nodes 16 --partition gpu --time 48:00:00
  NNODES=2 MASTER_ADDR=node0 bash deploy/slurm/launch.sh   # bare metal, on each node
"""

_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?([KMGTPE]i?)?$")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "deploy",
        help="render Docker, Kubernetes or Slurm launch files",
        description="Render the launch files of one config for Docker, Kubernetes (JobSet or "
        "PyTorchJob), Slurm or bare metal, all running the same torchrun command.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("target", choices=TARGETS, help="what to render: " + ", ".join(TARGETS))
    add_config_args(parser, required=True)
    parser.add_argument("-o", "--output", type=Path, required=True, metavar="DIR")
    parser.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    _shape_args(parser)
    _k8s_args(parser.add_argument_group("kubernetes"))
    _other_args(parser)
    add_json_flag(parser)
    parser.set_defaults(func=run)


def _shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nodes", type=positive_int, metavar="N", help="default cluster.nodes")
    parser.add_argument(
        "--gpus-per-node", type=positive_int, metavar="G", help="default cluster.gpus_per_node"
    )
    parser.add_argument(
        "--image", default=DEFAULT_IMAGE, help="container image (default %(default)s)"
    )
    parser.add_argument("--job-name", help="job name (default run.name, DNS-1123 sanitized)")
    parser.add_argument(
        "--max-restarts",
        type=non_negative_int,
        default=3,
        metavar="K",
        help="torchrun restarts of the worker group, and Kubernetes restarts of the pods "
        "(default %(default)s); each restart resumes from the newest checkpoint",
    )
    parser.add_argument(
        "--allow-cross-node-ep",
        action="store_true",
        help="accept expert-parallel groups larger than a node (all-to-all over the network)",
    )


def _k8s_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--k8s-kind", choices=("jobset", "pytorchjob"), default="jobset")
    group.add_argument("--gang", choices=("volcano",), help="gang-schedule with a Volcano PodGroup")
    group.add_argument("--volcano-queue", default="default", help="Volcano queue (default)")
    group.add_argument(
        "--node-selector",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="only schedule on nodes with this label (repeatable)",
    )
    group.add_argument(
        "--pvc",
        metavar="NAME",
        help="PersistentVolumeClaim for the run directory, ReadWriteMany when nodes > 1 (every "
        "rank writes its checkpoint shards there); default: an emptyDir, so checkpoints die "
        "with the pod",
    )
    group.add_argument("--shm-size", default="64Gi", help="/dev/shm size (default %(default)s)")
    group.add_argument(
        "--rdma-resource",
        default="rdma/ib",
        help="RDMA device resource requested per pod on ib/roce networks, as your RDMA device "
        "plugin names it; `none` requests none (default %(default)s)",
    )


def _other_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--socket-ifname",
        help="NCCL_SOCKET_IFNAME (default: eth0 on Kubernetes, ^lo,docker elsewhere)",
    )
    parser.add_argument(
        "--cuda", choices=tuple(CUDA_BUILDS), default="cu128", help="torch CUDA build (docker)"
    )
    parser.add_argument("--cpus-per-task", type=positive_int, default=16, help="Slurm CPUs/node")
    parser.add_argument("--time", help="Slurm time limit, e.g. 48:00:00")
    parser.add_argument("--partition", help="Slurm partition")


def run(args: argparse.Namespace) -> int:
    check_out_dir(args.output, args.force)  # before any work: never a surprise overwrite
    built = build_spec(
        args.config,
        args.overrides,
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        allow_cross_node_ep=args.allow_cross_node_ep,
        **_spec_flags(args),
    )
    spec, warnings = built.spec, built.warnings
    if args.target == "k8s" and not spec.pvc:
        warnings.append(
            "no --pvc: the run directory is an emptyDir on each pod, so checkpoints die with "
            "the pod"
            + (
                " and no pod holds a whole one (every rank writes its own shards), so no "
                "restart can resume: give a ReadWriteMany claim"
                if spec.nodes > 1
                else " (restarts start over)"
            )
        )
    files = render(args.target, spec)
    written = write_files(args.output, files, EXECUTABLE, args.force)
    facts = {
        "target": args.target,
        "dir": str(args.output),
        "files": [str(p) for p in written],
        "job_name": spec.job_name,
        "nodes": spec.nodes,
        "gpus_per_node": spec.gpus_per_node,
        "world_size": spec.world_size,
        "network": spec.network,
        "image": spec.image,
        "max_restarts": spec.max_restarts,
        "rdzv_endpoint": _endpoint(args.target, spec),
        "warnings": warnings,
    }
    if args.json:
        print_json(facts)
    else:
        _print_summary(facts)
    return 0


def _spec_flags(args: argparse.Namespace) -> dict[str, object]:
    if not _QUANTITY.match(args.shm_size):
        raise UserError(
            f"--shm-size {args.shm_size!r} is not a Kubernetes quantity", "use e.g. 64Gi or 512Mi"
        )
    return {
        "image": args.image,
        "job_name": args.job_name,
        "max_restarts": args.max_restarts,
        "socket_ifname": args.socket_ifname,
        "shm_size": args.shm_size,
        "rdma_resource": args.rdma_resource,
        "k8s_kind": args.k8s_kind,
        "gang": args.gang,
        "volcano_queue": args.volcano_queue,
        "node_selector": _key_values(args.node_selector),
        "pvc": args.pvc,
        "cuda": args.cuda,
        "cpus_per_task": args.cpus_per_task,
        "time": args.time,
        "partition": args.partition,
    }


def _key_values(items: list[str]) -> dict[str, str]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"--node-selector {item!r} is not KEY=VALUE", "e.g. pool=h100")
        pairs[key] = value
    return pairs


def _endpoint(target: str, spec: DeploySpec) -> str:
    if target == "k8s":
        return f"{leader_host(spec)}:{spec.rdzv_port}"
    if target == "slurm":
        return f"<first node of $SLURM_JOB_NODELIST>:{spec.rdzv_port}"
    return f"$MASTER_ADDR:{spec.rdzv_port}" if target == "bare" else "--standalone (one node)"


def _print_summary(facts: dict[str, Any]) -> None:
    out = console()
    out.print(
        f"dstrain deploy {facts['target']}: {facts['job_name']} on {facts['nodes']} node(s) x "
        f"{facts['gpus_per_node']} GPU(s) = {facts['world_size']} ranks, rendezvous "
        f"{facts['rdzv_endpoint']}",
        markup=False,
    )
    for path in facts["files"]:
        out.print(f"  wrote {path}", markup=False)
    err = console(stderr=True)
    for warning in facts["warnings"]:
        err.print(f"warning: {warning}", markup=False)
