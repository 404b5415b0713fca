"""The Kubernetes manifests, checked offline: built-in kinds (ConfigMap, Service) and the pod and
job templates inside the custom resources against the official Kubernetes OpenAPI schemas that
kubernetes-validate bundles (strict: unknown fields fail); the custom resources' own fields
against our schemas (test_deploy_crd_schemas.py). Plus the facts the brief asks for: GPUs per
pod, NCCL env per network, rendezvous through the leader, restarts, gang scheduling,
placement and volumes."""

import copy
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from dstrain.deploy import kubernetes
from dstrain.deploy.build import build_spec
from tests.unit.test_deploy_crd_schemas import validate_crd

K8S_VERSION = "1.37"
DEBUG = Path(__file__).resolve().parents[2] / "examples" / "debug.toml"

VARIANTS = {
    "jobset": {},
    "jobset-volcano-pvc": {"gang": "volcano", "pvc": "runs", "node_selector": {"pool": "h100"}},
    "pytorchjob": {"k8s_kind": "pytorchjob"},
    "pytorchjob-volcano-roce": {"k8s_kind": "pytorchjob", "gang": "volcano", "net": "roce-400"},
    "jobset-eth": {"net": "eth-100"},
    "jobset-no-rdma": {"rdma_resource": "none"},
}


def _docs(nodes: int = 4, gpus: int = 8, net: str = "ib-ndr", **flags: Any) -> list[dict]:
    overrides = [f'cluster.network="{net}"']
    spec = build_spec(DEBUG, overrides, nodes=nodes, gpus_per_node=gpus, **flags).spec
    text = kubernetes.render_manifests(spec)
    docs = list(yaml.safe_load_all(text))
    assert docs == kubernetes.manifests(spec)  # the YAML says what the dicts say
    return docs


def _kind(docs: list[dict], kind: str) -> dict:
    return next(d for d in docs if d["kind"] in kind.split("|"))


def _k8s_validate(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def embedded(doc: dict) -> list[dict]:
    """The built-in objects inside a custom resource, as manifests the OpenAPI schemas check:
    a JobSet's job templates as batch/v1 Jobs, a PyTorchJob's pod templates as PodTemplates."""
    if doc["kind"] == "JobSet":
        return [
            {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {"name": rjob["name"], **rjob["template"].get("metadata", {})},
                "spec": rjob["template"]["spec"],
            }
            for rjob in doc["spec"]["replicatedJobs"]
        ]
    if doc["kind"] == "PyTorchJob":
        return [
            {
                "apiVersion": "v1",
                "kind": "PodTemplate",
                "metadata": {"name": role.lower()},
                "template": replica["template"],
            }
            for role, replica in doc["spec"]["pytorchReplicaSpecs"].items()
        ]
    return []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_manifest_validates(variant):
    docs = _docs(**VARIANTS[variant])
    for doc in docs:
        if doc["kind"] in ("ConfigMap", "Service"):
            _k8s_validate(doc)
        else:
            validate_crd(doc)
            for inner in embedded(doc):
                _k8s_validate(inner)


def _pod_spec(doc: dict) -> dict:
    inner = embedded(doc)[0]
    return (
        inner["spec"]["template"]["spec"] if inner["kind"] == "Job" else inner["template"]["spec"]
    )


def test_the_official_schema_rejects_a_wrong_field_so_these_tests_can_fail():
    job = embedded(_kind(_docs(), "JobSet"))[0]
    _k8s_validate(job)
    broken = copy.deepcopy(job)
    container = broken["spec"]["template"]["spec"]["containers"][0]
    container["resources"]["limits"] = [{"nvidia.com/gpu": 8}]  # a list, not a map
    with pytest.raises(kubernetes_validate.ValidationError):
        _k8s_validate(broken)
    misspelt = copy.deepcopy(job)
    misspelt["spec"]["template"]["spec"]["nodeSelectr"] = {"pool": "h100"}
    with pytest.raises(kubernetes_validate.ValidationError):
        _k8s_validate(misspelt)


@pytest.mark.parametrize(
    ("kind", "path", "value"),
    [
        ("JobSet", ("spec", "failurePolicy", "maxRestart"), 3),  # misspelt
        ("JobSet", ("spec", "replicatedJobs"), {"name": "node"}),  # not a list
        ("PyTorchJob", ("spec", "pytorchReplicaSpecs", "Chief"), {"template": {}}),
        ("PyTorchJob", ("spec", "nprocPerNode"), 8),  # a string in the API
        ("PodGroup", ("spec", "minMember"), "4"),
    ],
)
def test_our_crd_schemas_reject_wrong_fields(kind, path, value):
    docs = _docs(k8s_kind="pytorchjob" if kind == "PyTorchJob" else "jobset", gang="volcano")
    doc = copy.deepcopy(_kind(docs, kind))
    validate_crd(doc)
    target = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(doc)


def _env(pod: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in pod["containers"][0]["env"]}


def test_one_pod_per_node_with_all_its_gpus_and_never_two_on_a_host():
    jobset = _kind(_docs(nodes=4, gpus=8), "JobSet")
    assert jobset["spec"]["replicatedJobs"][0]["replicas"] == 4
    assert jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 1
    assert jobset["metadata"]["annotations"][kubernetes.EXCLUSIVE] == "kubernetes.io/hostname"
    pod = _pod_spec(jobset)
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    term = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["topologyKey"] == "kubernetes.io/hostname"


def test_rendezvous_goes_through_the_leader_pod_of_the_headless_service():
    docs = _docs(nodes=4, gpus=8)
    service, jobset = _kind(docs, "Service"), _kind(docs, "JobSet")
    assert service["spec"]["clusterIP"] == "None"
    assert jobset["spec"]["network"]["subdomain"] == service["metadata"]["name"] == "debug"
    env = _env(_pod_spec(jobset))
    assert env["MASTER_ADDR"] == "debug-node-0-0.debug" and env["MASTER_PORT"] == "29400"
    assert (env["NNODES"], env["NPROC_PER_NODE"], env["RDZV_ID"]) == ("4", "8", "debug")
    command = _pod_spec(jobset)["containers"][0]["command"][2]
    assert (
        "--rdzv-backend=c10d" in command
        and '--rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT"' in command
    )
    pytorchjob = _kind(_docs(nodes=4, k8s_kind="pytorchjob"), "PyTorchJob")
    replicas = pytorchjob["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 3)
    assert _env(_pod_spec(pytorchjob))["MASTER_ADDR"] == "debug-master-0.debug"
    assert _pod_spec(pytorchjob)["subdomain"] == "debug"


def test_restarts_map_to_each_layer():
    jobset = _kind(_docs(max_restarts=5), "JobSet")
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 5
    assert jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] == 0
    assert _env(_pod_spec(jobset))["MAX_RESTARTS"] == "5"  # torchrun, inside the pod
    pytorchjob = _kind(_docs(max_restarts=5, k8s_kind="pytorchjob"), "PyTorchJob")
    assert pytorchjob["spec"]["runPolicy"]["backoffLimit"] == 5
    assert pytorchjob["spec"]["pytorchReplicaSpecs"]["Master"]["restartPolicy"] == "OnFailure"


@pytest.mark.parametrize(
    ("net", "expected", "absent"),
    [
        ("ib-ndr", {"NCCL_IB_DISABLE": "0", "NCCL_IB_HCA": "mlx5"}, ("NCCL_IB_GID_INDEX",)),
        ("roce-200", {"NCCL_IB_DISABLE": "0", "NCCL_IB_GID_INDEX": "3"}, ()),
        ("eth-100", {"NCCL_IB_DISABLE": "1"}, ("NCCL_IB_HCA", "NCCL_IB_GID_INDEX")),
    ],
)
def test_nccl_env_follows_the_network(net, expected, absent):
    pod = _pod_spec(_kind(_docs(net=net), "JobSet"))
    env = _env(pod)
    assert expected.items() <= env.items()
    assert not set(absent) & set(env)
    assert env["NCCL_DEBUG"] == "WARN" and env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    limits = pod["containers"][0]["resources"]["limits"]
    assert ("rdma/ib" in limits) == (net != "eth-100")


def test_volcano_gang_scheduling():
    docs = _docs(nodes=4, gpus=8, gang="volcano")
    group = _kind(docs, "PodGroup")
    assert (
        group["spec"]["minMember"] == 4 and group["spec"]["minResources"]["nvidia.com/gpu"] == "32"
    )
    template = embedded(_kind(docs, "JobSet"))[0]["spec"]["template"]
    assert template["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "debug"
    assert template["spec"]["schedulerName"] == "volcano"
    assert all(d["kind"] != "PodGroup" for d in _docs())


def test_volumes_shm_config_and_runs():
    pod = _pod_spec(_kind(_docs(pvc="runs-pvc", shm_size="32Gi"), "JobSet"))
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert volumes["runs"]["persistentVolumeClaim"]["claimName"] == "runs-pvc"
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "config": "/etc/dstrain", "runs": "/workspace/runs"}
    assert (
        "emptyDir" in {v["name"]: v for v in _pod_spec(_kind(_docs(), "JobSet"))["volumes"]}["runs"]
    )


def test_the_config_map_holds_the_config_that_runs():
    docs = _docs(nodes=4)
    config = _kind(docs, "ConfigMap")["data"]["config.toml"]
    assert "nodes = 4" in config
    assert _env(_pod_spec(_kind(docs, "JobSet")))["DSTRAIN_CONFIG"] == "/etc/dstrain/config.toml"
