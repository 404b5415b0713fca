"""The pod every Kubernetes node runs: one pod per node holding all its GPUs, the torchrun agent
as its container, NCCL env, /dev/shm, the config and the run directory on volumes, and
placement (one pod per host, optional node selector, Volcano gang scheduling)."""

from pathlib import PurePosixPath
from typing import Any

from dstrain.deploy.docker import CONFIG_DIR, WORKDIR
from dstrain.deploy.launch import launch_defaults, torchrun_command
from dstrain.deploy.nccl_env import nccl_env
from dstrain.deploy.spec import CONFIG_NAME, DeploySpec

CONTAINER = "pytorch"  # Kubeflow's training operator finds the training container by this name
JOB_LABEL = "dstrain.io/job"
HOSTNAME_KEY = "kubernetes.io/hostname"
GROUP_ANNOTATION = "scheduling.k8s.io/group-name"  # Volcano: which PodGroup a pod belongs to


def labels(spec: DeploySpec) -> dict[str, str]:
    return {"app.kubernetes.io/name": "dstrain", JOB_LABEL: spec.job_name}


def pod_template(spec: DeploySpec, leader: str, restart_policy: str) -> dict[str, Any]:
    """A core/v1 PodTemplateSpec; `leader` is the stable DNS name of the rendezvous pod."""
    metadata: dict[str, Any] = {"labels": labels(spec)}
    pod: dict[str, Any] = {"restartPolicy": restart_policy}
    if spec.gang == "volcano":
        metadata["annotations"] = {GROUP_ANNOTATION: spec.job_name}
        pod["schedulerName"] = "volcano"
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    pod["affinity"] = _one_pod_per_host(spec)
    pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    pod["containers"] = [_container(spec, leader)]
    pod["volumes"] = _volumes(spec)
    return {"metadata": metadata, "spec": pod}


def _one_pod_per_host(spec: DeploySpec) -> dict[str, Any]:
    """Two pods of this job never share a host: each pod is a whole node's worth of ranks."""
    term = {
        "labelSelector": {"matchLabels": {JOB_LABEL: spec.job_name}},
        "topologyKey": HOSTNAME_KEY,
    }
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}


def launch_env(spec: DeploySpec, leader: str) -> dict[str, str]:
    return {
        **launch_defaults(spec, leader),
        "DSTRAIN_CONFIG": f"{CONFIG_DIR}/{CONFIG_NAME}",
        "PYTHON": "python3",
    }


def _container(spec: DeploySpec, leader: str) -> dict[str, Any]:
    env = {**launch_env(spec, leader), **nccl_env(spec, "k8s")}
    devices = {"nvidia.com/gpu": spec.gpus_per_node}
    if spec.uses_rdma:
        devices[spec.rdma_resource] = 1
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": spec.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": WORKDIR,
        "command": ["bash", "-c", f"exec {torchrun_command()}"],
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"name": _port_name(spec), "containerPort": spec.rdzv_port, "protocol": "TCP"}],
        # Extended resources (GPUs, RDMA) must have requests equal to limits.
        "resources": {"limits": dict(devices), "requests": dict(devices)},
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "runs", "mountPath": run_mount(spec)},
        ],
    }
    if spec.uses_rdma:
        # Registering (pinning) memory with the HCA needs IPC_LOCK.
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    return container


def _port_name(spec: DeploySpec) -> str:
    """Kubeflow's operator injects MASTER_ADDR=<job>-master-0 and MASTER_PORT from the port
    named `pytorchjob-port`; naming ours so makes its values and ours the same leader and port,
    whichever of the two duplicate env entries wins."""
    return "pytorchjob-port" if spec.k8s_kind == "pytorchjob" else "rdzv"


def run_mount(spec: DeploySpec) -> str:
    """Where run.root lands in the container (relative roots live under the working dir)."""
    root = PurePosixPath(spec.run_root)
    return str(root if root.is_absolute() else PurePosixPath(WORKDIR) / root)


def _volumes(spec: DeploySpec) -> list[dict[str, Any]]:
    # Dataloader workers and NCCL's intra-node transport use /dev/shm; the container default of
    # 64 MiB is far too small.
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": spec.shm_size}}
    config = {"name": "config", "configMap": {"name": f"{spec.job_name}-config"}}
    if spec.pvc:
        runs = {"name": "runs", "persistentVolumeClaim": {"claimName": spec.pvc}}
    else:
        runs = {"name": "runs", "emptyDir": {}}
    return [shm, config, runs]
