"""The public surface: the names the top-level package exports, whose fault each error says,
subpackages that install under ``orchestrion`` only, and `orchestrion.testing`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import orchestrion


def test_public_names() -> None:
    """The top-level package exports exactly the documented API."""
    assert orchestrion.__all__ == sorted(
        [
            "AsyncServer",
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
            "InferRequest",
            "InferResponse",
            "InferenceError",
            "InferenceTimeoutError",
            "InstanceGroup",
            "InstanceKind",
            "InvalidRequestError",
            "Model",
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
            "ResponseCache",
            "Server",
            "ServerClosedError",
            "ServerOptions",
            "StepControl",
            "StepRefusedError",
            "StepStatistics",
            "TensorConfig",
            "TritonClass",
            "open_server",
            "tune",
        ]
    )
    for name in orchestrion.__all__:
        assert getattr(orchestrion, name).__doc__, name
    with pytest.raises(AttributeError):
        orchestrion.nothing_here  # noqa: B018


def test_errors_say_whose_fault() -> None:
    """Caller mistakes are ValueErrors/LookupErrors, pipeline failures RuntimeErrors."""
    assert issubclass(orchestrion.InvalidRequestError, ValueError)
    assert issubclass(orchestrion.ModelNotFoundError, LookupError)
    assert issubclass(orchestrion.ConfigError, ValueError)
    assert issubclass(orchestrion.InferenceError, RuntimeError)
    assert issubclass(orchestrion.InferenceTimeoutError, TimeoutError)
    for name in orchestrion.__all__:
        value = getattr(orchestrion, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, orchestrion.OrchestrionError)


def test_subpackages_install_under_orchestrion_only(tmp_path: Path) -> None:
    """actors/, caches/... are importable as orchestrion.* and never as top-level modules."""
    code = (
        "import importlib.util, orchestrion.actors, orchestrion.caches, orchestrion.telemetry\n"
        "print([n for n in ('actors', 'caches', 'protocols', 'telemetry') "
        "if importlib.util.find_spec(n) is not None])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == "[]"


def test_the_testing_helpers_are_documented_and_need_no_pytest() -> None:
    """`orchestrion.testing` (what the tests and bench/ share) documents each public name and
    imports without pytest, as ``trio.testing`` does."""
    code = (
        "import sys, orchestrion.testing as t\n"
        "print('pytest' in sys.modules, "
        "[n for n in dir(t) if not n.startswith('_') and not getattr(t, n).__doc__])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "False []"


def test_triton_python_backend_utils_is_the_one_other_top_level_module(tmp_path: Path) -> None:
    """``import triton_python_backend_utils`` works from anywhere (Triton's models import
    it), is the same objects as ``orchestrion.backends``' and offers Triton's names."""
    code = (
        "import triton_python_backend_utils as pb, orchestrion.backends._triton_api as api\n"
        "assert pb.Tensor is api.Tensor\n"
        "names = ['Tensor', 'InferenceRequest', 'InferenceResponse', 'InferenceResponseSender',\n"
        "  'TritonError', 'TritonModelException', 'ModelConfig', 'Logger', 'MetricFamily',\n"
        "  'get_input_tensor_by_name', 'get_output_tensor_by_name', 'get_input_config_by_name',\n"
        "  'get_output_config_by_name', 'triton_string_to_numpy', 'numpy_to_triton_type',\n"
        "  'using_decoupled_model_transaction_policy', 'serialize_byte_tensor',\n"
        "  'deserialize_bytes_tensor', 'TRITONSERVER_RESPONSE_COMPLETE_FINAL',\n"
        "  'TRITONSERVER_REQUEST_FLAG_SEQUENCE_START', 'TRITONSERVER_REQUEST_FLAG_SEQUENCE_END',\n"
        "  'is_model_ready', 'load_model', 'unload_model']\n"
        "print([n for n in names if not hasattr(pb, n)])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert result.stdout.strip() == "[]"
