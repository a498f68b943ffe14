"""`orchestrion serve` with `tritonserver`'s flags: a Triton launch line starts, the flags
that cannot apply are ignored with one warning, and the others do what they do in Triton
(2.51, run with the same flags on a repository of the same shape): ``--exit-on-error=false``
serves what loaded and lists the rest UNAVAILABLE with the reason, not ready under strict
readiness; ``--disable-auto-complete-config`` (and the deprecated ``--strict-model-config``)
needs every config complete; the log flags choose severities, Triton's line layouts and a
file. Real servers in child processes, real tritonclient clients."""

from __future__ import annotations

import io
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from rich.console import Console
from tritonclient.utils import InferenceServerException

from orchestrion.frontends._cli import _parser
from orchestrion.frontends._cli import main as cli
from orchestrion.frontends._cli_flags import serve_settings
from orchestrion.frontends._logging import LogFormat
from orchestrion.testing import Served, serve_command
from support.served import start_server

_TENSORS = """
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
_ECHO = """
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        return [
            pb_utils.InferenceResponse(
                [pb_utils.Tensor("OUTPUT0", pb_utils.get_input_tensor_by_name(r, "INPUT0").as_numpy())]
            )
            for r in requests
        ]
"""
_BROKEN = """
class TritonPythonModel:
    def initialize(self, args):
        raise RuntimeError("this model cannot start")

    def execute(self, requests):
        return []
"""
_COMPLETES = """
    @staticmethod
    def auto_complete_config(config):
        config.set_max_batch_size(4)
        config.add_input({"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        config.add_output({"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [4]})
        return config
"""
_LOGS = """
    def initialize(self, args):
        pb_utils.Logger.log_info("an info line")
        pb_utils.Logger.log_warn("a warning line")
        pb_utils.Logger.log_error("an error line")
"""
_ENSEMBLE = """
platform: "ensemble"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
ensemble_scheduling { step [ { model_name: "%s" input_map { key: "INPUT0" value: "IN" }
  output_map { key: "OUTPUT0" value: "OUT" } } ] }
"""
LAUNCH_LINE = [
    "--backend-directory=/opt/tritonserver/backends",
    "--backend-config=python,shm-default-byte-size=1048576",
    "--exit-on-error=false",
    "--strict-model-config=false",
    "--log-verbose=1",
    "--log-format=ISO8601",
    "--model-load-thread-count=4",
    "--id=triton-1",
]
"""A Triton launch line (less the ports and the repository: start_server gives those)."""
ISO8601_LINE = re.compile(r'^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ [IWE] \d+ [\w.]+:\d+\] "')
DEFAULT_LINE = re.compile(r'^[IWE]\d{4} \d\d:\d\d:\d\d\.\d{6} \d+ [\w.]+:\d+\] "')


def _model(root: Path, name: str, code: str | None, config: str | None) -> None:
    (root / name / "1").mkdir(parents=True)
    if code is not None:
        (root / name / "1" / "model.py").write_text(code)
    if config is not None:
        (root / name / "config.pbtxt").write_text(f'name: "{name}"\n{config}')


def repository(root: Path, *, broken: bool = True) -> Path:
    """good (echo), logs (echo; logs a line at each level in initialize), noconfig (no
    config.pbtxt: its auto_complete_config makes one), completes (its auto_complete_config
    sets max_batch_size 4), ens_good over good; with ``broken``: broken (initialize raises)
    and ens_broken over it."""
    python = f'backend: "python"\n{_TENSORS}'
    _model(root, "good", _ECHO, python)
    _model(root, "logs", _ECHO + _LOGS, python)
    _model(root, "noconfig", _ECHO + _COMPLETES, None)
    _model(root, "completes", _ECHO + _COMPLETES, python)
    _model(root, "ens_good", None, _ENSEMBLE % "good")
    if broken:
        _model(root, "broken", _BROKEN, python)
        _model(root, "ens_broken", None, _ENSEMBLE % "broken")
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return repository(tmp_path_factory.mktemp("flags") / "models")


@pytest.fixture(scope="module")
def launched(models: Path) -> Iterator[Served]:
    """The Triton launch line, as it is, on the repository with its broken models."""
    served = start_server(*LAUNCH_LINE, repository=models)
    yield served
    assert served.stop() == 0, served.text()


def _echo(client: Any, module: Any, model: str, name: str = "INPUT0") -> list[float]:
    data = np.arange(4, dtype=np.float32)
    inputs = [module.InferInput(name, [4], "FP32")]
    inputs[0].set_data_from_numpy(data)
    result = client.infer(model, inputs)
    out = result.as_numpy("OUTPUT0" if name == "INPUT0" else "OUT")
    return [float(x) for x in out]


def _index(served: Served) -> dict[str, dict[str, str]]:
    client = httpclient.InferenceServerClient(served.http)
    try:
        return {m["name"]: m for m in client.get_model_repository_index()}
    finally:
        client.close()


def test_a_triton_launch_line_starts_and_warns_once(launched: Served) -> None:
    """The launch line starts; one warning names the flags ignored, one says that
    --strict-model-config is deprecated (as Triton's own does)."""
    warnings = [line for line in launched.output if line.startswith("warning: ignoring")]
    assert warnings == [
        "warning: ignoring tritonserver flags that do not apply to orchestrion: "
        "--backend-config, --model-load-thread-count"
    ]
    assert sum("--strict-model-config is deprecated" in line for line in launched.output) == 1


def test_the_id_is_the_servers_name_in_its_metadata(launched: Served) -> None:
    """--id names the server in its metadata over HTTP and gRPC, as in Triton (whose own
    clients check it)."""
    http = httpclient.InferenceServerClient(launched.http)
    grpc = grpcclient.InferenceServerClient(launched.grpc)
    try:
        assert http.get_server_metadata()["name"] == "triton-1"
        assert grpc.get_server_metadata().name == "triton-1"
    finally:
        http.close()
        grpc.close()


def test_exit_on_error_false_serves_what_loaded(launched: Served, models: Path) -> None:
    """good, its ensemble and the config-less model serve over HTTP and gRPC; the index
    lists broken and ens_broken UNAVAILABLE with the reason."""
    http = httpclient.InferenceServerClient(launched.http)
    grpc = grpcclient.InferenceServerClient(launched.grpc)
    try:
        assert _echo(http, httpclient, "good") == [0.0, 1.0, 2.0, 3.0]
        assert _echo(grpc, grpcclient, "ens_good", "IN") == [0.0, 1.0, 2.0, 3.0]
        assert _echo(grpc, grpcclient, "good") == [0.0, 1.0, 2.0, 3.0]
        assert grpc.is_model_ready("noconfig")
        assert http.is_model_ready("good")
        assert not http.is_model_ready("broken")
        assert not grpc.is_model_ready("ens_broken")
        by_grpc = {m.name: m for m in grpc.get_model_repository_index().models}
    finally:
        http.close()
        grpc.close()
    index = _index(launched)
    for name in ("good", "ens_good", "noconfig", "completes", "logs"):
        assert index[name]["state"] == "READY", index[name]
    for name in ("broken", "ens_broken"):
        assert index[name]["state"] == "UNAVAILABLE"
        assert "initialize failed: RuntimeError: this model cannot start" in index[name]["reason"]
        assert "broken/1/model.py" in index[name]["reason"]
        assert str(models) not in index[name]["reason"]  # paths relative to it
        assert by_grpc[name].state == "UNAVAILABLE"
        assert by_grpc[name].reason == index[name]["reason"]


def test_a_failed_model_keeps_strict_readiness_false(launched: Served) -> None:
    """Live, but not ready while a model failed (--strict-readiness defaults to true)."""
    http = httpclient.InferenceServerClient(launched.http)
    try:
        assert http.is_server_live()
        assert not http.is_server_ready()
    finally:
        http.close()


def test_iso8601_log_lines(launched: Served) -> None:
    """--log-format=ISO8601: each log line opens with Triton's ISO 8601 prefix; the load
    failures are E lines, the model's own log lines are there, verbose ones too."""
    lines = [line for line in launched.output if ISO8601_LINE.match(line)]
    assert any(" E " in line and "failed to load model 'broken'" in line for line in lines)
    for text in ("an info line", "a warning line", "an error line"):
        assert any(text in line for line in lines), text
    severities = {line.split(" ")[1] for line in lines}
    assert severities == {"I", "W", "E"}


def test_auto_complete_is_on_with_strict_model_config_false(launched: Served) -> None:
    """--strict-model-config=false: completes' auto_complete_config sets max_batch_size."""
    http = httpclient.InferenceServerClient(launched.http)
    try:
        assert http.get_model_config("completes")["max_batch_size"] == 4
    finally:
        http.close()


def test_disabled_auto_complete_and_the_other_log_flags(models: Path, tmp_path: Path) -> None:
    """--disable-auto-complete-config: noconfig is UNAVAILABLE (its config.pbtxt is
    missing) and completes keeps max_batch_size 0; --strict-readiness=false: ready anyway;
    gRPC keepalive flags taken;
    --log-file takes the log (only E lines, --log-info and --log-warning being false) in
    Triton's default layout, and standard output keeps only the start-up lines."""
    log = tmp_path / "server.log"
    served = start_server(
        "--exit-on-error",  # bare: true
        "--exit-on-error",
        "0",
        "--disable-auto-complete-config",
        "--strict-readiness=false",
        "--log-info=off",
        "--log-warning",
        "FALSE",
        "--log-format=default",
        f"--log-file={log}",
        "--grpc-keepalive-time=10000",
        "--grpc-keepalive-permit-without-calls",
        "--grpc-max-connection-age=600000",
        repository=models,
    )
    try:
        index = _index(served)
        assert index["noconfig"]["state"] == "UNAVAILABLE"
        assert (
            "noconfig/config.pbtxt: missing (auto-complete is disabled"
            in (index["noconfig"]["reason"])
        )
        assert index["good"]["state"] == "READY"
        grpc = grpcclient.InferenceServerClient(served.grpc)
        try:  # the keepalive flags are grpcio's options: gRPC serves as before
            assert _echo(grpc, grpcclient, "good") == [0.0, 1.0, 2.0, 3.0]
        finally:
            grpc.close()
        http = httpclient.InferenceServerClient(served.http)
        try:
            assert http.is_server_ready()
            assert http.get_model_config("completes").get("max_batch_size", 0) == 0
        finally:
            http.close()
    finally:
        assert served.stop() == 0, served.text()
    lines = log.read_text().splitlines()
    assert lines
    assert all(DEFAULT_LINE.match(line) and line.startswith("E") for line in lines), lines
    assert any("an error line" in line for line in lines)
    assert any("failed to load model 'noconfig'" in line for line in lines)
    assert not any(DEFAULT_LINE.match(line) for line in served.output), served.text()
    assert any(line.startswith("Started HTTPService at") for line in served.output)


def test_a_failed_load_later_is_listed_with_its_reason(models: Path) -> None:
    """Explicit mode, --exit-on-error=false: --load-model broken is left out at start; a
    load request for it fails and the index keeps its reason; good then loads."""
    served = start_server(
        "--model-control-mode=explicit",
        "--load-model=broken",
        "--load-model=ens_good",
        "--exit-on-error=false",
        repository=models,
    )
    try:
        index = _index(served)
        assert index["broken"]["state"] == "UNAVAILABLE"
        assert "this model cannot start" in index["broken"]["reason"]
        assert index["ens_good"]["state"] == "READY"
        assert index["logs"]["reason"] == "unloaded"
        client = httpclient.InferenceServerClient(served.http)
        try:
            with pytest.raises(InferenceServerException, match="this model cannot start"):
                client.load_model("broken")
            assert "this model cannot start" in _index(served)["broken"]["reason"]
            assert not client.is_server_ready()  # broken should be loaded: strict readiness
        finally:
            client.close()
    finally:
        assert served.stop() == 0, served.text()


def test_load_requests_follow_the_auto_complete_flags(models: Path) -> None:
    """Explicit mode with --disable-auto-complete-config: a load request reads configs as
    the start does (noconfig refused, completes not completed)."""
    served = start_server(
        "--model-control-mode=explicit", "--disable-auto-complete-config", repository=models
    )
    try:
        client = httpclient.InferenceServerClient(served.http)
        try:
            with pytest.raises(InferenceServerException, match="auto-complete is disabled"):
                client.load_model("noconfig")
            client.load_model("completes")
            assert client.get_model_config("completes").get("max_batch_size", 0) == 0
        finally:
            client.close()
    finally:
        assert served.stop() == 0, served.text()


def _start_fails(repository: Path, *flags: str) -> tuple[int, str]:
    """Run ``orchestrion serve`` until it exits (bounded): its exit status and output."""
    finished = subprocess.run(
        serve_command(*flags, repository=repository),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    return finished.returncode, finished.stdout + finished.stderr


def test_exit_on_error_by_default(models: Path) -> None:
    """Without --exit-on-error=false a model that fails to load stops the start: exit
    status 2, one error line naming it."""
    code, output = _start_fails(models)
    assert code == 2, output
    assert "error: " in output
    assert "broken/1/model.py" in output
    assert "this model cannot start" in output
    assert "Started HTTPService" not in output


def test_strict_model_config_refuses_a_folder_without_config(tmp_path: Path) -> None:
    """--strict-model-config=true (no --exit-on-error=false): the folder without
    config.pbtxt stops the start, named."""
    root = repository(tmp_path / "models", broken=False)
    code, output = _start_fails(root, "--strict-model-config=true")
    assert code == 2, output
    assert "noconfig/config.pbtxt: missing (auto-complete is disabled" in output
    assert "--strict-model-config is deprecated" in output


# -- the command line alone (no server) --------------------------------------------------


def _settings(*flags: str, repository: str = "/models") -> tuple[Any, Any, str]:
    args = _parser().parse_args(["serve", "--model-repository", repository, *flags])
    out = io.StringIO()
    options, logs = serve_settings(args, Console(file=out, width=300))
    return options, logs, out.getvalue()


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ([], True),
        (["--exit-on-error"], True),
        (["--exit-on-error=false"], False),
        (["--exit-on-error", "false"], False),
        (["--exit-on-error=0"], False),
        (["--exit-on-error=OFF"], False),
        (["--exit-on-error=1"], True),
        (["--exit-on-error=false", "--exit-on-error=true"], True),
    ],
)
def test_boolean_flags_take_tritons_spellings(flags: list[str], expected: bool) -> None:
    """true/false/on/off/1/0 in any case, as --flag=value or --flag value, or bare: true."""
    options, _, _ = _settings(*flags)
    assert options.exit_on_error is expected


@pytest.mark.parametrize(
    ("flags", "auto_complete", "warnings"),
    [
        ([], True, []),
        (["--strict-model-config=false"], True, ["deprecated"]),
        (["--strict-model-config"], False, ["deprecated"]),
        (["--disable-auto-complete-config"], False, []),
        (
            ["--disable-auto-complete-config", "--strict-model-config=false"],
            False,
            ["deprecated", "overrides --strict-model-config=false"],
        ),
    ],
)
def test_auto_complete_flags(flags: list[str], auto_complete: bool, warnings: list[str]) -> None:
    """As Triton's parser: --disable-auto-complete-config wins over a false
    --strict-model-config, with a warning; --strict-model-config warns it is deprecated."""
    options, _, out = _settings(*flags)
    assert options.reading.auto_complete is auto_complete
    assert len(out.splitlines()) == len(warnings)
    for text in warnings:
        assert text in out


def test_log_flags_become_log_settings(tmp_path: Path) -> None:
    """The log flags, with Triton's value types (--log-verbose takes true too)."""
    _, logs, _ = _settings()
    assert (logs.verbose, logs.info, logs.warning, logs.error) == (0, True, True, True)
    assert logs.format is None
    assert logs.file is None
    _, logs, _ = _settings(
        "--log-verbose=true",
        "--log-info=false",
        "--log-error=0",
        "--log-format=ISO8601",
        f"--log-file={tmp_path / 'x.log'}",
    )
    assert (logs.verbose, logs.info, logs.warning, logs.error) == (1, False, True, False)
    assert logs.format is LogFormat.ISO8601
    assert logs.file == tmp_path / "x.log"


def test_ignored_flags_are_named_once_in_one_warning() -> None:
    """Repeated or not, bare or with values, the flags ignored make one warning line."""
    _, _, out = _settings(
        "--backend-config=python,shm-default-byte-size=1048576",
        "--backend-config",
        "python,stub-timeout-seconds=60",
        "--allow-gpu-metrics",
        "--pinned-memory-pool-byte-size=0",
        "--grpc-use-ssl=false",
        "--allow-sagemaker=0",
    )
    assert out.splitlines() == [
        "warning: ignoring tritonserver flags that do not apply to orchestrion: "
        "--backend-config, --pinned-memory-pool-byte-size, --allow-gpu-metrics"
    ]


def test_grpc_flags_become_grpcio_options() -> None:
    """Triton's gRPC keepalive, connection-age and reuse-port flags are the grpcio server
    options Triton sets from them, with no warning."""
    options, _, out = _settings(
        "--grpc-keepalive-time=60000",
        "--grpc-keepalive-timeout",
        "5000",
        "--grpc-keepalive-permit-without-calls",
        "--grpc-http2-max-pings-without-data=0",
        "--grpc-http2-min-recv-ping-interval-without-data=10000",
        "--grpc-http2-max-ping-strikes=3",
        "--grpc-max-connection-age=600000",
        "--grpc-max-connection-age-grace=30000",
        "--reuse-grpc-port=false",
    )
    assert out == ""
    assert dict(options.grpc_channel_args) == {
        "grpc.keepalive_time_ms": 60000,
        "grpc.keepalive_timeout_ms": 5000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
        "grpc.http2.min_ping_interval_without_data_ms": 10000,
        "grpc.http2.max_ping_strikes": 3,
        "grpc.max_connection_age_ms": 600000,
        "grpc.max_connection_age_grace_ms": 30000,
        "grpc.so_reuseport": 0,
    }
    assert _settings()[0].grpc_channel_args == ()


def test_model_store_and_one_repository() -> None:
    """--model-store is --model-repository by Triton's other name."""
    args = _parser().parse_args(["serve", "--model-store=/models"])
    options, _ = serve_settings(args, Console(file=io.StringIO()))
    assert options.model_repository == Path("/models")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grpc-use-ssl=true"], "--grpc-use-ssl=true is not supported"),
        (["--grpc-use-ssl-mutual"], "--grpc-use-ssl-mutual=true is not supported"),
        (["--allow-vertex-ai=1"], "there is no Vertex AI endpoint"),
        (["--model-store", "/elsewhere"], "given more than once"),
        (["--model-config-name=../x"], "is not a plain file name"),
    ],
)
def test_refused_flags_stop_the_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """A flag whose absence would mislead stops the start: status 2, one error line."""
    assert cli(["serve", "--model-repository", str(tmp_path), *flags]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: ")
    assert message in out


@pytest.mark.parametrize(
    "flags",
    [["--exit-on-error=maybe"], ["--model-load-thread-count=four"], ["--log-format=iso8601"]],
)
def test_malformed_values_are_refused_as_triton_does(flags: list[str]) -> None:
    """A value of the wrong type is a usage error (Triton: "invalid value")."""
    with pytest.raises(SystemExit) as refused:
        _parser().parse_args(["serve", "--model-repository", "/m", *flags])
    assert refused.value.code == 2
