"""Our own JSON schemas of the custom resources deploy emits (JobSet, PyTorchJob, Volcano
PodGroup), written from the documented API field names and types of jobset.x-k8s.io/v1alpha2,
kubeflow.org/v1 and scheduling.volcano.sh/v1beta1. They cover the fields we emit, closed
(`additionalProperties: false`) where we know the full field set, so a misspelt or misplaced
field fails. The embedded pod and job templates are checked against the real Kubernetes
OpenAPI schemas (test_deploy_k8s.py)."""

from typing import Any

import jsonschema
import pytest

_INT = {"type": "integer", "minimum": 0}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "namespace": {"type": "string"},
        "labels": _STR_MAP,
        "annotations": _STR_MAP,
    },
    "additionalProperties": False,
}
_OBJ = {"type": "object"}  # a k8s type validated elsewhere against the OpenAPI schema


def _top(api: str, kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": api},
            "kind": {"const": kind},
            "metadata": _META,
            "spec": spec,
        },
        "additionalProperties": False,
    }


def _closed(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


JOBSET = _top(
    "jobset.x-k8s.io/v1alpha2",
    "JobSet",
    _closed(
        {
            "replicatedJobs": {
                "type": "array",
                "minItems": 1,
                "items": _closed(
                    {
                        "name": {"type": "string"},
                        "replicas": {"type": "integer", "minimum": 1},
                        "dependsOn": {"type": "array"},
                        "template": _closed({"metadata": _OBJ, "spec": _OBJ}, ("spec",)),
                    },
                    ("name", "template"),
                ),
            },
            "network": _closed(
                {
                    "enableDNSHostnames": {"type": "boolean"},
                    "subdomain": {"type": "string"},
                    "publishNotReadyAddresses": {"type": "boolean"},
                }
            ),
            "successPolicy": _closed(
                {
                    "operator": {"enum": ["All", "Any"]},
                    "targetReplicatedJobs": {"type": "array", "items": {"type": "string"}},
                },
                ("operator",),
            ),
            "failurePolicy": _closed(
                {
                    "maxRestarts": _INT,
                    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                    "rules": {"type": "array"},
                }
            ),
            "startupPolicy": _OBJ,
            "suspend": {"type": "boolean"},
            "coordinator": _OBJ,
            "managedBy": {"type": "string"},
            "ttlSecondsAfterFinished": _INT,
        },
        ("replicatedJobs",),
    ),
)

_REPLICA = _closed(
    {
        "replicas": _INT,
        "restartPolicy": {"enum": ["Always", "OnFailure", "Never", "ExitCode"]},
        "template": _OBJ,
    },
    ("template",),
)
PYTORCHJOB = _top(
    "kubeflow.org/v1",
    "PyTorchJob",
    _closed(
        {
            "pytorchReplicaSpecs": {
                "type": "object",
                "propertyNames": {"enum": ["Master", "Worker"]},
                "additionalProperties": _REPLICA,
                "required": ["Master"],
            },
            "runPolicy": _closed(
                {
                    "backoffLimit": _INT,
                    "cleanPodPolicy": {"enum": ["All", "Running", "None"]},
                    "activeDeadlineSeconds": _INT,
                    "ttlSecondsAfterFinished": _INT,
                    "schedulingPolicy": _OBJ,
                    "suspend": {"type": "boolean"},
                    "managedBy": {"type": "string"},
                }
            ),
            "elasticPolicy": _OBJ,
            # A string: "auto", "cpu", "gpu" or a count.
            "nprocPerNode": {"type": "string", "pattern": "^(auto|cpu|gpu|[0-9]+)$"},
        },
        ("pytorchReplicaSpecs", "runPolicy"),
    ),
)

_QUANTITY = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([KMGTPE]i?|m)?$"}
PODGROUP = _top(
    "scheduling.volcano.sh/v1beta1",
    "PodGroup",
    _closed(
        {
            "minMember": {"type": "integer", "minimum": 1},
            "minTaskMember": {"type": "object", "additionalProperties": {"type": "integer"}},
            "minResources": {"type": "object", "additionalProperties": _QUANTITY},
            "queue": {"type": "string"},
            "priorityClassName": {"type": "string"},
        },
        ("minMember",),
    ),
)

SCHEMAS = {"JobSet": JOBSET, "PyTorchJob": PYTORCHJOB, "PodGroup": PODGROUP}


def validate_crd(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, SCHEMAS[doc["kind"]])


@pytest.mark.parametrize("schema", SCHEMAS.values(), ids=SCHEMAS.keys())
def test_our_schemas_are_valid_json_schemas(schema):
    jsonschema.Draft202012Validator.check_schema(schema)
