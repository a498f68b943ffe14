"""Triton's restricted APIs: ``--http-restricted-api`` and ``--grpc-restricted-protocol``
make a group of endpoints answer only requests that carry a given header with a given value
(a shared secret for the model repository endpoints, say, while inference stays open).

How this works: each endpoint belongs to one category (`CATEGORIES`); a flag's value
``<categories>:<key>=<value>`` restricts those categories to requests whose header ``key``
(HTTP; gRPC: metadata ``triton-grpc-protocol-<key>``) equals ``value``. A request without it
is refused before anything else is read: HTTP 403, gRPC UNAVAILABLE, in Triton's words.
Values are compared in constant time. The header travels in clear text: use it behind TLS
or on a trusted network, as Triton's.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Mapping, Sequence

import attrs

from ..protocols import ConfigError

CATEGORIES = (
    "health",
    "metadata",
    "inference",
    "shared-memory",
    "model-config",
    "model-repository",
    "statistics",
    "trace",
    "logging",
)
"""The endpoint groups a restriction names (Triton's)."""

GRPC_HEADER_PREFIX = "triton-grpc-protocol-"
"""gRPC's restriction headers are the flag's key after this prefix (Triton's)."""

GRPC_METHODS = {
    "ServerLive": "health",
    "ServerReady": "health",
    "ModelReady": "health",
    "ServerMetadata": "metadata",
    "ModelMetadata": "metadata",
    "ModelInfer": "inference",
    "ModelStreamInfer": "inference",
    "ModelConfig": "model-config",
    "ModelStatistics": "statistics",
    "RepositoryIndex": "model-repository",
    "RepositoryModelLoad": "model-repository",
    "RepositoryModelUnload": "model-repository",
    "SystemSharedMemoryStatus": "shared-memory",
    "SystemSharedMemoryRegister": "shared-memory",
    "SystemSharedMemoryUnregister": "shared-memory",
    "CudaSharedMemoryStatus": "shared-memory",
    "CudaSharedMemoryRegister": "shared-memory",
    "CudaSharedMemoryUnregister": "shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}
"""The category of each ``GRPCInferenceService`` method."""


@attrs.frozen
class Restrictions:
    """Which categories need which header (name lower-cased) and value; ``kind`` is how
    refusals call an endpoint (``API`` over HTTP, ``protocol`` over gRPC, as Triton)."""

    rules: Mapping[str, tuple[str, str]] = attrs.field(factory=dict)
    kind: str = "API"

    @classmethod
    def parse(cls, values: Sequence[str], *, flag: str, prefix: str = "") -> Restrictions:
        """Restrictions from flag values ``<categories>:<key>=<value>`` (``prefix`` goes
        before each key: gRPC's `GRPC_HEADER_PREFIX`).

        Raises:
            ConfigError: a malformed value, an unknown category, or a category restricted
                twice (Triton's words, the flag named).
        """
        kind = "protocol" if prefix else "api"
        rules: dict[str, tuple[str, str]] = {}
        for value in values:
            names, colon, setting = value.partition(":")
            key, equals, expected = setting.partition("=")
            if not (colon and equals and names and key and expected):
                raise ConfigError(
                    f"--{flag} option format is '<{kind}s>:<key>=<value>'. Got {value}"
                )
            for name in names.split(","):
                if name not in CATEGORIES:
                    raise ConfigError(
                        f"--{flag}: unknown restricted {kind} '{name}' (known: "
                        f"{', '.join(CATEGORIES)})"
                    )
                if name in rules:
                    raise ConfigError(
                        f"--{flag}: restricted {kind} '{name}' can not be specified in "
                        "multiple config groups"
                    )
                rules[name] = ((prefix + key).lower(), expected)
        return cls(rules, "protocol" if prefix else "API")

    def refusal(self, category: str, header: Callable[[str], str | None]) -> str | None:
        """Why a request of ``category`` is refused (``header(name)``: the value of one of
        its headers, by lower-case name, or None); None when it may go on."""
        rule = self.rules.get(category)
        if rule is None:
            return None
        name, expected = rule
        given = header(name)
        if given is not None and hmac.compare_digest(given.encode(), expected.encode()):
            return None
        return f"This {self.kind} is restricted, expecting header '{name}'"
