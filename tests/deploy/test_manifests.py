"""deploy/: the Kubernetes manifests validate against Kubernetes' own schemas
(kubernetes-validate, strict: no unknown field), the KServe resources against the fields
KServe documents, and every container runs the same ``orchestrion serve`` the tests run,
with flags its parser takes and probes on Triton's health endpoints at its HTTP port."""

from __future__ import annotations

import argparse
import copy
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import referencing
import yaml
from rich.console import Console

from orchestrion.frontends._cli import _parser
from orchestrion.frontends._cli_flags import serve_settings
from support.kserve_schema import SCHEMAS

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")
"""The oldest Kubernetes the manifests are for (sleep-free preStop, autoscaling/v2,
policy/v1), and the newest kubernetes-validate knows."""
HEALTH = {"/v2/health/live", "/v2/health/ready"}


def documents(folder: str) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((DEPLOY / folder).glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                found.append((f"{path.name}: {doc['kind']} {doc['metadata']['name']}", doc))
    return found


def serve_args(args: list[str]) -> argparse.Namespace:
    """``orchestrion serve``'s own parser and flag checks on a container's arguments."""
    parsed = _parser().parse_args(["serve", *args])
    serve_settings(parsed, Console(quiet=True))  # cache flags and contradictions
    return parsed


def repositories(args: argparse.Namespace) -> list[str]:
    given = args.model_repository
    return [str(p) for p in (given if isinstance(given, list) else [given])]


def check_probes(container: dict[str, Any], http_port: int) -> None:
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    probes = [
        container[k] for k in ("startupProbe", "livenessProbe", "readinessProbe") if k in container
    ]
    assert {"livenessProbe", "readinessProbe"} <= set(container)
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    for probe in probes:
        port = probe["httpGet"]["port"]
        assert probe["httpGet"]["path"] in HEALTH
        assert named.get(port, port) == http_port


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_kubernetes_manifests_validate(version: str) -> None:
    """Deployment, Service, HorizontalPodAutoscaler, PodDisruptionBudget and the Redis
    validate strictly against that Kubernetes version's schemas."""
    docs = documents("kubernetes")
    kinds = sorted({doc["kind"] for _, doc in docs})
    assert kinds == [
        "Deployment",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
        "Service",
        "StatefulSet",
    ]
    for where, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where}: {exc.message} at {list(exc.path)}")


def _kserve_validator(schema: dict[str, Any]) -> jsonschema.Draft202012Validator:
    folder = resources.files(kubernetes_validate) / "kubernetes-json-schema"
    definitions = json.loads(
        (folder / f"v{KUBERNETES_VERSIONS[0]}-local-strict" / "_definitions.json").read_text()
    )
    registry = referencing.Resource.from_contents(definitions) @ referencing.Registry()
    return jsonschema.Draft202012Validator(schema, registry=registry)


def kserve_errors(doc: dict[str, Any]) -> list[str]:
    schema = SCHEMAS[(doc["apiVersion"], doc["kind"])]
    errors = _kserve_validator(schema).iter_errors(doc)
    return [f"{e.message} at {list(e.absolute_path)}" for e in errors]


def test_kserve_resources_validate() -> None:
    """The ClusterServingRuntime and the InferenceService hold only fields KServe documents,
    of the right types, with Kubernetes' own types for containers and resources."""
    docs = documents("kserve")
    assert sorted(doc["kind"] for _, doc in docs) == ["ClusterServingRuntime", "InferenceService"]
    for where, doc in docs:
        assert kserve_errors(doc) == [], where


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d["spec"].update(protocolVersion=["v2"]), "Additional properties"),
        (lambda d: d["spec"]["containers"][0].update(args="--x"), "is not of type 'array'"),
        (lambda d: d["spec"]["containers"][0].update(imagePullPolicy=1), "is not of type"),
        (lambda d: d["spec"]["protocolVersions"].append("v3"), "is not one of"),
        (lambda d: d["spec"].pop("containers"), "'containers' is a required property"),
        (lambda d: d["spec"]["supportedModelFormats"][0].pop("name"), "'name' is a required"),
    ],
)
def test_the_kserve_schema_refuses_what_kserve_would(change: Any, words: str) -> None:
    """A misspelt field, a wrong type or enum, or a missing required field is an error."""
    (_, runtime), *_ = [d for d in documents("kserve") if d[1]["kind"] == "ClusterServingRuntime"]
    broken = copy.deepcopy(runtime)
    change(broken)
    errors = kserve_errors(broken)
    assert any(words in e for e in errors), errors


def test_the_deployment_runs_orchestrion_serve_with_its_probes_on_the_http_port() -> None:
    """The Deployment's flags parse as ``orchestrion serve``'s, bind every interface, use
    the shared Redis; its probes are Triton's health endpoints on the HTTP port."""
    docs = dict(documents("kubernetes"))
    deployment = docs["orchestrion.yaml: Deployment orchestrion"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "command" not in container  # the image's entry point: orchestrion serve
    args = serve_args(container["args"])
    assert args.host == "0.0.0.0"
    assert args.cache_config == ["redis,host=orchestrion-redis", "redis,port=6379"]
    check_probes(container, args.http_port)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.exit_timeout_secs + 5  # the preStop pause, then the drain
    redis_service = docs["redis.yaml: Service orchestrion-redis"]
    assert redis_service["spec"]["ports"][0]["port"] == 6379


def test_the_kserve_runtime_serves_what_kserve_mounts_where_it_sends() -> None:
    """The runtime reads /mnt/models, serves HTTP on 8080 and gRPC on 9000 (KServe's
    ports), probes Triton's endpoints; the InferenceService's args append valid flags."""
    docs = {doc["kind"]: doc for _, doc in documents("kserve")}
    (container,) = docs["ClusterServingRuntime"]["spec"]["containers"]
    assert container["name"] == "kserve-container"
    model = docs["InferenceService"]["spec"]["predictor"]["model"]
    assert model["runtime"] == docs["ClusterServingRuntime"]["metadata"]["name"]
    assert model["modelFormat"]["name"] in {
        f["name"] for f in docs["ClusterServingRuntime"]["spec"]["supportedModelFormats"]
    }
    args = serve_args([*container["args"], *model["args"]])
    assert (repositories(args), args.host) == (["/mnt/models"], "0.0.0.0")
    assert (args.http_port, args.grpc_port) == (8080, 9000)
    assert container["ports"][0]["containerPort"] == 8080
    check_probes(container, args.http_port)


def _instruction(dockerfile: str, name: str) -> list[str]:
    (line,) = re.findall(rf"^{name} (.+)$", dockerfile, flags=re.MULTILINE)
    value = json.loads(line)  # the exec form: no shell between the signal and the server
    assert isinstance(value, list)
    return [str(v) for v in value]


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cuda"])
def test_images_enter_orchestrion_serve(name: str) -> None:
    """Both images' entry point is ``orchestrion serve`` in exec form (SIGTERM reaches it),
    with default flags it takes, on every interface, with Triton's ports exposed."""
    dockerfile = (DEPLOY / "container" / name).read_text()
    assert _instruction(dockerfile, "ENTRYPOINT") == ["orchestrion", "serve"]
    args = serve_args(_instruction(dockerfile, "CMD"))
    assert (repositories(args), args.host) == (["/models"], "0.0.0.0")
    assert re.search(r"^EXPOSE 8000 8001 8002$", dockerfile, flags=re.MULTILINE)
    assert re.search(r"^USER 1000$", dockerfile, flags=re.MULTILINE)
    # The base users get is the official Python image (the tests build on a stand-in).
    assert re.search(
        r"^ARG PYTHON_IMAGE=python:3\.11-slim-bookworm$", dockerfile, flags=re.MULTILINE
    )
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}$", dockerfile, flags=re.MULTILINE)
    # orchestrion[cuda] (JAX with its CUDA plugin) in the CUDA image only; ONNX Runtime in both.
    extras = re.search(r"^ARG EXTRAS=(.*)$", dockerfile, flags=re.MULTILINE)
    assert extras is not None
    assert set(extras.group(1).split(",")) == (
        {"cuda", "onnx"} if name.endswith(".cuda") else {"onnx"}
    )
