"""Triton's logging extension under ``orchestrion serve`` (``GET``/``POST /v2/logging``, gRPC
``LogSettings``), through Triton's own clients: the settings read and changed while the
server runs, a python-backend model's ``pb_utils.Logger`` following them at once (as
Triton's ``qa/L0_backend_python/logging`` counts its lines), and clear refusals of settings
that cannot be had."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from orchestrion.testing import Served
from support.served import start_server

REPOSITORY = Path(__file__).resolve().parents[1] / "python_backend_answers"
DEFAULTS = {
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 0,
    "log_format": "orchestrion",
}


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Served, Path]]:
    log = tmp_path / "server.log"
    served = start_server(
        f"--log-file={log}",
        "--load-model=logs",
        "--model-control-mode=explicit",
        repository=REPOSITORY,
    )
    yield served, log
    assert served.stop() == 0, served.text()


def _tagged(served: Served, tag: str) -> None:
    item = httpclient.InferInput("TAG", [1], "BYTES")
    item.set_data_from_numpy(np.array([tag.encode()], dtype=object))
    with httpclient.InferenceServerClient(served.http) as client:
        assert client.infer("logs", [item]).as_numpy("OUT")[0] == tag.encode()


def _lines(log: Path, tag: str) -> list[str]:
    """Which of the model's lines tagged ``tag`` the log holds."""
    kinds = ["specific", "info", "warning", "error", "verbose"]
    text = log.read_text()
    return [kind for kind in kinds if f"{tag} {kind} line" in text]


def test_settings_read_and_changed_over_http_reach_the_models_logger(
    served: tuple[Served, Path],
) -> None:
    """GET gives every setting; POST changes those named and gives them all; the model's
    ``pb_utils.Logger`` lines follow at once: verbose lines once ``log_verbose_level`` is
    1, none of a severity switched off."""
    server, log = served
    with httpclient.InferenceServerClient(server.http) as client:
        assert client.get_log_settings() == {"log_file": str(log), **DEFAULTS}
        _tagged(server, "first")
        assert _lines(log, "first") == ["specific", "info", "warning", "error"]
        after = client.update_log_settings({"log_verbose_level": 1})
        assert after == {"log_file": str(log), **DEFAULTS, "log_verbose_level": 1}
        _tagged(server, "second")
        assert _lines(log, "second") == ["specific", "info", "warning", "error", "verbose"]
        client.update_log_settings(
            {"log_info": False, "log_warning": False, "log_verbose_level": 0}
        )
        _tagged(server, "third")
        assert _lines(log, "third") == ["error"]
        client.update_log_settings({"log_error": False})
        _tagged(server, "fourth")
        assert _lines(log, "fourth") == []
        assert client.get_log_settings()["log_error"] is False


def test_settings_over_grpc_and_triton_line_layouts(served: tuple[Served, Path]) -> None:
    """gRPC's LogSettings reads and changes the same settings (bool, uint32 and string
    values); ``log_format`` switches the lines to Triton's layout and back."""
    server, log = served
    with grpcclient.InferenceServerClient(server.grpc) as client:
        settings = client.get_log_settings(as_json=True)["settings"]
        assert settings["log_verbose_level"] == {"uint32_param": 0}
        assert settings["log_format"] == {"string_param": "orchestrion"}
        client.update_log_settings({"log_format": "ISO8601", "log_verbose_level": 2})
        changed = client.get_log_settings(as_json=True)["settings"]
        assert changed["log_format"] == {"string_param": "ISO8601"}
        assert changed["log_verbose_level"] == {"uint32_param": 2}
        _tagged(server, "iso")
        line = next(row for row in log.read_text().splitlines() if "iso warning line" in row)
        assert line[20:22] == " W"  # 2026-12-05T05:00:00Z W <pid> model.py:...] "..."
        assert line.endswith('iso warning line"')
        client.update_log_settings({"log_format": "orchestrion"})
        _tagged(server, "own")
        line = next(row for row in log.read_text().splitlines() if "own warning line" in row)
        assert " WARNING orchestrion" in line


@pytest.mark.parametrize(
    ("change", "status", "message"),
    [
        (
            {"log_file": "/tmp/elsewhere.log"},
            501,
            "log file location can not be updated through network protocol",
        ),
        ({"log_info": 1}, 400, "log setting 'log_info' must be a boolean, got 1"),
        (
            {"log_verbose_level": -1},
            400,
            "log setting 'log_verbose_level' must be an integer >= 0, got -1",
        ),
        ({"log_format": "json"}, 400, "invalid argument for --log_format, got: json"),
        ({"log_verbosity": 1}, 400, "unknown log setting 'log_verbosity'"),
    ],
    ids=["file", "info-int", "verbose-negative", "format", "unknown"],
)
def test_settings_that_cannot_be_had_are_refused_and_nothing_changes(
    served: tuple[Served, Path], change: dict[str, Any], status: int, message: str
) -> None:
    """A refused change names the setting and changes nothing, not even the valid
    settings beside it in the same request."""
    server, log = served
    with httpclient.InferenceServerClient(server.http) as client:
        with pytest.raises(InferenceServerException) as raised:
            client.update_log_settings({"log_verbose_level": 3, **change})
        assert raised.value.status() == str(status)
        assert message in raised.value.message()
        assert client.get_log_settings() == {"log_file": str(log), **DEFAULTS}


def test_a_refusal_over_grpc_carries_its_status(served: tuple[Served, Path]) -> None:
    """gRPC: the log file cannot change (UNIMPLEMENTED, as Triton's UNSUPPORTED)."""
    server, _ = served
    with (
        grpcclient.InferenceServerClient(server.grpc) as client,
        pytest.raises(InferenceServerException) as raised,
    ):
        client.update_log_settings({"log_file": "/tmp/elsewhere.log"})
    assert raised.value.status() == "StatusCode.UNIMPLEMENTED"
