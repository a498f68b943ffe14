"""JSON schemas of the KServe resources deploy/kserve uses: the fields KServe documents for
``ClusterServingRuntime`` (serving.kserve.io/v1alpha1) and ``InferenceService``
(serving.kserve.io/v1beta1), their types, enums and required fields, as KServe's CRDs state
them. Only the fields orchestrion's manifests may use are listed, and nothing else is
allowed, so a misspelt field fails; containers, resources, probes and the rest of a pod are
Kubernetes' own types, checked against kubernetes-validate's schemas.

Written by hand from KServe's CRD definitions (no copy of them: the tests run offline), so
the list of fields is ours to extend when a manifest needs another one.
"""

from __future__ import annotations

from typing import Any

K8S = "https://kubernetes.io/api/_definitions.json#/$defs/io.k8s."


def _k8s(name: str) -> dict[str, Any]:
    return {"$ref": K8S + name}


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_INT32 = {"type": "integer", "minimum": -(2**31), "maximum": 2**31 - 1}

_METADATA = _k8s("apimachinery.pkg.apis.meta.v1.ObjectMeta")

SERVING_RUNTIME_SPEC = _object(
    {
        "annotations": _STRINGS,
        "labels": _STRINGS,
        "supportedModelFormats": {
            "type": "array",
            "items": _object(
                {
                    "name": {"type": "string"},
                    "version": {"type": "string"},
                    "autoSelect": {"type": "boolean"},
                    "priority": {**_INT32, "minimum": 1},
                },
                required=("name",),
            ),
        },
        "protocolVersions": {
            "type": "array",
            "items": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
        },
        "multiModel": {"type": "boolean"},
        "disabled": {"type": "boolean"},
        "grpcEndpoint": {"type": "string"},
        "grpcDataEndpoint": {"type": "string"},
        "httpDataEndpoint": {"type": "string"},
        "replicas": {**_INT32, "minimum": 0},
        "containers": {"type": "array", "items": _k8s("api.core.v1.Container"), "minItems": 1},
        "volumes": {"type": "array", "items": _k8s("api.core.v1.Volume")},
        "nodeSelector": _STRINGS,
        "tolerations": {"type": "array", "items": _k8s("api.core.v1.Toleration")},
        "affinity": _k8s("api.core.v1.Affinity"),
        "imagePullSecrets": {
            "type": "array",
            "items": _k8s("api.core.v1.LocalObjectReference"),
        },
        "hostIPC": {"type": "boolean"},
        "schedulerName": {"type": "string"},
    },
    required=("containers",),
)

CLUSTER_SERVING_RUNTIME = _object(
    {
        "apiVersion": {"const": "serving.kserve.io/v1alpha1"},
        "kind": {"const": "ClusterServingRuntime"},
        "metadata": _METADATA,
        "spec": SERVING_RUNTIME_SPEC,
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

_MODEL = _object(
    {
        "modelFormat": _object(
            {"name": {"type": "string"}, "version": {"type": "string"}}, required=("name",)
        ),
        "runtime": {"type": "string"},
        "runtimeVersion": {"type": "string"},
        "storageUri": {"type": "string"},
        "protocolVersion": {"enum": ["v1", "v2", "grpc-v1", "grpc-v2"]},
        # The rest of the model's fields are a container's (merged into the runtime's).
        "name": {"type": "string"},
        "image": {"type": "string"},
        "args": {"type": "array", "items": {"type": "string"}},
        "command": {"type": "array", "items": {"type": "string"}},
        "env": {"type": "array", "items": _k8s("api.core.v1.EnvVar")},
        "ports": {"type": "array", "items": _k8s("api.core.v1.ContainerPort")},
        "resources": _k8s("api.core.v1.ResourceRequirements"),
        "readinessProbe": _k8s("api.core.v1.Probe"),
        "livenessProbe": _k8s("api.core.v1.Probe"),
        "volumeMounts": {"type": "array", "items": _k8s("api.core.v1.VolumeMount")},
    }
)

INFERENCE_SERVICE = _object(
    {
        "apiVersion": {"const": "serving.kserve.io/v1beta1"},
        "kind": {"const": "InferenceService"},
        "metadata": _METADATA,
        "spec": _object(
            {
                "predictor": _object(
                    {
                        "model": _MODEL,
                        "minReplicas": {**_INT32, "minimum": 0},
                        "maxReplicas": {**_INT32, "minimum": 0},
                        "scaleMetric": {"enum": ["cpu", "memory", "concurrency", "rps"]},
                        "scaleTarget": _INT32,
                        "containerConcurrency": {"type": "integer", "minimum": 0},
                        "timeout": {"type": "integer", "minimum": 0},
                        "canaryTrafficPercent": {"type": "integer", "minimum": 0, "maximum": 100},
                        "serviceAccountName": {"type": "string"},
                        "nodeSelector": _STRINGS,
                        "tolerations": {"type": "array", "items": _k8s("api.core.v1.Toleration")},
                        "volumes": {"type": "array", "items": _k8s("api.core.v1.Volume")},
                        "annotations": _STRINGS,
                        "labels": _STRINGS,
                    }
                )
            },
            required=("predictor",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

SCHEMAS = {
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): CLUSTER_SERVING_RUNTIME,
    ("serving.kserve.io/v1beta1", "InferenceService"): INFERENCE_SERVICE,
}
"""By (apiVersion, kind)."""
