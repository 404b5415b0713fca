"""Kubernetes manifests: a JobSet (default) or a Kubeflow PyTorchJob, the headless Service that
gives the leader pod a stable DNS name, the config as a ConfigMap, and an optional Volcano
PodGroup for gang scheduling. Built as dicts, dumped as one multi-document YAML.

Restart layering (docs/deploy.md): torchrun restarts the worker group inside the pods up to
max_restarts times (a worker process died; pods stay); the controller recreates the pods up to
max_restarts times (a pod or node died, or torchrun gave up). Both resume from the newest
checkpoint in the run directory, so it needs a volume that outlives the pods (--pvc).
"""

from typing import Any

import yaml

from dstrain.deploy.k8s_pod import labels, pod_template
from dstrain.deploy.spec import DeploySpec

MANIFEST = "dstrain.yaml"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
PYTORCHJOB_API = "kubeflow.org/v1"
PODGROUP_API = "scheduling.volcano.sh/v1beta1"
EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
REPLICATED_JOB = "node"


def leader_host(spec: DeploySpec) -> str:
    """The first pod's hostname under the headless Service (`<pod>.<service>`)."""
    if spec.k8s_kind == "jobset":
        return f"{spec.job_name}-{REPLICATED_JOB}-0-0.{spec.job_name}"  # <js>-<rjob>-<job>-<pod>
    return f"{spec.job_name}-master-0.{spec.job_name}"


def manifests(spec: DeploySpec) -> list[dict[str, Any]]:
    docs = [config_map(spec), service(spec)]
    if spec.gang == "volcano":
        docs.append(pod_group(spec))
    docs.append(jobset(spec) if spec.k8s_kind == "jobset" else pytorchjob(spec))
    return docs


def render_manifests(spec: DeploySpec) -> str:
    head = (
        f"# dstrain on Kubernetes ({spec.k8s_kind}), job {spec.job_name}: {spec.nodes} pod(s) x "
        f"{spec.gpus_per_node} GPU(s).\n# kubectl apply -f {MANIFEST}\n"
    )
    return head + yaml.dump_all(manifests(spec), Dumper=_Dumper, sort_keys=False, width=100)


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the config, the torchrun command) as literal blocks, readable; no
    `&id001` anchors for the replica templates that share one dict."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _str)


def _meta(spec: DeploySpec, name: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": labels(spec), **extra}


def config_map(spec: DeploySpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(spec, f"{spec.job_name}-config"),
        "data": {"config.toml": spec.config_toml},
    }


def service(spec: DeploySpec) -> dict[str, Any]:
    """Headless: DNS resolves each pod's hostname to its IP, before the pods are ready (the
    rendezvous happens before anything could be ready)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(spec, spec.job_name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {"dstrain.io/job": spec.job_name},
            "ports": [{"name": "rdzv", "port": spec.rdzv_port, "targetPort": spec.rdzv_port}],
        },
    }


def pod_group(spec: DeploySpec) -> dict[str, Any]:
    """Volcano gang scheduling: no pod starts until all `nodes` pods can (a partial start would
    hold GPUs while waiting in rendezvous)."""
    return {
        "apiVersion": PODGROUP_API,
        "kind": "PodGroup",
        "metadata": _meta(spec, spec.job_name),
        "spec": {
            "minMember": spec.nodes,
            "minResources": {"nvidia.com/gpu": str(spec.world_size)},
            "queue": spec.volcano_queue,
        },
    }


def jobset(spec: DeploySpec) -> dict[str, Any]:
    """N one-pod Jobs (replicas N, parallelism 1), so exclusive topology puts each on its own
    host. backoffLimit 0: a failed pod fails its Job at once and the JobSet failure policy
    recreates all Jobs (the group restarts together, as rendezvous needs)."""
    job_spec = {
        "parallelism": 1,
        "completions": 1,
        "backoffLimit": 0,
        "template": pod_template(spec, leader_host(spec), restart_policy="Never"),
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _meta(spec, spec.job_name, annotations={EXCLUSIVE: "kubernetes.io/hostname"}),
        "spec": {
            "network": {
                "enableDNSHostnames": True,
                "subdomain": spec.job_name,
                "publishNotReadyAddresses": True,
            },
            "failurePolicy": {"maxRestarts": spec.max_restarts},
            "successPolicy": {"operator": "All"},
            "replicatedJobs": [
                {
                    "name": REPLICATED_JOB,
                    "replicas": spec.nodes,
                    "template": {"metadata": {"labels": labels(spec)}, "spec": job_spec},
                }
            ],
        },
    }


def pytorchjob(spec: DeploySpec) -> dict[str, Any]:
    """Master (the rendezvous leader) + nodes-1 Workers. restartPolicy OnFailure restarts a
    failed pod's container in place; runPolicy.backoffLimit caps those restarts for the job."""
    template = pod_template(spec, leader_host(spec), restart_policy="OnFailure")
    # A stable `<pod>.<service>` name needs the pod's subdomain set to the headless Service.
    template["spec"] = {"subdomain": spec.job_name, **template["spec"]}
    replicas = {"Master": _replica(1, template)}
    if spec.nodes > 1:
        replicas["Worker"] = _replica(spec.nodes - 1, template)
    return {
        "apiVersion": PYTORCHJOB_API,
        "kind": "PyTorchJob",
        "metadata": _meta(spec, spec.job_name),
        "spec": {
            "nprocPerNode": str(spec.gpus_per_node),
            "runPolicy": {"backoffLimit": spec.max_restarts, "cleanPodPolicy": "Running"},
            "pytorchReplicaSpecs": replicas,
        },
    }


def _replica(count: int, template: dict[str, Any]) -> dict[str, Any]:
    return {"replicas": count, "restartPolicy": "OnFailure", "template": template}
