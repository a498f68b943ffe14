"""orchestrion: Triton-style ensembles of JAX models, served from inside a Python process.

Open a server with `open_server` (trio) or `Server` (blocking), then call ``infer``.

The names below are imported on first use (PEP 562), so that ``import orchestrion.protocols``
(the pure core) does not pull in trio or JAX.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._blocking import Server as Server
    from ._options import ServerOptions as ServerOptions
    from ._server import AsyncServer as AsyncServer
    from ._server import open_server as open_server
    from .actors import Model as Model
    from .caches import ResponseCache as ResponseCache
    from .protocols import CacheStatistics as CacheStatistics
    from .protocols import CacheUnavailableError as CacheUnavailableError
    from .protocols import CacheWriteRefusedError as CacheWriteRefusedError
    from .protocols import ConfigError as ConfigError
    from .protocols import DataType as DataType
    from .protocols import DeclaredTensor as DeclaredTensor
    from .protocols import EnsembleControl as EnsembleControl
    from .protocols import EnsembleLoop as EnsembleLoop
    from .protocols import EnsembleScheduling as EnsembleScheduling
    from .protocols import EnsembleStep as EnsembleStep
    from .protocols import Function as Function
    from .protocols import InferenceError as InferenceError
    from .protocols import InferenceTimeoutError as InferenceTimeoutError
    from .protocols import InferRequest as InferRequest
    from .protocols import InferResponse as InferResponse
    from .protocols import InstanceGroup as InstanceGroup
    from .protocols import InstanceKind as InstanceKind
    from .protocols import InvalidRequestError as InvalidRequestError
    from .protocols import ModelConfig as ModelConfig
    from .protocols import ModelControlError as ModelControlError
    from .protocols import ModelLoadError as ModelLoadError
    from .protocols import ModelNotFoundError as ModelNotFoundError
    from .protocols import ModelReportedError as ModelReportedError
    from .protocols import ModelStatistics as ModelStatistics
    from .protocols import Observer as Observer
    from .protocols import OnnxGraph as OnnxGraph
    from .protocols import OrchestrionError as OrchestrionError
    from .protocols import QueueFullError as QueueFullError
    from .protocols import QueueTimeoutError as QueueTimeoutError
    from .protocols import RequestOptions as RequestOptions
    from .protocols import ServerClosedError as ServerClosedError
    from .protocols import StepControl as StepControl
    from .protocols import StepRefusedError as StepRefusedError
    from .protocols import StepStatistics as StepStatistics
    from .protocols import TensorConfig as TensorConfig
    from .protocols import TritonClass as TritonClass
    from .tuning import tune as tune

__version__ = "0.1.0.dev0"

_WHERE = {
    "Server": "._blocking",
    "ServerOptions": "._options",
    "AsyncServer": "._server",
    "open_server": "._server",
    "Model": ".actors",
    "ResponseCache": ".caches",
    "tune": ".tuning",
    **{
        name: ".protocols"
        for name in (
            "CacheStatistics",
            "CacheUnavailableError",
            "CacheWriteRefusedError",
            "ConfigError",
            "DataType",
            "DeclaredTensor",
            "EnsembleControl",
            "EnsembleLoop",
            "EnsembleScheduling",
            "EnsembleStep",
            "Function",
            "InferenceError",
            "InferenceTimeoutError",
            "InferRequest",
            "InferResponse",
            "InstanceGroup",
            "InstanceKind",
            "InvalidRequestError",
            "ModelConfig",
            "ModelControlError",
            "ModelLoadError",
            "ModelNotFoundError",
            "ModelReportedError",
            "ModelStatistics",
            "Observer",
            "OnnxGraph",
            "OrchestrionError",
            "QueueFullError",
            "QueueTimeoutError",
            "RequestOptions",
            "ServerClosedError",
            "StepControl",
            "StepRefusedError",
            "StepStatistics",
            "TensorConfig",
            "TritonClass",
        )
    },
}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module 'orchestrion' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
